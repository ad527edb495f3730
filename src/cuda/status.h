// The driver-status rules in one place: how a CUresult is named and described, which statuses
// mean the context is gone or stuck in a fault, how a failed call becomes an Error, and the
// sticky-fault latch that makes every later call say the device is faulted.
#pragma once

#include <atomic>
#include <mutex>
#include <string>
#include <string_view>

#include "cuda/driver_api.h"

namespace metrale::cuda {

// "NAME (code): description" for a driver status, using the table when it can, and a built-in
// name when the driver cannot say (the stub library answers every call with an error).
std::string describe_status(const DriverApi* api, CUresult status);

// Stable name of a status code, from our own list (used when the driver cannot name it).
const char* status_name(CUresult status) noexcept;

// Whether status means the context is already gone (free and sweep ignore these).
bool is_context_gone(CUresult status) noexcept;
// Whether status is a sticky fault: the context is unusable until the process ends.
bool is_sticky_fault(CUresult status) noexcept;

// Throws the Error for a failed driver call: code from the status (out of memory, capture,
// device fault, driver), message "[api] call failed: NAME (code): description".
[[noreturn]] void throw_status(const DriverApi* api, std::string_view api_name,
                               std::string_view call, CUresult status);

// The sticky-fault latch of one context. The first sticky status it is shown is kept; from then
// on check() fails fast, because every later call on that context would fail anyway.
class FaultLatch {
 public:
  // Latches status when it is a sticky fault and none was latched yet; true only for the call
  // that latched it (so the caller logs the fault once).
  bool latch(const DriverApi* api, CUresult status);
  // Throws Error(kDeviceFault) naming api when a fault was latched.
  void check(std::string_view api) const;
  // Whether a fault was latched.
  bool faulted() const noexcept { return faulted_.load(std::memory_order_acquire); }
  // The latched fault's description ("" when none).
  std::string reason() const;

 private:
  std::atomic<bool> faulted_{false};
  mutable std::mutex mu_;  // reason_
  std::string reason_;
};

}  // namespace metrale::cuda
