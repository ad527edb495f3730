// The NCCL transport. Communicators are nonblocking (config.blocking = 0), so creation and each
// collective return at once and are polled: ncclCommGetAsyncError for NCCL's own state, then an
// event recorded after the call for the stream's. A wait that passes the timeout aborts the
// communicator (ncclCommAbort frees what a hung collective holds) and throws kTimeout. NCCL has
// no channel for a message, so a rank's abort() reaches the others as their collectives failing
// or timing out, not with its reason. See Note [collectives block] in docs/NOTES.md.
#include "cuda/nccl_communicator.h"

#include <fmt/format.h>

#include <chrono>
#include <string>
#include <string_view>
#include <thread>

#include "cuda/backend.h"
#include "cuda/nccl_api.h"
#include "metrale/error.h"

namespace metrale::cuda {
namespace {

using Clock = std::chrono::steady_clock;

// "ncclAllReduce: unhandled cuda error (run with NCCL_DEBUG=INFO for details): <last error>".
std::string describe(const NcclApi& api, std::string_view call, ncclResult_t r, ncclComm_t comm) {
  std::string text = fmt::format("{}: {}", call, api.ncclGetErrorString(r));
  const char* last = api.ncclGetLastError(comm);
  if (last != nullptr && *last != 0) text += fmt::format(" ({})", last);
  return text;
}

// Polls comm's asynchronous state until it leaves ncclInProgress or the deadline passes; on the
// deadline it aborts comm and throws kTimeout. Throws kDriver for an error state (comm kept:
// the caller decides).
void settle(const NcclApi& api, std::string_view where, std::string_view call, ncclComm_t comm,
            Clock::time_point deadline, const std::string& late) {
  for (std::uint64_t spins = 0;; ++spins) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = api.ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess)
      throw Error(ErrorCode::kDriver, where, describe(api, "ncclCommGetAsyncError", r, comm));
    if (state == ncclSuccess) return;
    if (state != ncclInProgress)
      throw Error(ErrorCode::kDriver, where, describe(api, call, state, comm));
    if (Clock::now() >= deadline) {
      api.ncclCommAbort(comm);
      throw Error(ErrorCode::kTimeout, where, late);
    }
    if (spins < 1000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(CudaBackend& backend, const NcclApi& api, int rank, int size,
                   std::chrono::milliseconds timeout, ncclComm_t comm)
      : Communicator(backend, rank, size, timeout), cuda_(backend), api_(api), comm_(comm) {}

  ~NcclCommunicator() override {
    try {
      release();
    } catch (...) {  // release() is where failures surface; a destructor reports nothing
    }
  }

  std::string_view transport() const noexcept override { return "nccl"; }

 protected:
  void raw_all_reduce_sum(DevicePtr in, DevicePtr out, std::size_t count, ReduceType type,
                          StreamHandle stream) override {
    const ncclDataType_t t = type == ReduceType::kBf16 ? ncclBfloat16 : ncclFloat32;
    collective(
        "Communicator::all_reduce_sum", "ncclAllReduce", stream,
        [&](cudaStream_t s) {
          return api_.ncclAllReduce(pointer(in), pointer(out), count, t, ncclSum, comm_, s);
        },
        fmt::format("{} {} elements", count, to_string(type)));
  }

  void raw_all_gather(DevicePtr in, DevicePtr out, std::size_t bytes,
                      StreamHandle stream) override {
    collective(
        "Communicator::all_gather", "ncclAllGather", stream,
        [&](cudaStream_t s) {
          return api_.ncclAllGather(pointer(in), pointer(out), bytes, ncclUint8, comm_, s);
        },
        fmt::format("{} bytes per rank", bytes));
  }

  void raw_broadcast(DevicePtr buffer, std::size_t bytes, int root, StreamHandle stream) override {
    collective(
        "Communicator::broadcast", "ncclBroadcast", stream,
        [&](cudaStream_t s) {
          return api_.ncclBroadcast(pointer(buffer), pointer(buffer), bytes, ncclUint8, root, comm_,
                                    s);
        },
        fmt::format("{} bytes from rank {}", bytes, root));
  }

  // NCCL has no barrier: an all-reduce of one float on the default stream stands for it.
  void raw_barrier() override {
    if (!token_) token_ = backend().alloc(sizeof(float));
    collective(
        "Communicator::barrier", "ncclAllReduce", {},
        [&](cudaStream_t s) {
          return api_.ncclAllReduce(pointer(token_), pointer(token_), 1, ncclFloat32, ncclSum,
                                    comm_, s);
        },
        "1 float");
  }

  void raw_abort(const std::string& /*message*/) noexcept override {
    if (comm_ == nullptr) return;
    // noexcept: the throwing bind would end the process here (std::terminate) when
    // cuCtxSetCurrent fails. Unbound, NCCL is still told to abort; its own result is all we have.
    cuda_.host().bind_quietly();
    api_.ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  void raw_release() override {
    std::string failure;
    if (comm_ != nullptr) {
      cuda_.bind_to_thread();
      ncclComm_t comm = std::exchange(comm_, nullptr);
      // Finalize flushes what is queued; a rank whose peers are gone would wait on it forever,
      // so it has the timeout, after which settle aborts the communicator.
      const ncclResult_t r = api_.ncclCommFinalize(comm);
      try {
        if (r != ncclSuccess && r != ncclInProgress) {
          throw Error(ErrorCode::kDriver, "Communicator::release",
                      describe(api_, "ncclCommFinalize", r, comm));
        }
        settle(api_, "Communicator::release", "ncclCommFinalize", comm, Clock::now() + timeout(),
               fmt::format("ncclCommFinalize did not finish within {} ms", timeout().count()));
        api_.ncclCommDestroy(comm);
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kTimeout) api_.ncclCommAbort(comm);
        failure = e.what();
      }
    }
    if (token_) {
      backend().free(token_);
      token_ = {};
    }
    if (!failure.empty()) {
      throw Error(ErrorCode::kDriver, "Communicator::release", failure);
    }
  }

 private:
  static void* pointer(DevicePtr p) { return reinterpret_cast<void*>(p.address()); }

  // Enqueues one collective and waits for it: NCCL's state first, then the stream's.
  template <class Call>
  void collective(std::string_view where, std::string_view call, StreamHandle stream,
                  Call&& enqueue, const std::string& what) {
    cuda_.bind_to_thread();
    const cudaStream_t s = cuda_.driver_stream(where, stream);
    const auto deadline = Clock::now() + timeout();
    const std::string late = fmt::format(
        "{} of {} did not complete within {} ms on rank {} of {}: another rank is "
        "stuck, gone, or never made this call",
        call, what, timeout().count(), rank(), size());
    const ncclResult_t r = enqueue(s);
    if (r != ncclSuccess && r != ncclInProgress) {
      throw Error(ErrorCode::kDriver, where, describe(api_, call, r, comm_));
    }
    try {
      settle(api_, where, call, comm_, deadline, late);
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kTimeout) comm_ = nullptr;  // settle aborted it
      throw;
    }
    // The collective is queued; its kernels finish on the stream.
    const EventHandle done = backend().create_event();
    try {
      backend().record_event(done, stream);
      for (std::uint64_t spins = 0; backend().event_query(done) != EventStatus::kDone; ++spins) {
        ncclResult_t state = ncclSuccess;
        if (api_.ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state != ncclSuccess &&
            state != ncclInProgress) {
          throw Error(ErrorCode::kDriver, where, describe(api_, call, state, comm_));
        }
        if (Clock::now() >= deadline) {
          api_.ncclCommAbort(comm_);
          comm_ = nullptr;
          throw Error(ErrorCode::kTimeout, where, late);
        }
        if (spins < 1000) {
          std::this_thread::yield();
        } else {
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
      }
    } catch (...) {
      backend().destroy_event(done);
      throw;
    }
    backend().destroy_event(done);
  }

  CudaBackend& cuda_;
  const NcclApi& api_;
  ncclComm_t comm_;
  DevicePtr token_;  // the barrier's float, made on first use
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(CudaBackend& backend, const NcclApi& api,
                                                     const NcclJoin& join,
                                                     const CommunicatorOptions& options) {
  constexpr std::string_view kApi = "Communicator::create";
  if (join.size < 1 || join.rank < 0 || join.rank >= join.size) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                fmt::format("rank {} of {} is not a place in a group", join.rank, join.size));
  }
  const auto deadline = Clock::now() + options.timeout;
  ncclUniqueId id{};
  if (join.rank == 0) {
    const ncclResult_t r = api.ncclGetUniqueId(&id);
    if (r != ncclSuccess)
      throw Error(ErrorCode::kDriver, kApi, describe(api, "ncclGetUniqueId", r, nullptr));
  }
  if (join.exchange) join.exchange(std::as_writable_bytes(std::span(id.internal)));
  backend.bind_to_thread();
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t r = api.ncclCommInitRankConfig(&comm, join.size, id, join.rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    std::string why = describe(api, "ncclCommInitRankConfig", r, comm);
    if (comm != nullptr) api.ncclCommAbort(comm);
    throw Error(ErrorCode::kDriver, kApi, why);
  }
  try {
    settle(api, kApi, "ncclCommInitRankConfig", comm, deadline,
           fmt::format("the {} ranks did not all join within {} ms (rank {} waited)", join.size,
                       options.timeout.count(), join.rank));
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kTimeout) api.ncclCommAbort(comm);
    throw;
  }
  return std::make_unique<NcclCommunicator>(backend, api, join.rank, join.size, options.timeout,
                                            comm);
}

}  // namespace metrale::cuda
