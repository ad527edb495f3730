// A fake CUDA driver for tests: fills a DriverApi table with functions that keep everything in
// host memory and answer with the driver's real status codes. It lets every host rule of the
// CUDA backend run on a machine without a GPU: allocations (counted; they can run out), modules
// described by the test, streams, events, graphs (capture records, replay counts), copies that
// really move bytes, kernels with optional host bodies, virtual memory (reservations, physical
// allocations of 2 MiB granules, mappings that need access set before use; mapping is refused
// while any stream captures), and failure of any call at any count.
//
// Only one FakeDriver may exist at a time (the table's plain function pointers reach it through
// a process-wide pointer); constructing a second throws std::logic_error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cuda/driver_api.h"

namespace metrale::cuda::testing {

// One launch as the fake saw it (also what a kernel body receives).
struct FakeLaunch {
  std::string function;  // entry name
  unsigned grid[3] = {1, 1, 1};
  unsigned block[3] = {1, 1, 1};
  unsigned shared_bytes = 0;
  CUstream stream = nullptr;
  void** params = nullptr;  // valid only while a body runs
};

// A kernel entry of a fake module. When body is set it runs once per launch (not per block),
// at launch time or, for a captured launch, at every replay; it reads parameters the way
// cuLaunchKernel passes them (params[i] points to argument i).
struct FakeFunction {
  std::function<void(const FakeLaunch&)> body;
  // The size in bytes of each kernel parameter, as the driver learns it from the cubin. A
  // captured launch copies these arguments (as the driver does), so a replay does not read the
  // caller's memory. When empty, a captured launch keeps the caller's kernelParams pointer, and
  // that array and what it points to must outlive the graph's last replay.
  std::vector<std::size_t> param_sizes;
};

// A module global (e.g. "fill_u32_n_tile"). A non-success get_status makes cuModuleGetGlobal
// return that status for it (a symbol that exists but cannot be read).
struct FakeGlobal {
  std::vector<std::byte> bytes;
  CUresult get_status = CUDA_SUCCESS;
};

struct FakeModule {
  std::map<std::string, FakeFunction> functions;
  std::map<std::string, FakeGlobal> globals;
  // Convenience: a 4-byte little-endian global.
  FakeModule& publish_u32(const std::string& name, std::uint32_t value);
};

struct FakeDevice {
  std::string name = "Fake H200";
  int cc_major = 9, cc_minor = 0;
  int sm_count = 132;
  std::size_t total_memory = std::size_t{1} << 30;  // device allocations beyond this: OOM
  bool integrated = false;
  bool managed_memory = true;  // CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY
};

// What is still alive in the fake.
struct FakeOutstanding {
  std::size_t allocations = 0;  // cuMemAlloc + cuMemAllocManaged not yet freed
  std::size_t host_allocs = 0;  // cuMemHostAlloc not yet freed
  std::size_t modules = 0;      // loaded, not unloaded
  std::size_t streams = 0;      // created, not destroyed
  std::size_t events = 0;
  std::size_t graphs = 0;        // CUgraph templates not destroyed
  std::size_t graph_execs = 0;   // instantiated graphs not destroyed
  std::size_t contexts = 0;      // primary-context retains minus releases
  std::size_t reservations = 0;  // cuMemAddressReserve not yet freed
  std::size_t vmm_handles = 0;   // cuMemCreate not yet gone (released and unmapped)
  std::size_t mappings = 0;      // cuMemMap not yet unmapped
  // True when everything above is zero.
  bool none() const noexcept;
};

class FakeDriver {
 public:
  // One device by default; devices may be empty (cuDeviceGetCount answers 0).
  explicit FakeDriver(std::vector<FakeDevice> devices = {FakeDevice{}});
  FakeDriver(const FakeDriver&) = delete;
  FakeDriver& operator=(const FakeDriver&) = delete;
  // Frees whatever the code under test left (tests assert on outstanding() before this).
  ~FakeDriver();

  // The table to hand to the code under test.
  const DriverApi& api() const noexcept;

  // ---- set-up ----
  // Status cuInit returns (CUDA_ERROR_STUB_LIBRARY imitates the toolkit's stub library).
  void set_init_status(CUresult status);
  // What cuDriverGetVersion reports (default 13000).
  void set_driver_version(int version);
  // Registers a module description; fake_image(name) is the image cuModuleLoadData accepts
  // for it. Any other image makes cuModuleLoadData return CUDA_ERROR_INVALID_IMAGE.
  void add_module(const std::string& name, FakeModule module);
  // The image bytes for a registered module: the text "FAKEMOD:<name>" with a trailing NUL.
  static std::vector<unsigned char> fake_image(const std::string& name);
  // Makes cuEventQuery and cuEventElapsedTime answer as if recorded work were done (true, the
  // default) or CUDA_ERROR_NOT_READY (false).
  void set_events_ready(bool ready);
  // While held (true), an event recorded is not done: cuEventQuery answers CUDA_ERROR_NOT_READY
  // for it until cuEventSynchronize waits on it (its work then completes) or release_events.
  // Models work still queued behind a record, one event at a time.
  void hold_events(bool hold);
  // Completes the work behind every held event.
  void release_events();
  // Moves the fake's device clock forward by ms (timing events read it when recorded; every
  // launch moves it by 0.001 ms).
  void advance_clock(double ms);

  // ---- failure injection (counts are per entry-point name, from 1, since construction) ----
  // `call` must name an entry of METRALE_DRIVER_FUNCTIONS, else std::invalid_argument (here and
  // in calls()): a misspelt name would never fail anything.
  // The nth call of `call` (e.g. "cuMemAlloc") returns status and does nothing else.
  void fail_at(const std::string& call, std::uint64_t nth, CUresult status);
  // Every call of `call` from the nth on returns status and does nothing else.
  void fail_from(const std::string& call, std::uint64_t nth, CUresult status);
  // Drops every injected failure.
  void clear_failures();
  // A sticky device fault: from now on cuCtxSynchronize, cuStreamSynchronize, cuLaunchKernel,
  // cuGraphLaunch and every copy/memset return status (as after an illegal address on a real
  // GPU). A graph replay that touches freed memory sets CUDA_ERROR_ILLEGAL_ADDRESS this way.
  void set_sticky_fault(CUresult status);

  // ---- observation ----
  // How many times `call` was made (failed calls included).
  std::uint64_t calls(const std::string& call) const;
  // Total of every call count (for fault-injection sweeps: run once, count, then fail each).
  std::uint64_t total_calls() const;
  // Every launch so far, in order (captured launches appear when replayed, not when captured).
  std::vector<FakeLaunch> launches() const;
  // How many times each graph exec was launched, summed over all execs.
  std::uint64_t graph_replays() const;
  // Bytes currently allocated with cuMemAlloc (not managed) and cuMemCreate.
  std::size_t device_bytes_in_use() const;
  // What is still alive.
  FakeOutstanding outstanding() const;
  // The value cuFuncSetAttribute last set for MAX_DYNAMIC_SHARED_SIZE_BYTES on that entry (0 if
  // never set).
  int max_dynamic_shared(const std::string& function) const;

  struct State;  // defined in fake_state.h

 private:
  std::unique_ptr<State> state_;
};

}  // namespace metrale::cuda::testing
