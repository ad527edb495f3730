#include "cpu/faults.h"

#include <fmt/format.h>

#include <algorithm>

#include "metrale/error.h"
#include "metrale/ledger.h"

namespace metrale::cpu {
namespace {

// Releases are left out: on the CPU they fail only for a handle that is not live, which is the
// caller's error, not a fault.
constexpr std::string_view kFaultCalls[] = {
    "alloc",
    "alloc_managed",
    "alloc_pinned",
    "create_stream",
    "create_event",
    "record_event",
    "wait_event",
    "synchronize",
    "synchronize_device",
    "event_synchronize",
    "kernel",
    "launch",
    "copy_h2d",
    "copy_d2h",
    "copy_d2d",
    "copy_2d",
    "memset",
    "begin_capture",
    "end_capture",
    "launch_graph",
    "create_timing_event",
    "lazy_reserve",
    "lazy_commit",
};

}  // namespace

std::span<const std::string_view> fault_call_names() noexcept {
  return kFaultCalls;
}

void FaultInjector::set(CpuFaults faults) {
  const std::string_view of = faults.fail_call_of;
  if (!of.empty() && std::none_of(std::begin(kFaultCalls), std::end(kFaultCalls),
                                  [&](std::string_view c) { return c.starts_with(of); })) {
    throw Error(ErrorCode::kInvalidArgument, "set_faults",
                fmt::format("fail_call_of '{}' begins no fallible call's name ({})", of,
                            fmt::join(kFaultCalls, ", ")));
  }
  std::lock_guard lock(mu_);
  faults_ = std::move(faults);
  calls_ = 0;
  selected_ = 0;
  log_.clear();
}

void FaultInjector::point(std::string_view call) {
  std::lock_guard lock(mu_);
  const std::uint64_t n = ++calls_;
  if (faults_.record_calls) log_.push_back(call);
  if (faults_.fail_call_at == 0) return;
  const bool alloc = call.starts_with("alloc");
  const auto fail = [&](std::string what) {
    throw Error(alloc ? ErrorCode::kOutOfMemory : ErrorCode::kDriver, "cpu",
                fmt::format("{}: injected failure ({})", call, what));
  };
  if (faults_.fail_call_of.empty()) {
    if (n == faults_.fail_call_at) fail(fmt::format("call #{}", n));
    return;
  }
  if (!call.starts_with(faults_.fail_call_of)) return;
  const std::uint64_t m = ++selected_;
  if (m == faults_.fail_call_at) {
    fail(fmt::format("{} call #{}, call #{} of all", faults_.fail_call_of, m, n));
  }
}

void FaultInjector::check_device_alloc(std::size_t user_bytes, std::size_t pad_bytes) const {
  std::lock_guard lock(mu_);
  const std::size_t cap = faults_.max_device_alloc;
  if (user_bytes > cap || pad_bytes > cap - user_bytes) {
    throw Error(ErrorCode::kOutOfMemory, "alloc",
                fmt::format("{} exceeds the injected device allocation cap of {}",
                            format_bytes(user_bytes + pad_bytes), format_bytes(cap)));
  }
}

void FaultInjector::check_lookup(const std::string& full, std::string_view site) const {
  std::lock_guard lock(mu_);
  const auto& deny = faults_.deny_lookups;
  if (std::find(deny.begin(), deny.end(), full) != deny.end()) {
    throw Error(ErrorCode::kNotFound, "kernel",
                fmt::format("{} (from {}) denied by fault injection", full, site));
  }
}

std::uint64_t FaultInjector::count() const {
  std::lock_guard lock(mu_);
  return calls_;
}

std::vector<std::string> FaultInjector::calls() const {
  std::lock_guard lock(mu_);
  return {log_.begin(), log_.end()};
}

}  // namespace metrale::cpu
