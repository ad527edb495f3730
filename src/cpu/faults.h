// The CPU backend's fault injection (CpuFaults): numbered fallible calls, the device allocation
// cap and denied kernel lookups, behind one lock so that threads calling the backend at once
// get one numbering.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "metrale/cpu_backend.h"

namespace metrale::cpu {

// Every fallible primitive's name (CpuBackend::fault_call_names).
std::span<const std::string_view> fault_call_names() noexcept;

class FaultInjector {
 public:
  // Replaces the faults and restarts the counts; Error(kInvalidArgument) for a fail_call_of
  // that begins no call's name (it would never fail anything).
  void set(CpuFaults faults);
  // Counts one fallible call (one of fault_call_names) and throws when it is the one chosen to
  // fail. Every primitive calls this before any side effect, so a failure leaves nothing
  // half-done.
  void point(std::string_view call);
  // Throws Error(kOutOfMemory) when a device block of user + pad bytes is over the cap.
  void check_device_alloc(std::size_t user_bytes, std::size_t pad_bytes) const;
  // Throws Error(kNotFound) when the lookup "module::function" (from `site`) is denied.
  void check_lookup(const std::string& full, std::string_view site) const;
  // Fallible calls counted since set().
  std::uint64_t count() const;
  // Their names in order, when record_calls.
  std::vector<std::string> calls() const;

 private:
  mutable std::mutex mu_;
  CpuFaults faults_;
  std::uint64_t calls_ = 0;            // every fallible call
  std::uint64_t selected_ = 0;         // those whose name begins with faults_.fail_call_of
  std::vector<std::string_view> log_;  // names from fault_call_names, when record_calls
};

}  // namespace metrale::cpu
