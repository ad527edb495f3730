// Which transport joins the ranks: the one file that knows both (MPI in comm/, NCCL in cuda/).
#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "metrale/backend.h"
#include "metrale/communicator.h"
#include "metrale/error.h"
#if METRALE_HAVE_MPI
#include "comm/mpi_communicator.h"
#include "comm/mpi_loader.h"
#endif
#include "comm/id_file.h"
#if METRALE_HAVE_CUDA
#include "cuda/backend.h"
#include "cuda/nccl_communicator.h"
#include "cuda/nccl_loader.h"
#endif

namespace metrale {
namespace {

constexpr std::string_view kApi = "Communicator::create";

TransportInfo mpi_info() {
  TransportInfo info{"mpi", false, {}};
#if METRALE_HAVE_MPI
  const comm::MpiLoad& load = comm::load_mpi();
  info.available = load.api != nullptr;
  info.detail = info.available ? fmt::format("{} ({})", load.version, load.library) : load.reason;
#else
  info.detail =
      "MPI unavailable: this build of metrale has no MPI transport (OpenMPI's mpi.h "
      "was not found when it was built; install libopenmpi-dev)";
#endif
  return info;
}

TransportInfo nccl_info() {
  TransportInfo info{"nccl", false, {}};
#if METRALE_HAVE_CUDA
  const cuda::NcclLoad& load = cuda::load_nccl();
  info.available = load.api != nullptr;
  info.detail = info.available ? fmt::format("NCCL {} ({})",
                                             cuda::nccl_version_string(load.version), load.library)
                               : load.reason;
#else
  info.detail = "NCCL unavailable: this build of metrale has no CUDA backend";
#endif
  return info;
}

#if METRALE_HAVE_CUDA
// An integer environment variable, or -1 when unset or not a number.
int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == 0) return -1;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  return (*end == 0 && n >= 0 && n < (1 << 24)) ? static_cast<int>(n) : -1;
}

// This rank's place and the id's route for NCCL (CommunicatorOptions says the order).
cuda::NcclJoin nccl_join(const CommunicatorOptions& options) {
  cuda::NcclJoin join;
  if ((options.rank >= 0) != (options.size >= 0)) {
    throw Error(ErrorCode::kInvalidArgument, kApi, "give both rank and size, or neither");
  }
  if (options.id_file.empty()) {
#if METRALE_HAVE_MPI
    const comm::MpiPlace place = comm::mpi_place();
    join.rank = place.rank;
    join.size = place.size;
    if (options.rank >= 0 && (options.rank != join.rank || options.size != join.size)) {
      throw Error(ErrorCode::kInvalidArgument, kApi,
                  fmt::format("rank {} of {} was asked for, but MPI says this process is rank {} "
                              "of {}",
                              options.rank, options.size, join.rank, join.size));
    }
    const auto timeout = options.timeout;
    join.exchange = [timeout](std::span<std::byte> id) {
      comm::mpi_broadcast_bytes(id, 0, timeout);
    };
    return join;
#else
    throw Error(ErrorCode::kUnavailable, kApi,
                "NCCL's id needs an id file or MPI, and this build has no MPI transport");
#endif
  }
  if (options.rank >= 0) {
    join.rank = options.rank;
    join.size = options.size;
  } else if (env_int("OMPI_COMM_WORLD_RANK") >= 0 && env_int("OMPI_COMM_WORLD_SIZE") > 0) {
    join.rank = env_int("OMPI_COMM_WORLD_RANK");
    join.size = env_int("OMPI_COMM_WORLD_SIZE");
  } else if (env_int("RANK") >= 0 && env_int("WORLD_SIZE") > 0) {
    join.rank = env_int("RANK");
    join.size = env_int("WORLD_SIZE");
  }
  const std::string path = options.id_file;
  const int rank = join.rank;
  const auto timeout = options.timeout;
  join.exchange = [path, rank, timeout](std::span<std::byte> id) {
    if (rank == 0) {
      comm::write_id_file(path, id);
    } else {
      comm::read_id_file(path, id, timeout);
    }
  };
  return join;
}
#endif

}  // namespace

std::vector<TransportInfo> discover_transports() {
  return {mpi_info(), nccl_info()};
}

std::unique_ptr<Communicator> make_communicator(Backend& backend,
                                                const CommunicatorOptions& options) {
  if (options.timeout.count() <= 0) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                fmt::format("timeout {} ms is not positive", options.timeout.count()));
  }
  if (options.transport != "auto" && options.transport != "mpi" && options.transport != "nccl") {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                fmt::format("unknown transport '{}' (auto, mpi, nccl)", options.transport));
  }
  const bool on_cuda = backend.name() == "cuda";
  std::string transport = options.transport;
  if (transport == "auto") transport = on_cuda && nccl_info().available ? "nccl" : "mpi";
  if (transport == "nccl") {
#if METRALE_HAVE_CUDA
    if (!on_cuda) {
      throw Error(ErrorCode::kInvalidArgument, kApi,
                  fmt::format("NCCL joins CUDA backends; this backend is {}", backend.name()));
    }
    const cuda::NcclLoad& load = cuda::load_nccl();
    if (load.api == nullptr) throw Error(ErrorCode::kUnavailable, kApi, load.reason);
    const cuda::NcclJoin join = nccl_join(options);
    auto comm =
        cuda::make_nccl_communicator(static_cast<CudaBackend&>(backend), *load.api, join, options);
    // Every rank has joined, so every rank has read the id: the file has done its job.
    if (join.rank == 0 && !options.id_file.empty()) std::remove(options.id_file.c_str());
    return comm;
#else
    throw Error(ErrorCode::kUnavailable, kApi, nccl_info().detail);
#endif
  }
#if METRALE_HAVE_MPI
  return comm::make_mpi_communicator(backend, options);
#else
  throw Error(ErrorCode::kUnavailable, kApi, mpi_info().detail);
#endif
}

Communicator& create_communicator(ModelScope& scope, const CommunicatorOptions& options) {
  auto comm = make_communicator(scope.backend(), options);
  return scope.add(std::make_unique<CommunicatorResource>(std::move(comm))).get();
}

}  // namespace metrale
