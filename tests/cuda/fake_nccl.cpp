#include "cuda/fake_nccl.h"

#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>

namespace metrale::cuda::testing {

// A communicator of the fake: ncclComm_t points at one of these.
struct FakeComm {
  int rank = 0;
  int size = 1;
  ncclResult_t state = ncclSuccess;
};

struct FakeNccl::State {
  std::mutex mu;
  NcclApi api;
  ncclResult_t init_result = ncclSuccess;
  bool hang_init = false;
  ncclResult_t collective_result = ncclSuccess;
  bool hang_collectives = false;
  ncclResult_t finalize_result = ncclSuccess;
  std::map<std::string, std::uint64_t> calls;
  std::set<FakeComm*> live;
  int last_rank = -1, last_size = -1, last_blocking = -1;
  cudaStream_t last_stream = nullptr;
  std::string last_error;
};

namespace {

FakeNccl::State* g_state = nullptr;

FakeNccl::State& state(const char* call) {
  if (g_state == nullptr) throw std::logic_error("a fake NCCL call after its FakeNccl is gone");
  std::lock_guard lock(g_state->mu);
  ++g_state->calls[call];
  return *g_state;
}

FakeComm* live_comm(FakeNccl::State& s, ncclComm_t comm) {
  auto* c = reinterpret_cast<FakeComm*>(comm);
  return s.live.contains(c) ? c : nullptr;
}

ncclResult_t fake_version(int* v) {
  state("ncclGetVersion");
  *v = 22809;
  return ncclSuccess;
}

const char* fake_error_string(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError:
      return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError:
      return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument:
      return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage:
      return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "unknown result code";
  }
}

const char* fake_last_error(ncclComm_t) {
  FakeNccl::State& s = state("ncclGetLastError");
  std::lock_guard lock(s.mu);
  return s.last_error.c_str();
}

ncclResult_t fake_unique_id(ncclUniqueId* id) {
  state("ncclGetUniqueId");
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; ++i) id->internal[i] = static_cast<char>(i * 7 + 1);
  return ncclSuccess;
}

ncclResult_t fake_init(ncclComm_t* comm, int nranks, ncclUniqueId, int rank, ncclConfig_t* config) {
  FakeNccl::State& s = state("ncclCommInitRankConfig");
  std::lock_guard lock(s.mu);
  s.last_rank = rank;
  s.last_size = nranks;
  s.last_blocking = config != nullptr ? config->blocking : -1;
  if (s.init_result != ncclSuccess) {
    s.last_error = "fake: init refused";
    *comm = nullptr;
    return s.init_result;
  }
  auto* c = new FakeComm{rank, nranks, s.hang_init ? ncclInProgress : ncclSuccess};
  s.live.insert(c);
  *comm = reinterpret_cast<ncclComm_t>(c);
  return config != nullptr && config->blocking == 0 ? ncclInProgress : ncclSuccess;
}

ncclResult_t fake_async_error(ncclComm_t comm, ncclResult_t* async) {
  FakeNccl::State& s = state("ncclCommGetAsyncError");
  std::lock_guard lock(s.mu);
  FakeComm* c = live_comm(s, comm);
  if (c == nullptr) return ncclInvalidArgument;
  *async = c->state;
  return ncclSuccess;
}

ncclResult_t fake_finalize(ncclComm_t comm) {
  FakeNccl::State& s = state("ncclCommFinalize");
  std::lock_guard lock(s.mu);
  if (live_comm(s, comm) == nullptr) return ncclInvalidArgument;
  return s.finalize_result;
}

// ncclCommDestroy and ncclCommAbort alike: the communicator is gone (the fake has no queued
// work for destroy to flush).
ncclResult_t end_comm(const char* call, ncclComm_t comm) {
  FakeNccl::State& s = state(call);
  std::lock_guard lock(s.mu);
  FakeComm* c = live_comm(s, comm);
  if (c == nullptr) return ncclInvalidArgument;
  s.live.erase(c);
  delete c;
  return ncclSuccess;
}

ncclResult_t fake_destroy(ncclComm_t comm) {
  return end_comm("ncclCommDestroy", comm);
}

ncclResult_t fake_abort(ncclComm_t comm) {
  return end_comm("ncclCommAbort", comm);
}

std::size_t type_bytes(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclFloat64:
    case ncclInt64:
    case ncclUint64:
      return 8;
    default:
      return 4;
  }
}

