#include "comm/mpi_loader.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string_view>
#include <thread>

#include "comm/mpi_api.h"
#include "metrale/error.h"

namespace metrale::comm {

MpiLoad load_mpi_from(const char* library) {
  MpiLoad out;
  out.library = library;
  // RTLD_GLOBAL: OpenMPI dlopens its own components, which resolve libmpi's symbols globally.
  void* handle = dlopen(library, RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) {
    const char* err = dlerror();
    out.reason = fmt::format("MPI unavailable: cannot load {} ({})", library,
                             err != nullptr ? err : "unknown error");
    return out;
  }
  std::unique_ptr<void, int (*)(void*)> guard(handle, dlclose);
  auto api = std::make_unique<MpiApi>();
  std::string missing;
  auto note_missing = [&](std::string_view name) {
    if (!missing.empty()) missing += ", ";
    missing += name;
  };
#define METRALE_MPI_RESOLVE(name)                                        \
  api->name = reinterpret_cast<decltype(&::name)>(dlsym(handle, #name)); \
  if (api->name == nullptr) note_missing(#name);
  METRALE_MPI_FUNCTIONS(METRALE_MPI_RESOLVE)
#undef METRALE_MPI_RESOLVE
  // OpenMPI's predefined handles are the addresses of these objects.
  auto object = [&](const char* name) {
    void* p = dlsym(handle, name);
    if (p == nullptr) note_missing(name);
    return p;
  };
  api->comm_world = static_cast<MPI_Comm>(object("ompi_mpi_comm_world"));
  api->byte = static_cast<MPI_Datatype>(object("ompi_mpi_byte"));
  api->errors_return = static_cast<MPI_Errhandler>(object("ompi_mpi_errors_return"));
  api->request_null = static_cast<MPI_Request>(object("ompi_request_null"));
  if (!missing.empty()) {
    out.reason =
        fmt::format("MPI unavailable: {} lacks {} (OpenMPI's libmpi is needed)", library, missing);
    return out;
  }
  char text[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int length = 0;
  if (api->MPI_Get_library_version(text, &length) == MPI_SUCCESS) {
    std::string_view v(text, static_cast<std::size_t>(length));
    out.version = std::string(v.substr(0, v.find_first_of(",\n")));
  }
  guard.release();  // the table's pointers lead into the library for the rest of the process
  out.api = api.release();
  return out;
}

const MpiLoad& load_mpi() {
  // METRALE_MPI_LIBRARY, when set, names the library instead (another OpenMPI build).
  static const MpiLoad load = [] {
    const char* env = std::getenv("METRALE_MPI_LIBRARY");
    return load_mpi_from(env != nullptr && *env != 0 ? env : "libmpi.so.40");
  }();
  return load;
}

std::string mpi_error_text(const MpiApi& api, int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (api.MPI_Error_string(code, text, &length) != MPI_SUCCESS) {
    return fmt::format("MPI error {}", code);
  }
  return std::string(text, static_cast<std::size_t>(length));
}

namespace {

struct WorldState {
  std::mutex mu;
  bool done = false;
  MpiWorld world;
  std::string failure;
  const MpiApi* finalize_with = nullptr;           // set when metrale initialized MPI
  std::atomic<std::int64_t> finalize_bound_ms{0};  // 0: finalize unbounded (no group failed)
};

WorldState& world_state() {
  static WorldState* state = new WorldState;  // outlives every static destructor
  return *state;
}

// Run by exit() (on_exit, for the status): MPI_Finalize is a fence over every rank, so after a
// failed collective it may wait forever on a rank that died. A watchdog then ends the process
// with the status exit() was given once the bound passes.
void finalize_at_exit(int status, void* /*unused*/) {
  WorldState& s = world_state();
  const MpiApi* api = s.finalize_with;
  int finalized = 1;
  if (api == nullptr || api->MPI_Finalized(&finalized) != MPI_SUCCESS || finalized != 0) return;
  const std::int64_t bound_ms = s.finalize_bound_ms.load();
  if (bound_ms > 0) {
    try {
      std::thread([status, bound_ms] {
        std::this_thread::sleep_for(std::chrono::milliseconds(bound_ms));
        std::fprintf(stderr,
                     "metrale: MPI_Finalize did not return within %lld ms after a failed "
                     "collective (a rank is gone or stuck); exiting without it\n",
                     static_cast<long long>(bound_ms));
        std::_Exit(status);
      }).detach();
    } catch (...) {  // no thread: finalize unguarded, as MPI itself would
    }
  }
  api->MPI_Finalize();
}

}  // namespace

void bound_mpi_finalize(std::chrono::milliseconds wait) noexcept {
  constexpr std::int64_t kLeast = 5'000;  // healthy ranks still tearing down reach it late
  const std::int64_t want = std::max<std::int64_t>(wait.count(), kLeast);
  std::atomic<std::int64_t>& bound = world_state().finalize_bound_ms;
  std::int64_t have = bound.load();
  while (have < want && !bound.compare_exchange_weak(have, want)) {
  }
}

MpiWorld mpi_world(const MpiApi& api) {
  WorldState& s = world_state();
  std::lock_guard lock(s.mu);
  if (s.done) {
    if (!s.failure.empty()) throw Error(ErrorCode::kUnavailable, "mpi", s.failure);
    return s.world;
  }
  s.done = true;
  auto fail = [&](std::string why) {
    s.failure = "MPI unavailable: " + std::move(why);
    throw Error(ErrorCode::kUnavailable, "mpi", s.failure);
  };
  int initialized = 0;
  if (api.MPI_Initialized(&initialized) != MPI_SUCCESS) fail("MPI_Initialized failed");
  if (initialized == 0) {
    int provided = 0;
    const int rc = api.MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) fail("MPI_Init_thread: " + mpi_error_text(api, rc));
    s.finalize_with = &api;
    on_exit(finalize_at_exit, nullptr);  // glibc: the handler gets exit's status
    if (provided < MPI_THREAD_MULTIPLE) {
      fail(fmt::format("the library gives thread level {}, not MPI_THREAD_MULTIPLE", provided));
    }
  }
  if (api.MPI_Comm_rank(api.comm_world, &s.world.rank) != MPI_SUCCESS ||
      api.MPI_Comm_size(api.comm_world, &s.world.size) != MPI_SUCCESS) {
    fail("cannot read this process's place in MPI_COMM_WORLD");
  }
  return s.world;
}

}  // namespace metrale::comm
