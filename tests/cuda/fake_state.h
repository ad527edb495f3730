// Internals of the fake CUDA driver (fake_driver.h), shared by its files: the state every entry
// point works on, the gate that opens an entry point (call counting, injected failures, the
// cuInit and context rules), and the helpers one concept's file lends another.
//   fake_driver.cpp   the public side: construction, the table, set-up and observation
//   fake_faults.cpp   the gate and fault scripting (fail_at, fail_from, sticky faults, counts)
//   fake_devices.cpp  cuInit, versions, status names, devices, primary contexts
//   fake_memory.cpp   allocations, host memory, copies and memsets
//   fake_streams.cpp  streams, capture, events, graphs and their replay
//   fake_modules.cpp  modules, functions, globals and launches
//   fake_vmm.cpp      virtual memory: reservations, physical allocations, mappings, access
// Entry points work under State::mutex; kernel bodies run with it released, so a body may call
// back into the fake. Device pointers are host addresses of real (aligned_alloc) memory, so a
// body may also read and write them directly.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <variant>
#include <vector>

#include "cuda/driver_api.h"
#include "cuda/fake_driver.h"

namespace metrale::cuda::testing {
namespace fake {

inline constexpr std::size_t kAlign = 256;
inline constexpr int kDefaultDynamicShared = 48 * 1024;  // without cuFuncSetAttribute
inline constexpr int kSharedOptin = 232448;              // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
inline constexpr unsigned char kFreshByte = 0xA5;        // new memory is not zeroed, as on a GPU
inline constexpr std::string_view kImagePrefix = "FAKEMOD:";

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
  CUcontext ctx = nullptr;  // current when the stream was made (cuStreamGetCtx)
  CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
  CUstreamCaptureMode capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;  // of the capture under way
  std::thread::id capture_thread;                                    // the thread that began it
  std::vector<Node> nodes;                                           // recorded while capturing
};

struct Event {
  bool captured = false;  // last recorded in a capturing stream
  bool timing = true;     // not made with CU_EVENT_DISABLE_TIMING
  bool recorded = false;  // recorded outside a capture at least once
  double at_ms = 0;       // State::clock_ms at the last such record
  bool held = false;      // recorded under hold_events: its work is not done until waited on
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

inline constexpr std::size_t kVmmGranule = std::size_t{2} << 20;  // as on every current GPU

// A cuMemAddressReserve range: address space (real PROT_NONE host pages), not memory.
struct Reservation {
  std::size_t size = 0;
};

// A cuMemCreate allocation. Released while mapped, it lives on until its last unmap.
struct Physical {
  std::size_t size = 0;
  int device = 0;
  bool released = false;
  int mappings = 0;
};

// A cuMemMap of a physical allocation into a reservation; usable once access is set.
struct Mapping {
  std::size_t size = 0;
  CUmemGenericAllocationHandle handle = 0;
  bool accessible = false;
};

struct FailRule {
  std::uint64_t nth = 0;
  bool onward = false;  // fail_from rather than fail_at
  CUresult status = CUDA_SUCCESS;
};

inline CUdeviceptr to_dptr(const void* p) {
  return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p));
}
inline void* to_host(CUdeviceptr d) {
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(d));
}

}  // namespace fake

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
  bool hold_events = false;  // FakeDriver::hold_events
  double clock_ms = 0;       // the fake's device clock: what timing events read
  double launch_ms = 0.001;  // how far each launch moves it
  CUresult sticky = CUDA_SUCCESS;
  std::map<std::string, FakeModule> registered;
  std::map<std::string, std::uint64_t, std::less<>> calls;
  std::map<std::string, std::vector<fake::FailRule>, std::less<>> failures;
  std::vector<FakeLaunch> launches;
  std::uint64_t replays = 0;
  std::map<std::string, int> last_max_dynamic;
  std::map<CUdeviceptr, fake::Alloc> allocs;  // every live block, by base address
  std::uintptr_t next_handle = 0x10000;
  fake::Stream legacy;  // the NULL stream; never captures
  std::map<CUstream, fake::Stream> streams;
  std::map<CUevent, fake::Event> events;
  std::map<CUmodule, fake::LoadedModule> modules;
  std::map<CUfunction, fake::Function> functions;
  std::map<CUgraph, std::vector<fake::Node>> graphs;
  std::map<CUgraphExec, std::vector<fake::Node>> execs;
  std::map<CUdeviceptr, fake::Reservation> reservations;  // by base address
  std::map<CUmemGenericAllocationHandle, fake::Physical> physical;
  std::map<CUdeviceptr, fake::Mapping> mappings;  // by mapped address
};

