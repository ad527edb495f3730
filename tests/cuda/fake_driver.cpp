// The fake CUDA driver (see fake_driver.h). Every entry point has exactly its PFN signature,
// finds the one live State through g_state and works under State::mutex; kernel bodies run with
// the mutex released, so a body may call back into the fake. Device pointers are host addresses
// of real (aligned_alloc) memory, so a body may also read and write them directly.
#include "cuda/fake_driver.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <mutex>
#include <stdexcept>
#include <string_view>
#include <utility>
#include <variant>

#include "cuda/status.h"

namespace metrale::cuda::testing {

namespace {

constexpr std::size_t kAlign = 256;
constexpr int kDefaultDynamicShared = 48 * 1024;  // without cuFuncSetAttribute
constexpr int kSharedOptin = 232448;              // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
constexpr unsigned char kFreshByte = 0xA5;        // new memory is not zeroed, as on a GPU
constexpr std::string_view kImagePrefix = "FAKEMOD:";

enum class Kind { kDevice, kManaged, kHost, kGlobal };

struct Alloc {
  std::size_t size = 0;  // requested bytes: ranges are checked against this, not the capacity
  Kind kind = Kind::kDevice;
  int device = 0;
};

// A copy or memset: the device ranges it touches (checked when queued and again when replayed)
// and the work itself.
struct MemOp {
  struct Range {
    CUdeviceptr start = 0;
    std::size_t bytes = 0;
  };
  std::vector<Range> ranges;
  std::function<void()> apply;
};

// 16-byte aligned storage for copied kernel arguments.
struct alignas(16) ArgChunk {
  std::byte bytes[16];
};

struct LaunchOp {
  FakeLaunch launch;  // params unset
  std::function<void(const FakeLaunch&)> body;
  void** caller_params = nullptr;      // used when the function declares no param_sizes
  std::vector<ArgChunk> args;          // copied arguments, each starting on a chunk
  std::vector<std::size_t> arg_chunk;  // first chunk of each argument
};

using Node = std::variant<MemOp, LaunchOp>;

struct Stream {
  bool non_blocking = false;
  CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
  std::vector<Node> nodes;  // recorded while capturing
};

struct Event {
  bool captured = false;  // last recorded in a capturing stream
};

struct LoadedModule {
  FakeModule desc;                              // as registered when loaded
  std::map<std::string, CUfunction> functions;  // handed out so far, by entry name
  std::map<std::string, CUdeviceptr> globals;   // storage lives in State::allocs (kGlobal)
};

struct Function {
  std::string name;
  FakeFunction fn;
  int max_dynamic = -1;  // set by cuFuncSetAttribute; -1: the 48 KiB default applies
};

struct FailRule {
  std::uint64_t nth = 0;
  bool onward = false;  // fail_from rather than fail_at
  CUresult status = CUDA_SUCCESS;
};

CUdeviceptr to_dptr(const void* p) {
  return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p));
}
void* to_host(CUdeviceptr d) {
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(d));
}

}  // namespace

struct FakeDriver::State {
  std::mutex mutex;
  std::uint64_t id = 0;  // tells this fake's current-context records from an earlier fake's
  DriverApi api;
  std::vector<FakeDevice> devices;
  std::vector<CUcontext> contexts;  // one primary context handle per device
  std::vector<int> retains;         // per device
  CUresult init_status = CUDA_SUCCESS;
  bool initialized = false;
  int driver_version = 13000;
  bool events_ready = true;
  CUresult sticky = CUDA_SUCCESS;
  std::map<std::string, FakeModule> registered;
  std::map<std::string, std::uint64_t, std::less<>> calls;
  std::map<std::string, std::vector<FailRule>, std::less<>> failures;
  std::vector<FakeLaunch> launches;
  std::uint64_t replays = 0;
  std::map<std::string, int> last_max_dynamic;
  std::map<CUdeviceptr, Alloc> allocs;  // every live block, by base address
  std::uintptr_t next_handle = 0x10000;
  Stream legacy;  // the NULL stream; never captures
  std::map<CUstream, Stream> streams;
  std::map<CUevent, Event> events;
  std::map<CUmodule, LoadedModule> modules;
  std::map<CUfunction, Function> functions;
  std::map<CUgraph, std::vector<Node>> graphs;
  std::map<CUgraphExec, std::vector<Node>> execs;
};