// The common part of a collective: the communicator's state, then the data moved as a group of
// one moves it.
ncclResult_t fake_collective(const char* call, ncclComm_t comm, cudaStream_t stream,
                             const void* send, void* recv, std::size_t bytes) {
  FakeNccl::State& s = state(call);
  std::lock_guard lock(s.mu);
  FakeComm* c = live_comm(s, comm);
  if (c == nullptr) return ncclInvalidArgument;
  s.last_stream = stream;
  if (s.collective_result != ncclSuccess) {
    s.last_error = std::string("fake: ") + call + " refused";
    return s.collective_result;
  }
  if (s.hang_collectives) {
    c->state = ncclInProgress;
    return ncclInProgress;
  }
  if (c->size != 1) {
    s.last_error = "fake: data moves only in a group of one";
    return ncclInvalidUsage;
  }
  if (send != recv) std::memmove(recv, send, bytes);
  return ncclSuccess;
}

ncclResult_t fake_all_reduce(const void* send, void* recv, std::size_t count, ncclDataType_t t,
                             ncclRedOp_t, ncclComm_t comm, cudaStream_t stream) {
  return fake_collective("ncclAllReduce", comm, stream, send, recv, count * type_bytes(t));
}

ncclResult_t fake_all_gather(const void* send, void* recv, std::size_t count, ncclDataType_t t,
                             ncclComm_t comm, cudaStream_t stream) {
  return fake_collective("ncclAllGather", comm, stream, send, recv, count * type_bytes(t));
}

ncclResult_t fake_broadcast(const void* send, void* recv, std::size_t count, ncclDataType_t t, int,
                            ncclComm_t comm, cudaStream_t stream) {
  return fake_collective("ncclBroadcast", comm, stream, send, recv, count * type_bytes(t));
}

}  // namespace

FakeNccl::FakeNccl() : state_(std::make_unique<State>()) {
  if (g_state != nullptr) throw std::logic_error("only one FakeNccl may exist at a time");
  g_state = state_.get();
  NcclApi& a = state_->api;
  a.ncclGetVersion = fake_version;
  a.ncclGetErrorString = fake_error_string;
  a.ncclGetLastError = fake_last_error;
  a.ncclGetUniqueId = fake_unique_id;
  a.ncclCommInitRankConfig = fake_init;
  a.ncclCommGetAsyncError = fake_async_error;
  a.ncclCommFinalize = fake_finalize;
  a.ncclCommDestroy = fake_destroy;
  a.ncclCommAbort = fake_abort;
  a.ncclAllReduce = fake_all_reduce;
  a.ncclAllGather = fake_all_gather;
  a.ncclBroadcast = fake_broadcast;
}

FakeNccl::~FakeNccl() {
  for (FakeComm* c : state_->live) delete c;
  g_state = nullptr;
}

const NcclApi& FakeNccl::api() const {
  return state_->api;
}

void FakeNccl::fail_init(ncclResult_t status) {
  std::lock_guard lock(state_->mu);
  state_->init_result = status;
}
void FakeNccl::hang_init(bool hang) {
  std::lock_guard lock(state_->mu);
  state_->hang_init = hang;
}
void FakeNccl::fail_collectives(ncclResult_t status) {
  std::lock_guard lock(state_->mu);
  state_->collective_result = status;
}
void FakeNccl::hang_collectives(bool hang) {
  std::lock_guard lock(state_->mu);
  state_->hang_collectives = hang;
}
void FakeNccl::fail_finalize(ncclResult_t status) {
  std::lock_guard lock(state_->mu);
  state_->finalize_result = status;
}

std::uint64_t FakeNccl::calls(const std::string& call) const {
  static const std::set<std::string> kNames = {
#define METRALE_NCCL_NAME(name) #name,
      METRALE_NCCL_FUNCTIONS(METRALE_NCCL_NAME)
#undef METRALE_NCCL_NAME
  };
  if (!kNames.contains(call)) throw std::invalid_argument("not an NCCL call of the table: " + call);
  std::lock_guard lock(state_->mu);
  auto it = state_->calls.find(call);
  return it == state_->calls.end() ? 0 : it->second;
}

int FakeNccl::live_comms() const {
  std::lock_guard lock(state_->mu);
  return static_cast<int>(state_->live.size());
}
int FakeNccl::last_rank() const {
  return state_->last_rank;
}
int FakeNccl::last_size() const {
  return state_->last_size;
}
int FakeNccl::last_blocking() const {
  return state_->last_blocking;
}
cudaStream_t FakeNccl::last_stream() const {
  return state_->last_stream;
}

}  // namespace metrale::cuda::testing