namespace fake {

using State = FakeDriver::State;

// The calling thread's current context, tagged with the fake that set it.
struct Current {
  std::uint64_t owner = 0;
  CUcontext ctx = nullptr;
};
extern thread_local Current t_current;

// The calling thread's stream capture interaction mode (cuThreadExchangeStreamCaptureMode),
// tagged like t_current: a thread starts in CU_STREAM_CAPTURE_MODE_GLOBAL under each fake.
struct CaptureModeOfThread {
  std::uint64_t owner = 0;
  CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
};
extern thread_local CaptureModeOfThread t_capture_mode;

// Handles are fake addresses that are never reused, so a stale handle stays invalid.
template <class Handle>
Handle new_handle(State& s) {
  s.next_handle += 16;
  return reinterpret_cast<Handle>(s.next_handle);
}

enum class Need { kNothing, kInit, kContext };

// An open entry point: the state, its lock, and the status to return at once if not success.
struct Gate {
  State* s = nullptr;
  std::unique_lock<std::mutex> lock;
  CUresult status = CUDA_SUCCESS;
};

// Opens an entry point. The name counted is the function's name without "fake_", which is
// the driver's name (the table is filled by the same X-macro, so the two cannot drift).
#define FAKE_ENTER(need)                                      \
  Gate g = enter(std::string_view(__func__).substr(5), need); \
  if (g.status != CUDA_SUCCESS) return g.status;              \
  [[maybe_unused]] State& s = *g.s

#define FAKE_STICKY() \
  if (s.sticky != CUDA_SUCCESS) return s.sticky

// The live fake (null when none): the table's plain function pointers reach it through this.
extern std::atomic<State*> g_state;

// The device of the calling thread's current context, or -1 when there is no live one.
int current_device(const State& s);
// Counts the call, then applies (in order) injected failures, the cuInit rule and the
// current-context rule (fake_faults.cpp).
Gate enter(std::string_view name, Need need);

// Runs f on the state under its lock (the set-up and observation side).
template <class F>
auto locked(State& s, F f) {
  std::lock_guard lock(s.mutex);
  return f(s);
}

// ---- memory (fake_memory.cpp) ----
// The live block holding all of [p, p + bytes) (bytes > 0), or null.
const Alloc* find_range(const State& s, CUdeviceptr p, std::size_t bytes);
// Whether [p, p + bytes) (bytes > 0) lies in a live block or in accessible mappings end to end.
bool range_live(const State& s, CUdeviceptr p, std::size_t bytes);
// Whether [p, p + bytes) is covered end to end by mappings whose access was set (fake_vmm.cpp).
bool mapped_covers(const State& s, CUdeviceptr p, std::size_t bytes);
// Bytes of physical allocations (cuMemCreate) live on device (-1: on all).
std::size_t physical_bytes(const State& s, int device);
// Unmaps the host pages of every reservation left at the fake's destruction.
void drop_reservations(State& s) noexcept;
// Whether every device range of op lies in a live block.
bool ranges_valid(const State& s, const MemOp& op);
// Real host memory, 256-byte aligned, filled with kFreshByte; 0 when the host is out.
CUdeviceptr allocate(State& s, std::size_t bytes, Kind kind, int device);
// Frees the block based exactly at p if it is of one of `kinds`.
CUresult release(State& s, CUdeviceptr p, std::initializer_list<Kind> kinds);
// Bytes of device memory in use on `device` (-1: on all).
std::size_t device_bytes(const State& s, int device);
// Live blocks of the given kinds.
std::size_t count_allocs(const State& s, std::initializer_list<Kind> kinds);

// ---- streams and capture (fake_streams.cpp) ----
// The NULL stream and CU_STREAM_LEGACY.
bool is_legacy(CUstream stream);
// The stream's state, or null when it is not live.
Stream* find_stream(State& s, CUstream stream);
// Marks a capture invalidated and drops what it recorded.
void invalidate(Stream& st);
// Work on the legacy stream waits for every blocking stream, which a capturing blocking stream
// cannot allow: the driver answers CUDA_ERROR_STREAM_CAPTURE_IMPLICIT and (unless only asked)
// invalidates those captures.
bool breaks_blocking_capture(State& s, CUstream stream, bool invalidates = true);
// An operation a capture cannot record (synchronize, device-to-host copy): it invalidates it.
CUresult refuse_in_capture(Stream& st);
// For a call the driver documents as potentially unsafe during capture (cudaMalloc's family):
// CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, invalidating the captures it conflicts with, when the
// calling thread's mode prohibits it; else CUDA_SUCCESS (fake_streams.cpp says the rule).
CUresult refuse_unsafe_in_capture(State& s);
// Records a node into a capturing stream.
CUresult record(Stream& st, Node node);
// Queues a copy or memset: run now, or recorded when the stream is capturing. A copy into host
// memory cannot be captured here (it is the host waiting for the device).
CUresult submit(State& s, CUstream stream, MemOp op, bool to_host_memory);
// Runs one recorded node at replay. Memory freed since capture is a fault, as on a GPU.
CUresult replay(Gate& g, const Node& node, CUstream stream);

// ---- launches (fake_modules.cpp) ----
// Records the launch and runs its body with the lock released.
void run_launch(Gate& g, FakeLaunch launch, const std::function<void(const FakeLaunch&)>& body,
                void** params);

// Every entry point, with exactly its PFN type; defined across the fake_*.cpp files.
#define METRALE_FAKE_DECLARE(name, version) \
  std::remove_pointer_t<PFN_##name##_v##version> fake_##name;
METRALE_DRIVER_FUNCTIONS(METRALE_FAKE_DECLARE)
#undef METRALE_FAKE_DECLARE

}  // namespace fake
}  // namespace metrale::cuda::testing