namespace {

using State = FakeDriver::State;

std::atomic<State*> g_state{nullptr};
std::atomic<std::uint64_t> g_next_id{1};

// The calling thread's current context, tagged with the fake that set it.
struct Current {
  std::uint64_t owner = 0;
  CUcontext ctx = nullptr;
};
thread_local Current t_current;

// Handles are fake addresses that are never reused, so a stale handle stays invalid.
template <class Handle>
Handle new_handle(State& s) {
  s.next_handle += 16;
  return reinterpret_cast<Handle>(s.next_handle);
}

// The device of the calling thread's current context, or -1 when there is no live one.
int current_device(const State& s) {
  if (t_current.owner != s.id || t_current.ctx == nullptr) return -1;
  for (std::size_t d = 0; d < s.contexts.size(); ++d) {
    if (s.contexts[d] == t_current.ctx && s.retains[d] > 0) return static_cast<int>(d);
  }
  return -1;
}

enum class Need { kNothing, kInit, kContext };

// An open entry point: the state, its lock, and the status to return at once if not success.
struct Gate {
  State* s = nullptr;
  std::unique_lock<std::mutex> lock;
  CUresult status = CUDA_SUCCESS;
};

// Counts the call, then applies (in order) injected failures, the cuInit rule and the
// current-context rule.
Gate enter(std::string_view name, Need need) {
  Gate g;
  g.s = g_state.load();
  if (g.s == nullptr) {
    g.status = CUDA_ERROR_DEINITIALIZED;
    return g;
  }
  State& s = *g.s;
  g.lock = std::unique_lock(s.mutex);
  auto count = s.calls.find(name);
  if (count == s.calls.end()) count = s.calls.emplace(std::string(name), 0).first;
  const std::uint64_t n = ++count->second;
  if (auto rules = s.failures.find(name); rules != s.failures.end()) {
    for (const FailRule& r : rules->second) {  // the first rule added that matches wins
      if (n == r.nth || (r.onward && n > r.nth)) {
        g.status = r.status;
        return g;
      }
    }
  }
  if (need != Need::kNothing && !s.initialized) {
    g.status = CUDA_ERROR_NOT_INITIALIZED;
  } else if (need == Need::kContext && current_device(s) < 0) {
    g.status = CUDA_ERROR_INVALID_CONTEXT;
  }
  return g;
}

// Opens an entry point. The name counted is the function's name without "fake_", which is
// the driver's name (the table is filled by the same X-macro, so the two cannot drift).
#define FAKE_ENTER(need)                                      \
  Gate g = enter(std::string_view(__func__).substr(5), need); \
  if (g.status != CUDA_SUCCESS) return g.status;              \
  [[maybe_unused]] State& s = *g.s

#define FAKE_STICKY() \
  if (s.sticky != CUDA_SUCCESS) return s.sticky

// ---- memory ----

// The live block holding all of [p, p + bytes) (bytes > 0), or null.
const Alloc* find_range(const State& s, CUdeviceptr p, std::size_t bytes) {
  auto it = s.allocs.upper_bound(p);
  if (it == s.allocs.begin()) return nullptr;
  --it;
  const std::size_t offset = p - it->first;
  if (offset >= it->second.size || bytes > it->second.size - offset) return nullptr;
  return &it->second;
}

bool ranges_valid(const State& s, const MemOp& op) {
  for (const MemOp::Range& r : op.ranges) {
    if (r.bytes != 0 && find_range(s, r.start, r.bytes) == nullptr) return false;
  }
  return true;
}

// Real host memory, 256-byte aligned, filled with kFreshByte; 0 when the host is out.
CUdeviceptr allocate(State& s, std::size_t bytes, Kind kind, int device) {
  if (bytes > SIZE_MAX - kAlign) return 0;
  const std::size_t capacity = (bytes + kAlign - 1) / kAlign * kAlign;
  void* p = std::aligned_alloc(kAlign, capacity == 0 ? kAlign : capacity);
  if (p == nullptr) return 0;
  std::memset(p, kFreshByte, capacity);
  s.allocs[to_dptr(p)] = Alloc{bytes, kind, device};
  return to_dptr(p);
}

// Frees the block based exactly at p if it is of kind k.
CUresult release(State& s, CUdeviceptr p, std::initializer_list<Kind> kinds) {
  auto it = s.allocs.find(p);
  if (it == s.allocs.end()) return CUDA_ERROR_INVALID_VALUE;
  if (std::find(kinds.begin(), kinds.end(), it->second.kind) == kinds.end()) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  std::free(to_host(p));
  s.allocs.erase(it);
  return CUDA_SUCCESS;
}

std::size_t device_bytes(const State& s, int device) {
  std::size_t total = 0;
  for (const auto& [base, a] : s.allocs) {
    if (a.kind == Kind::kDevice && (device < 0 || a.device == device)) total += a.size;
  }
  return total;
}

std::size_t count_allocs(const State& s, std::initializer_list<Kind> kinds) {
  std::size_t n = 0;
  for (const auto& [base, a] : s.allocs) {
    n += std::find(kinds.begin(), kinds.end(), a.kind) != kinds.end() ? 1 : 0;
  }
  return n;
}

// ---- streams and capture ----

bool is_legacy(CUstream stream) {
  return stream == nullptr || stream == reinterpret_cast<CUstream>(std::uintptr_t{1});
}

Stream* find_stream(State& s, CUstream stream) {
  if (is_legacy(stream)) return &s.legacy;
  auto it = s.streams.find(stream);
  return it == s.streams.end() ? nullptr : &it->second;
}

void invalidate(Stream& st) {
  st.capture = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
  st.nodes.clear();
}

// Work on the legacy stream waits for every blocking stream, which a capturing blocking stream
// cannot allow: the driver answers CUDA_ERROR_STREAM_CAPTURE_IMPLICIT and (unless only asked)
// invalidates those captures.
bool breaks_blocking_capture(State& s, CUstream stream, bool invalidates = true) {
  if (!is_legacy(stream)) return false;
  bool hit = false;
  for (auto& [handle, st] : s.streams) {
    if (!st.non_blocking && st.capture == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
      hit = true;
      if (invalidates) invalidate(st);
    }
  }
  return hit;
}

// An operation a capture cannot record (synchronize, device-to-host copy): it invalidates it.
CUresult refuse_in_capture(Stream& st) {
  if (st.capture == CU_STREAM_CAPTURE_STATUS_INVALIDATED) {
    return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  }
  invalidate(st);
  return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

CUresult record(Stream& st, Node node) {
  if (st.capture == CU_STREAM_CAPTURE_STATUS_INVALIDATED) {
    return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  }
  st.nodes.push_back(std::move(node));
  return CUDA_SUCCESS;
}

MemOp copy_op(void* dst, const void* src, std::size_t n, std::vector<MemOp::Range> ranges) {
  return MemOp{std::move(ranges), [=] {
                 if (n != 0) std::memmove(dst, src, n);  // either may be null when n is 0
               }};
}

// Queues a copy or memset: run now, or recorded when the stream is capturing. A copy into host
// memory cannot be captured here (it is the host waiting for the device).
CUresult submit(State& s, CUstream stream, MemOp op, bool to_host_memory) {
  Stream* st = find_stream(s, stream);
  if (st == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (breaks_blocking_capture(s, stream)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  if (!ranges_valid(s, op)) return CUDA_ERROR_INVALID_VALUE;
  if (st->capture != CU_STREAM_CAPTURE_STATUS_NONE) {
    return to_host_memory ? refuse_in_capture(*st) : record(*st, std::move(op));
  }
  op.apply();
  return CUDA_SUCCESS;
}

// ---- launches ----

// Records the launch and runs its body with the lock released.
void run_launch(Gate& g, FakeLaunch launch, const std::function<void(const FakeLaunch&)>& body,
                void** params) {
  g.s->launches.push_back(launch);
  if (!body) return;
  launch.params = params;
  const auto run = body;  // the body may unload the module that holds it
  g.lock.unlock();
  run(launch);
  g.lock.lock();
}

CUresult check_launch(const Function& f, const FakeLaunch& l, void** params, void** extra) {
  if (extra != nullptr) return CUDA_ERROR_INVALID_VALUE;  // the fake takes kernelParams only
  if (!f.fn.param_sizes.empty() && params == nullptr) return CUDA_ERROR_INVALID_VALUE;
  for (int i = 0; i < 3; ++i) {
    if (l.grid[i] == 0 || l.block[i] == 0) return CUDA_ERROR_INVALID_VALUE;
  }
  if (l.grid[1] > 65535 || l.grid[2] > 65535 || l.block[0] > 1024 || l.block[1] > 1024 ||
      l.block[2] > 64) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  const std::uint64_t threads = std::uint64_t{l.block[0]} * l.block[1] * l.block[2];
  if (threads > 1024) return CUDA_ERROR_INVALID_VALUE;
  const int limit = f.max_dynamic >= 0 ? f.max_dynamic : kDefaultDynamicShared;
  if (l.shared_bytes > static_cast<unsigned>(limit)) return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

// A captured launch, with its arguments copied when their sizes are known.
LaunchOp capture_launch(const Function& f, const FakeLaunch& l, void** params) {
  LaunchOp op{l, f.fn.body, params, {}, {}};
  for (std::size_t i = 0; i < f.fn.param_sizes.size(); ++i) {
    const std::size_t size = f.fn.param_sizes[i];
    op.arg_chunk.push_back(op.args.size());
    op.args.resize(op.args.size() + (size + sizeof(ArgChunk) - 1) / sizeof(ArgChunk));
    if (size != 0) std::memcpy(&op.args[op.arg_chunk.back()], params[i], size);
  }
  if (!f.fn.param_sizes.empty()) op.caller_params = nullptr;
  return op;
}

// Runs one recorded node at replay. Memory freed since capture is a fault, as on a GPU.
CUresult replay(Gate& g, const Node& node, CUstream stream) {
  if (const auto* mem = std::get_if<MemOp>(&node)) {
    if (!ranges_valid(*g.s, *mem)) return CUDA_ERROR_ILLEGAL_ADDRESS;
    mem->apply();
    return CUDA_SUCCESS;
  }
  const auto& op = std::get<LaunchOp>(node);
  FakeLaunch launch = op.launch;
  launch.stream = stream;
  std::vector<ArgChunk> args = op.args;  // a fresh copy per replay
  std::vector<void*> params;
  for (std::size_t chunk : op.arg_chunk) params.push_back(args.data() + chunk);
  run_launch(g, launch, op.body, op.arg_chunk.empty() ? op.caller_params : params.data());
  return CUDA_SUCCESS;
}

// ---- entry points: initialisation, errors, devices, contexts ----

CUresult fake_cuInit(unsigned int flags) {
  FAKE_ENTER(Need::kNothing);
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (s.init_status == CUDA_SUCCESS) s.initialized = true;
  return s.init_status;
}

CUresult fake_cuDriverGetVersion(int* version) {
  FAKE_ENTER(Need::kNothing);
  if (version == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *version = s.driver_version;
  return CUDA_SUCCESS;
}

// Statuses cuda.h defines (status_name knows them all); others are refused, as by the driver.
bool known_status(CUresult error) {
  return std::strcmp(status_name(error), "CUDA_ERROR_UNRECOGNIZED") != 0;
}

CUresult fake_cuGetErrorName(CUresult error, const char** str) {
  FAKE_ENTER(Need::kNothing);
  if (str == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *str = known_status(error) ? status_name(error) : nullptr;
  return *str != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

// Short descriptions, in the driver's words; other known statuses get a generic one.
constexpr std::pair<CUresult, const char*> kDescriptions[] = {
    {CUDA_SUCCESS, "no error"},
    {CUDA_ERROR_INVALID_VALUE, "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "driver shutting down"},
    {CUDA_ERROR_STUB_LIBRARY, "CUDA driver is a stub library"},
    {CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"},
    {CUDA_ERROR_INVALID_IMAGE, "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_CONTEXT, "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "operation not permitted when stream is capturing"},
    {CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
     "operation failed due to a previous error during capture"},
};

CUresult fake_cuGetErrorString(CUresult error, const char** str) {
  FAKE_ENTER(Need::kNothing);
  if (str == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *str = nullptr;
  if (!known_status(error)) return CUDA_ERROR_INVALID_VALUE;
  *str = "an error reported by the fake CUDA driver";
  for (const auto& [status, text] : kDescriptions) {
    if (status == error) *str = text;
  }
  return CUDA_SUCCESS;
}

bool valid_device(const State& s, CUdevice dev) {
  return dev >= 0 && static_cast<std::size_t>(dev) < s.devices.size();
}

CUresult fake_cuDeviceGetCount(int* count) {
  FAKE_ENTER(Need::kInit);
  if (count == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *count = static_cast<int>(s.devices.size());
  return CUDA_SUCCESS;
}

CUresult fake_cuDeviceGet(CUdevice* device, int ordinal) {
  FAKE_ENTER(Need::kInit);
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!valid_device(s, ordinal)) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult fake_cuDeviceGetName(char* name, int len, CUdevice dev) {
  FAKE_ENTER(Need::kInit);
  if (name == nullptr || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  if (!valid_device(s, dev)) return CUDA_ERROR_INVALID_DEVICE;
  const std::string& text = s.devices[dev].name;
  const std::size_t n = std::min(text.size(), static_cast<std::size_t>(len) - 1);
  std::memcpy(name, text.data(), n);
  name[n] = '\0';
  return CUDA_SUCCESS;
}

// The attribute's value (H100/H200 limits where FakeDevice has no field), or -1 for one the
// fake does not know.
int attribute(const FakeDevice& d, CUdevice_attribute attrib) {
  const std::pair<CUdevice_attribute, int> table[] = {
      {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, d.cc_major},
      {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, d.cc_minor},
      {CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, d.sm_count},
      {CU_DEVICE_ATTRIBUTE_INTEGRATED, d.integrated ? 1 : 0},
      {CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, d.managed_memory ? 1 : 0},
      {CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS, d.managed_memory ? 1 : 0},
      {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, kSharedOptin},
      {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK, kDefaultDynamicShared},
      {CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, kSharedOptin + 1024},
      {CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, 1024},
      {CU_DEVICE_ATTRIBUTE_WARP_SIZE, 32},
      {CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X, 1024},
      {CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y, 1024},
      {CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z, 64},
      {CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X, 2147483647},
      {CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y, 65535},
      {CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z, 65535},
      {CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 1},
      {CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, 1},
  };
  for (const auto& [a, v] : table) {
    if (a == attrib) return v;
  }
  return -1;
}

CUresult fake_cuDeviceGetAttribute(int* value, CUdevice_attribute attrib, CUdevice dev) {
  FAKE_ENTER(Need::kInit);
  if (value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!valid_device(s, dev)) return CUDA_ERROR_INVALID_DEVICE;
  const int v = attribute(s.devices[dev], attrib);
  if (v < 0) return CUDA_ERROR_INVALID_VALUE;
  *value = v;
  return CUDA_SUCCESS;
}

CUresult fake_cuDeviceTotalMem(std::size_t* bytes, CUdevice dev) {
  FAKE_ENTER(Need::kInit);
  if (bytes == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!valid_device(s, dev)) return CUDA_ERROR_INVALID_DEVICE;
  *bytes = s.devices[dev].total_memory;
  return CUDA_SUCCESS;
}

CUresult fake_cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice dev) {
  FAKE_ENTER(Need::kInit);
  if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!valid_device(s, dev)) return CUDA_ERROR_INVALID_DEVICE;
  ++s.retains[dev];
  *ctx = s.contexts[dev];
  return CUDA_SUCCESS;
}

CUresult fake_cuDevicePrimaryCtxRelease(CUdevice dev) {
  FAKE_ENTER(Need::kInit);
  if (!valid_device(s, dev)) return CUDA_ERROR_INVALID_DEVICE;
  if (s.retains[dev] == 0) return CUDA_ERROR_INVALID_CONTEXT;
  --s.retains[dev];
  return CUDA_SUCCESS;
}

// Current per thread, as in the driver; only a retained primary context (or null) is accepted.
CUresult fake_cuCtxSetCurrent(CUcontext ctx) {
  FAKE_ENTER(Need::kInit);
  if (ctx != nullptr) {
    bool live = false;
    for (std::size_t d = 0; d < s.contexts.size(); ++d) {
      live = live || (s.contexts[d] == ctx && s.retains[d] > 0);
    }
    if (!live) return CUDA_ERROR_INVALID_CONTEXT;
  }
  t_current = Current{s.id, ctx};
  return CUDA_SUCCESS;
}

// Synchronizing the device cannot be captured: every capture in progress is invalidated.
CUresult fake_cuCtxSynchronize() {
  FAKE_ENTER(Need::kContext);
  FAKE_STICKY();
  bool capturing = false;
  for (auto& [handle, st] : s.streams) {
    if (st.capture != CU_STREAM_CAPTURE_STATUS_NONE) {
      capturing = true;
      invalidate(st);
    }
  }
  return capturing ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDA_SUCCESS;
}

// ---- streams, capture, events, graphs ----

CUresult fake_cuStreamCreate(CUstream* stream, unsigned int flags) {
  FAKE_ENTER(Need::kContext);
  if (stream == nullptr || (flags & ~unsigned{CU_STREAM_NON_BLOCKING}) != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  *stream = new_handle<CUstream>(s);
  s.streams[*stream].non_blocking = (flags & CU_STREAM_NON_BLOCKING) != 0;
  return CUDA_SUCCESS;
}

CUresult fake_cuStreamDestroy(CUstream stream) {
  FAKE_ENTER(Need::kContext);
  return s.streams.erase(stream) == 1 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult fake_cuStreamSynchronize(CUstream stream) {
  FAKE_ENTER(Need::kContext);
  FAKE_STICKY();
  Stream* st = find_stream(s, stream);
  if (st == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (breaks_blocking_capture(s, stream)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  if (st->capture != CU_STREAM_CAPTURE_STATUS_NONE) return refuse_in_capture(*st);
  return CUDA_SUCCESS;  // work runs when queued, so it is already done
}

// Work runs when queued, so a wait has nothing to wait for; a capture records nothing for it.
CUresult fake_cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags) {
  FAKE_ENTER(Need::kContext);
  Stream* st = find_stream(s, stream);
  if (st == nullptr || s.events.count(event) == 0) return CUDA_ERROR_INVALID_HANDLE;
  if ((flags & ~unsigned{CU_EVENT_WAIT_EXTERNAL}) != 0) return CUDA_ERROR_INVALID_VALUE;
  if (breaks_blocking_capture(s, stream)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  if (st->capture == CU_STREAM_CAPTURE_STATUS_INVALIDATED) {
    return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  }
  return CUDA_SUCCESS;
}

CUresult fake_cuStreamBeginCapture(CUstream stream, CUstreamCaptureMode mode) {
  FAKE_ENTER(Need::kContext);
  Stream* st = find_stream(s, stream);
  if (st == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (is_legacy(stream)) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  if (mode != CU_STREAM_CAPTURE_MODE_GLOBAL && mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
      mode != CU_STREAM_CAPTURE_MODE_RELAXED) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (st->capture != CU_STREAM_CAPTURE_STATUS_NONE) return CUDA_ERROR_ILLEGAL_STATE;
  st->capture = CU_STREAM_CAPTURE_STATUS_ACTIVE;
  return CUDA_SUCCESS;
}

// Ends the capture either way; an invalidated one yields no graph.
CUresult fake_cuStreamEndCapture(CUstream stream, CUgraph* graph) {
  FAKE_ENTER(Need::kContext);
  if (graph == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Stream* st = find_stream(s, stream);
  if (st == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (st->capture == CU_STREAM_CAPTURE_STATUS_NONE) return CUDA_ERROR_ILLEGAL_STATE;
  const bool invalidated = st->capture == CU_STREAM_CAPTURE_STATUS_INVALIDATED;
  st->capture = CU_STREAM_CAPTURE_STATUS_NONE;
  std::vector<Node> nodes = std::exchange(st->nodes, {});
  if (invalidated) {
    *graph = nullptr;
    return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  }
  *graph = new_handle<CUgraph>(s);
  s.graphs[*graph] = std::move(nodes);
  return CUDA_SUCCESS;
}

CUresult fake_cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus* status) {
  FAKE_ENTER(Need::kContext);
  if (status == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Stream* st = find_stream(s, stream);
  if (st == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  // Asked about the legacy stream, the driver reports the conflict without invalidating.
  if (breaks_blocking_capture(s, stream, false)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  *status = st->capture;
  return CUDA_SUCCESS;
}

CUresult fake_cuEventCreate(CUevent* event, unsigned int flags) {
  FAKE_ENTER(Need::kContext);
  const unsigned known = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
  if (event == nullptr || (flags & ~known) != 0) return CUDA_ERROR_INVALID_VALUE;
  if ((flags & CU_EVENT_INTERPROCESS) != 0 && (flags & CU_EVENT_DISABLE_TIMING) == 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  *event = new_handle<CUevent>(s);
  s.events[*event] = Event{};
  return CUDA_SUCCESS;
}

CUresult fake_cuEventDestroy(CUevent event) {
  FAKE_ENTER(Need::kContext);
  return s.events.erase(event) == 1 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult fake_cuEventRecord(CUevent event, CUstream stream) {
  FAKE_ENTER(Need::kContext);
  auto ev = s.events.find(event);
  Stream* st = find_stream(s, stream);
  if (ev == s.events.end() || st == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (breaks_blocking_capture(s, stream)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  if (st->capture == CU_STREAM_CAPTURE_STATUS_INVALIDATED) {
    return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  }
  ev->second.captured = st->capture == CU_STREAM_CAPTURE_STATUS_ACTIVE;
  return CUDA_SUCCESS;
}

CUresult fake_cuEventQuery(CUevent event) {
  FAKE_ENTER(Need::kContext);
  auto ev = s.events.find(event);
  if (ev == s.events.end()) return CUDA_ERROR_INVALID_HANDLE;
  if (ev->second.captured) return CUDA_ERROR_CAPTURED_EVENT;
  return s.events_ready ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

// Waiting always succeeds: the work behind the event completes while the host waits.
CUresult fake_cuEventSynchronize(CUevent event) {
  FAKE_ENTER(Need::kContext);
  auto ev = s.events.find(event);
  if (ev == s.events.end()) return CUDA_ERROR_INVALID_HANDLE;
  return ev->second.captured ? CUDA_ERROR_CAPTURED_EVENT : CUDA_SUCCESS;
}

// The exec is a copy of the graph's nodes: destroying the graph afterwards is fine.
CUresult fake_cuGraphInstantiateWithFlags(CUgraphExec* exec, CUgraph graph,
                                          unsigned long long flags) {
  FAKE_ENTER(Need::kContext);
  if (exec == nullptr || (flags & ~0xFull) != 0) return CUDA_ERROR_INVALID_VALUE;
  auto it = s.graphs.find(graph);
  if (it == s.graphs.end()) return CUDA_ERROR_INVALID_HANDLE;
  *exec = new_handle<CUgraphExec>(s);
  s.execs[*exec] = it->second;
  return CUDA_SUCCESS;
}

CUresult fake_cuGraphDestroy(CUgraph graph) {
  FAKE_ENTER(Need::kContext);
  return s.graphs.erase(graph) == 1 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult fake_cuGraphExecDestroy(CUgraphExec exec) {
  FAKE_ENTER(Need::kContext);
  return s.execs.erase(exec) == 1 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

// Runs the exec's nodes in order (into a capturing stream: records them). A node that touches
// freed memory faults the device: CUDA_ERROR_ILLEGAL_ADDRESS, sticky.
CUresult fake_cuGraphLaunch(CUgraphExec exec, CUstream stream) {
  FAKE_ENTER(Need::kContext);
  FAKE_STICKY();
  auto it = s.execs.find(exec);
  Stream* st = find_stream(s, stream);
  if (it == s.execs.end() || st == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (breaks_blocking_capture(s, stream)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  if (st->capture != CU_STREAM_CAPTURE_STATUS_NONE) {
    for (const Node& node : it->second) {
      if (CUresult r = record(*st, node); r != CUDA_SUCCESS) return r;
    }
    return CUDA_SUCCESS;
  }
  ++s.replays;
  const std::vector<Node> nodes = it->second;  // a body may destroy the exec
  for (const Node& node : nodes) {
    if (CUresult r = replay(g, node, stream); r != CUDA_SUCCESS) {
      s.sticky = r;
      return r;
    }
  }
  return CUDA_SUCCESS;
}

// ---- memory entry points ----

CUresult fake_cuMemAlloc(CUdeviceptr* dptr, std::size_t bytes) {
  FAKE_ENTER(Need::kContext);
  if (dptr == nullptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  const int dev = current_device(s);
  const std::size_t used = device_bytes(s, dev);
  if (bytes > s.devices[dev].total_memory - used) return CUDA_ERROR_OUT_OF_MEMORY;
  const CUdeviceptr p = allocate(s, bytes, Kind::kDevice, dev);
  if (p == 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *dptr = p;
  return CUDA_SUCCESS;
}

// Managed memory is not counted against total_memory (it can oversubscribe).
CUresult fake_cuMemAllocManaged(CUdeviceptr* dptr, std::size_t bytes, unsigned int flags) {
  FAKE_ENTER(Need::kContext);
  if (dptr == nullptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  const int dev = current_device(s);
  if (!s.devices[dev].managed_memory) return CUDA_ERROR_NOT_SUPPORTED;
  const CUdeviceptr p = allocate(s, bytes, Kind::kManaged, dev);
  if (p == 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *dptr = p;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemFree(CUdeviceptr dptr) {
  FAKE_ENTER(Need::kContext);
  return release(s, dptr, {Kind::kDevice, Kind::kManaged});
}

CUresult fake_cuMemHostAlloc(void** pp, std::size_t bytes, unsigned int flags) {
  FAKE_ENTER(Need::kContext);
  const unsigned known =
      CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED;
  if (pp == nullptr || bytes == 0 || (flags & ~known) != 0) return CUDA_ERROR_INVALID_VALUE;
  const CUdeviceptr p = allocate(s, bytes, Kind::kHost, current_device(s));
  if (p == 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *pp = to_host(p);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemFreeHost(void* p) {
  FAKE_ENTER(Need::kContext);
  return release(s, to_dptr(p), {Kind::kHost});
}

// Mapped host memory has the same address on both sides (unified addressing).
CUresult fake_cuMemHostGetDevicePointer(CUdeviceptr* dptr, void* p, unsigned int flags) {
  FAKE_ENTER(Need::kContext);
  if (dptr == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  const Alloc* a = find_range(s, to_dptr(p), 1);
  if (a == nullptr || a->kind != Kind::kHost) return CUDA_ERROR_INVALID_VALUE;
  *dptr = to_dptr(p);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemGetInfo(std::size_t* free_bytes, std::size_t* total_bytes) {
  FAKE_ENTER(Need::kContext);
  if (free_bytes == nullptr || total_bytes == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const int dev = current_device(s);
  *total_bytes = s.devices[dev].total_memory;
  *free_bytes = *total_bytes - device_bytes(s, dev);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemcpyHtoDAsync(CUdeviceptr dst, const void* src, std::size_t n, CUstream st) {
  FAKE_ENTER(Need::kContext);
  FAKE_STICKY();
  if (src == nullptr && n != 0) return CUDA_ERROR_INVALID_VALUE;
  return submit(s, st, copy_op(to_host(dst), src, n, {{dst, n}}), false);
}

CUresult fake_cuMemcpyDtoHAsync(void* dst, CUdeviceptr src, std::size_t n, CUstream st) {
  FAKE_ENTER(Need::kContext);
  FAKE_STICKY();
  if (dst == nullptr && n != 0) return CUDA_ERROR_INVALID_VALUE;
  return submit(s, st, copy_op(dst, to_host(src), n, {{src, n}}), true);
}

CUresult fake_cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, std::size_t n, CUstream st) {
  FAKE_ENTER(Need::kContext);
  FAKE_STICKY();
  return submit(s, st, copy_op(to_host(dst), to_host(src), n, {{dst, n}, {src, n}}), false);
}

CUresult fake_cuMemsetD8Async(CUdeviceptr dst, unsigned char value, std::size_t n, CUstream st) {
  FAKE_ENTER(Need::kContext);
  FAKE_STICKY();
  MemOp op{{{dst, n}}, [=] {
             if (n != 0) std::memset(to_host(dst), value, n);
           }};
  return submit(s, st, std::move(op), false);
}

// One side of a 2D copy: its first byte, and the device range it spans (empty for host).
struct Side {
  char* first = nullptr;
  MemOp::Range range;
};

// Host and device (or unified, taken as device) memory; arrays are not supported.
bool copy_side(CUmemorytype type, const void* host, CUdeviceptr dev, std::size_t x, std::size_t y,
               std::size_t pitch, const CUDA_MEMCPY2D& c, Side& out) {
  const std::size_t offset = y * pitch + x;
  const std::size_t span = c.Height == 0 ? 0 : (c.Height - 1) * pitch + c.WidthInBytes;
  if (type == CU_MEMORYTYPE_HOST) {
    if (host == nullptr) return false;
    out.first = static_cast<char*>(const_cast<void*>(host)) + offset;
    return true;
  }
  if (type != CU_MEMORYTYPE_DEVICE && type != CU_MEMORYTYPE_UNIFIED) return false;
  out.first = static_cast<char*>(to_host(dev)) + offset;
  out.range = {dev + offset, span};
  return true;
}

CUresult fake_cuMemcpy2DAsync(const CUDA_MEMCPY2D* c, CUstream stream) {
  FAKE_ENTER(Need::kContext);
  FAKE_STICKY();
  if (c == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (c->WidthInBytes == 0 || c->Height == 0) return CUDA_SUCCESS;
  if (c->Height > 1 && (c->srcPitch < c->WidthInBytes || c->dstPitch < c->WidthInBytes)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  Side src, dst;
  if (!copy_side(c->srcMemoryType, c->srcHost, c->srcDevice, c->srcXInBytes, c->srcY, c->srcPitch,
                 *c, src) ||
      !copy_side(c->dstMemoryType, c->dstHost, c->dstDevice, c->dstXInBytes, c->dstY, c->dstPitch,
                 *c, dst)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  const std::size_t width = c->WidthInBytes, height = c->Height;
  const std::size_t sp = c->srcPitch, dp = c->dstPitch;
  MemOp op{{src.range, dst.range}, [=] {
             for (std::size_t row = 0; row < height; ++row) {
               std::memmove(dst.first + row * dp, src.first + row * sp, width);
             }
           }};
  return submit(s, stream, std::move(op), c->dstMemoryType == CU_MEMORYTYPE_HOST);
}

// ---- modules and launches ----

CUresult fake_cuModuleLoadData(CUmodule* module, const void* image) {
  FAKE_ENTER(Need::kContext);
  if (module == nullptr || image == nullptr) return CUDA_ERROR_INVALID_VALUE;
  // Compare the prefix first so a real (binary) image is not read past its first bytes.
  const char* text = static_cast<const char*>(image);
  if (std::strncmp(text, kImagePrefix.data(), kImagePrefix.size()) != 0) {
    return CUDA_ERROR_INVALID_IMAGE;
  }
  auto reg = s.registered.find(text + kImagePrefix.size());
  if (reg == s.registered.end()) return CUDA_ERROR_INVALID_IMAGE;
  LoadedModule loaded{reg->second, {}, {}};
  for (const auto& [name, global] : reg->second.globals) {
    const CUdeviceptr p = allocate(s, global.bytes.size(), Kind::kGlobal, current_device(s));
    if (!global.bytes.empty()) std::memcpy(to_host(p), global.bytes.data(), global.bytes.size());
    loaded.globals[name] = p;
  }
  *module = new_handle<CUmodule>(s);
  s.modules[*module] = std::move(loaded);
  return CUDA_SUCCESS;
}

// Its functions and globals go with it.
CUresult fake_cuModuleUnload(CUmodule module) {
  FAKE_ENTER(Need::kContext);
  auto it = s.modules.find(module);
  if (it == s.modules.end()) return CUDA_ERROR_INVALID_HANDLE;
  for (const auto& [name, f] : it->second.functions) s.functions.erase(f);
  for (const auto& [name, p] : it->second.globals) release(s, p, {Kind::kGlobal});
  s.modules.erase(it);
  return CUDA_SUCCESS;
}

// The same entry of the same module gives the same handle every time.
CUresult fake_cuModuleGetFunction(CUfunction* func, CUmodule module, const char* name) {
  FAKE_ENTER(Need::kContext);
  if (func == nullptr || name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  auto mod = s.modules.find(module);
  if (mod == s.modules.end()) return CUDA_ERROR_INVALID_HANDLE;
  LoadedModule& loaded = mod->second;
  if (auto known = loaded.functions.find(name); known != loaded.functions.end()) {
    *func = known->second;
    return CUDA_SUCCESS;
  }
  auto entry = loaded.desc.functions.find(name);
  if (entry == loaded.desc.functions.end()) return CUDA_ERROR_NOT_FOUND;
  *func = new_handle<CUfunction>(s);
  loaded.functions[name] = *func;
  s.functions[*func] = Function{name, entry->second, -1};
  return CUDA_SUCCESS;
}

CUresult fake_cuModuleGetGlobal(CUdeviceptr* dptr, std::size_t* bytes, CUmodule module,
                                const char* name) {
  FAKE_ENTER(Need::kContext);
  if (name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  auto mod = s.modules.find(module);
  if (mod == s.modules.end()) return CUDA_ERROR_INVALID_HANDLE;
  auto p = mod->second.globals.find(name);
  if (p == mod->second.globals.end()) return CUDA_ERROR_NOT_FOUND;
  const FakeGlobal& desc = mod->second.desc.globals.at(name);
  if (desc.get_status != CUDA_SUCCESS) return desc.get_status;
  if (dptr != nullptr) *dptr = p->second;
  if (bytes != nullptr) *bytes = desc.bytes.size();
  return CUDA_SUCCESS;
}

CUresult fake_cuFuncSetAttribute(CUfunction func, CUfunction_attribute attrib, int value) {
  FAKE_ENTER(Need::kContext);
  auto f = s.functions.find(func);
  if (f == s.functions.end()) return CUDA_ERROR_INVALID_HANDLE;
  if (attrib == CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT) {
    return value >= -1 && value <= 100 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
  }
  if (attrib != CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) return CUDA_ERROR_INVALID_VALUE;
  if (value < 0 || value > kSharedOptin) return CUDA_ERROR_INVALID_VALUE;
  f->second.max_dynamic = value;
  s.last_max_dynamic[f->second.name] = value;
  return CUDA_SUCCESS;
}

CUresult fake_cuLaunchKernel(CUfunction func, unsigned int gx, unsigned int gy, unsigned int gz,
                             unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared,
                             CUstream stream, void** params, void** extra) {
  FAKE_ENTER(Need::kContext);
  FAKE_STICKY();
  auto f = s.functions.find(func);
  Stream* st = find_stream(s, stream);
  if (f == s.functions.end() || st == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  const FakeLaunch launch{f->second.name, {gx, gy, gz}, {bx, by, bz}, shared, stream, nullptr};
  if (CUresult bad = check_launch(f->second, launch, params, extra); bad != CUDA_SUCCESS) {
    return bad;
  }
  if (breaks_blocking_capture(s, stream)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  if (st->capture != CU_STREAM_CAPTURE_STATUS_NONE) {
    return record(*st, capture_launch(f->second, launch, params));
  }
  run_launch(g, launch, f->second.fn.body, params);
  return CUDA_SUCCESS;
}

#undef FAKE_ENTER
#undef FAKE_STICKY

}  // namespace

// ---- the public side ----

FakeModule& FakeModule::publish_u32(const std::string& name, std::uint32_t value) {
  FakeGlobal& global = globals[name];
  global.bytes.resize(4);
  for (std::size_t i = 0; i < 4; ++i) {
    global.bytes[i] = static_cast<std::byte>((value >> (8 * i)) & 0xFFu);
  }
  return *this;
}

bool FakeOutstanding::none() const noexcept {
  return allocations == 0 && host_allocs == 0 && modules == 0 && streams == 0 && events == 0 &&
         graphs == 0 && graph_execs == 0 && contexts == 0;
}

FakeDriver::FakeDriver(std::vector<FakeDevice> devices) : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.id = g_next_id.fetch_add(1);
  s.devices = std::move(devices);
  s.retains.assign(s.devices.size(), 0);
  for (std::size_t d = 0; d < s.devices.size(); ++d) s.contexts.push_back(new_handle<CUcontext>(s));
#define METRALE_FAKE_FILL(name, version) s.api.name = &fake_##name;
  METRALE_DRIVER_FUNCTIONS(METRALE_FAKE_FILL)
#undef METRALE_FAKE_FILL
  State* expected = nullptr;
  if (!g_state.compare_exchange_strong(expected, &s)) {
    throw std::logic_error("FakeDriver: another FakeDriver is alive");
  }
}

FakeDriver::~FakeDriver() {
  g_state.store(nullptr);  // calls through a table kept past this return DEINITIALIZED
  for (const auto& [base, alloc] : state_->allocs) std::free(to_host(base));
}

const DriverApi& FakeDriver::api() const noexcept {
  return state_->api;
}

namespace {
// Runs f on the state under its lock (the set-up and observation side).
template <class F>
auto locked(State& s, F f) {
  std::lock_guard lock(s.mutex);
  return f(s);
}

// A misspelt entry point would make fail_at or calls() silently ineffective.
const std::string& entry_point(const std::string& call) {
#define METRALE_FAKE_NAME(name, version) #name,
  static constexpr std::string_view kNames[] = {METRALE_DRIVER_FUNCTIONS(METRALE_FAKE_NAME)};
#undef METRALE_FAKE_NAME
  if (std::find(std::begin(kNames), std::end(kNames), call) == std::end(kNames)) {
    throw std::invalid_argument("FakeDriver: no driver entry point named " + call);
  }
  return call;
}
}  // namespace

void FakeDriver::set_init_status(CUresult status) {
  locked(*state_, [&](State& s) { s.init_status = status; });
}

void FakeDriver::set_driver_version(int version) {
  locked(*state_, [&](State& s) { s.driver_version = version; });
}

void FakeDriver::add_module(const std::string& name, FakeModule module) {
  locked(*state_, [&](State& s) { s.registered[name] = std::move(module); });
}

std::vector<unsigned char> FakeDriver::fake_image(const std::string& name) {
  const std::string text = std::string(kImagePrefix) + name;
  std::vector<unsigned char> image(text.begin(), text.end());
  image.push_back(0);
  return image;
}

void FakeDriver::set_events_ready(bool ready) {
  locked(*state_, [&](State& s) { s.events_ready = ready; });
}

void FakeDriver::fail_at(const std::string& call, std::uint64_t nth, CUresult status) {
  locked(*state_, [&](State& s) {
    s.failures[entry_point(call)].push_back(FailRule{nth, false, status});
  });
}

void FakeDriver::fail_from(const std::string& call, std::uint64_t nth, CUresult status) {
  locked(*state_, [&](State& s) {
    s.failures[entry_point(call)].push_back(FailRule{nth, true, status});
  });
}

void FakeDriver::clear_failures() {
  locked(*state_, [](State& s) { s.failures.clear(); });
}

void FakeDriver::set_sticky_fault(CUresult status) {
  locked(*state_, [&](State& s) { s.sticky = status; });
}

std::uint64_t FakeDriver::calls(const std::string& call) const {
  return locked(*state_, [&](State& s) -> std::uint64_t {
    auto it = s.calls.find(entry_point(call));
    return it == s.calls.end() ? 0 : it->second;
  });
}

std::uint64_t FakeDriver::total_calls() const {
  return locked(*state_, [](State& s) {
    std::uint64_t total = 0;
    for (const auto& [name, n] : s.calls) total += n;
    return total;
  });
}

std::vector<FakeLaunch> FakeDriver::launches() const {
  return locked(*state_, [](State& s) { return s.launches; });
}

std::uint64_t FakeDriver::graph_replays() const {
  return locked(*state_, [](State& s) { return s.replays; });
}

std::size_t FakeDriver::device_bytes_in_use() const {
  return locked(*state_, [](State& s) { return device_bytes(s, -1); });
}

FakeOutstanding FakeDriver::outstanding() const {
  return locked(*state_, [](State& s) {
    FakeOutstanding out;
    out.allocations = count_allocs(s, {Kind::kDevice, Kind::kManaged});
    out.host_allocs = count_allocs(s, {Kind::kHost});
    out.modules = s.modules.size();
    out.streams = s.streams.size();
    out.events = s.events.size();
    out.graphs = s.graphs.size();
    out.graph_execs = s.execs.size();
    for (int r : s.retains) out.contexts += static_cast<std::size_t>(r);
    return out;
  });
}

int FakeDriver::max_dynamic_shared(const std::string& function) const {
  return locked(*state_, [&](State& s) {
    auto it = s.last_max_dynamic.find(function);
    return it == s.last_max_dynamic.end() ? 0 : it->second;
  });
}

}  // namespace metrale::cuda::testing
