// Lazy buffers: the rules every backend shares (budget, growth, the capture and free-memory
// refusals, the ledger, release) around a backend's LazyRegion.
#include "metrale/lazy_buffer.h"

#include <fmt/format.h>

#include <atomic>
#include <charconv>
#include <cstdlib>
#include <mutex>
#include <string_view>

#include "core/log.h"
#include "metrale/backend.h"
#include "metrale/error.h"

namespace metrale {

namespace detail {
// One buffer's state, shared by its handle and the backend's registry (so the backend's sweep
// can release a buffer whose handle outlives it, and the handle then knows not to touch it).
struct LazyState {
  Backend* backend = nullptr;
  std::unique_ptr<LazyRegion> region;
  DevicePtr base;
  std::size_t budget = 0, granularity = 0;
  std::string label;
  CallSite site;
  std::mutex mu;                       // grow and release, one at a time
  std::atomic<std::size_t> mapped{0};  // read without mu (check_range, accessors)
  std::atomic<bool> released{false};
};
}  // namespace detail

namespace {

constexpr const char* kFloorSwitch = "METRALE_LAZY_FREE_FLOOR_MB";

// METRALE_LAZY_FREE_FLOOR_MB in bytes: unset or "" is no floor; anything but a decimal count of
// MiB is named in a warning and ignored, as the other numeric switches are.
std::size_t free_floor_bytes() {
  const char* text = std::getenv(kFloorSwitch);
  if (text == nullptr || *text == '\0') return 0;
  const std::string_view s(text);
  std::size_t mb = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), mb);
  if (ec != std::errc{} || end != s.data() + s.size() || mb > (SIZE_MAX >> 20)) {
    log::warn("{}={} is not a whole number of MiB; ignored", kFloorSwitch, text);
    return 0;
  }
  return mb << 20;
}

std::string describe(const detail::LazyState& s) {
  return fmt::format("lazy buffer '{}' (reserved at {})", s.label, s.site.str());
}

}  // namespace

// ---- Backend side ----

std::size_t Backend::lazy_granularity() {
  throw Error(ErrorCode::kUnavailable, "reserve_lazy",
              fmt::format("the {} backend has no lazy buffers", name()));
}

std::unique_ptr<LazyRegion> Backend::raw_reserve_lazy(std::size_t, std::size_t) {
  lazy_granularity();
  throw Error(ErrorCode::kInternal, "reserve_lazy", "lazy_granularity returned without buffers");
}

bool Backend::capture_in_progress() {
  return is_capturing(default_stream());
}

LazyBuffer Backend::reserve_lazy(std::size_t budget_bytes, std::string label,
                                 std::source_location loc) {
  const CallSite site = CallSite::from(loc);
  const std::size_t g = lazy_granularity();
  if (budget_bytes < g) {
    throw Error(ErrorCode::kInvalidArgument, "reserve_lazy",
                fmt::format("budget_bytes = {} for '{}' (from {}) is below one granule of the {} "
                            "backend ({} bytes)",
                            budget_bytes, label, site.str(), name(), g));
  }
  auto state = std::make_shared<detail::LazyState>();
  state->backend = this;
  state->budget = budget_bytes / g * g;
  state->granularity = g;
  state->label = std::move(label);
  state->site = site;
  state->region = raw_reserve_lazy(state->budget, g);
  state->base = state->region->base();
  try {
    ledger_->record(LedgerEntry{state->base, 0, MemoryKind::kLazy, site});
    std::lock_guard lock(lazy_mu_);
    lazy_[state->base.address()] = state;
  } catch (...) {
    ledger_->take(state->base);
    try {
      state->region->release();
    } catch (const std::exception& e) {
      log::warn("reserve_lazy: releasing {} after a failure failed: {}", describe(*state),
                e.what());
    }
    throw;
  }
  return LazyBuffer(std::move(state));
}

std::size_t Backend::lazy_grow(detail::LazyState& s, std::size_t bytes) {
  constexpr std::string_view kApi = "LazyBuffer::grow";
  std::lock_guard lock(s.mu);
  if (s.released) {
    throw Error(ErrorCode::kState, kApi, fmt::format("{} was already released", describe(s)));
  }
  const std::size_t mapped = s.mapped;
  if (bytes <= mapped) return mapped;
  if (bytes > s.budget) {
    throw Error(ErrorCode::kOutOfMemory, kApi,
                fmt::format("bytes = {} is past the budget of {} ({} bytes; {} mapped)", bytes,
                            describe(s), s.budget, mapped));
  }
  const std::size_t want = (bytes + s.granularity - 1) / s.granularity * s.granularity;
  if (capture_in_progress()) {
    throw Error(ErrorCode::kCapture, kApi,
                fmt::format("bytes = {}: a stream of the {} backend is capturing; mapping {} now "
                            "would change memory a graph may already use (grow before capture)",
                            bytes, name(), describe(s)));
  }
  const std::size_t more = want - mapped;
  if (const std::size_t floor = free_floor_bytes(); floor > 0) {
    const std::size_t free_now = free_memory();
    if (free_now < more || free_now - more < floor) {
      throw Error(ErrorCode::kOutOfMemory, kApi,
                  fmt::format("bytes = {}: mapping {} more for {} would leave {} of device memory "
                              "free ({} free now), below the floor of {} set by {}",
                              bytes, format_bytes(more), describe(s),
                              format_bytes(free_now < more ? 0 : free_now - more),
                              format_bytes(free_now), format_bytes(floor), kFloorSwitch));
    }
  }
  try {
    s.region->map(mapped, more);
  } catch (...) {
    ledger_->note_failure();
    throw;
  }
  s.mapped = want;
  ledger_->resize(s.base, want);
  return want;
}

void Backend::lazy_release(detail::LazyState& s) {
  std::lock_guard lock(s.mu);
  if (s.released.exchange(true)) {
    throw Error(
        ErrorCode::kState, "LazyBuffer::release",
        fmt::format("{} was already released; a second release frees nothing", describe(s)));
  }
  {
    std::lock_guard reg(lazy_mu_);
    lazy_.erase(s.base.address());
  }
  ledger_->take(s.base);  // off the ledger first, whatever the release does (as free)
  s.mapped = 0;
  std::exception_ptr first;
  try {
    synchronize_device();
  } catch (...) {
    first = std::current_exception();
  }
  try {
    s.region->release();
  } catch (...) {
    if (!first) first = std::current_exception();
  }
  s.region.reset();
  if (first) std::rethrow_exception(first);
}

void Backend::sweep_lazy(const LedgerEntry& entry) noexcept {
  std::shared_ptr<detail::LazyState> s;
  {
    std::lock_guard reg(lazy_mu_);
    const auto it = lazy_.find(entry.ptr.address());
    if (it == lazy_.end()) return;
    s = std::move(it->second);
    lazy_.erase(it);
  }
  std::lock_guard lock(s->mu);
  if (s->released.exchange(true)) return;
  s->mapped = 0;
  try {
    s->region->release();
  } catch (const std::exception& e) {
    log::warn("{} sweep: releasing {} failed: {}", name(), describe(*s), e.what());
  }
  s->region.reset();
}

void Backend::check_lazy_range(std::string_view api, std::string_view what, DevicePtr ptr,
                               std::uint64_t bytes) const {
  if (!ptr || bytes == 0) return;
  std::lock_guard reg(lazy_mu_);
  auto it = lazy_.upper_bound(ptr.address());
  if (it == lazy_.begin()) return;
  --it;
  const detail::LazyState& s = *it->second;
  const std::uint64_t offset = ptr.address() - s.base.address();
  if (offset >= s.budget) return;
  const std::size_t mapped = s.mapped;
  if (offset < mapped && bytes <= mapped - offset) return;
  throw Error(ErrorCode::kInvalidArgument, api,
              fmt::format("{} 0x{:x} + {} bytes lies beyond the {} mapped bytes of {} at 0x{:x} "
                          "(grow it first)",
                          what, ptr.address(), bytes, mapped, describe(s), s.base.address()));
}

// ---- the handle ----

LazyBuffer::LazyBuffer() noexcept = default;
LazyBuffer::LazyBuffer(std::shared_ptr<detail::LazyState> state) noexcept
    : state_(std::move(state)) {}
LazyBuffer::LazyBuffer(LazyBuffer&& other) noexcept = default;

LazyBuffer& LazyBuffer::operator=(LazyBuffer&& other) noexcept {
  if (this != &other) {
    LazyBuffer dying(std::move(*this));
    state_ = std::move(other.state_);
  }
  return *this;
}

LazyBuffer::~LazyBuffer() {
  if (!live()) return;
  try {
    state_->backend->lazy_release(*state_);
  } catch (const std::exception& e) {
    log::warn("LazyBuffer: releasing {} at destruction failed: {}", describe(*state_), e.what());
  }
}

std::size_t LazyBuffer::grow(std::size_t bytes) {
  if (!state_) {
    throw Error(ErrorCode::kState, "LazyBuffer::grow",
                "this handle holds no lazy buffer (default-made or moved from)");
  }
  return state_->backend->lazy_grow(*state_, bytes);
}

void LazyBuffer::release() {
  if (!state_) {
    throw Error(ErrorCode::kState, "LazyBuffer::release",
                "this handle holds no lazy buffer (default-made or moved from)");
  }
  state_->backend->lazy_release(*state_);
}

DevicePtr LazyBuffer::base() const noexcept {
  return state_ ? state_->base : DevicePtr{};
}
std::size_t LazyBuffer::mapped_bytes() const noexcept {
  return state_ ? state_->mapped.load() : 0;
}
std::size_t LazyBuffer::budget_bytes() const noexcept {
  return state_ ? state_->budget : 0;
}
std::size_t LazyBuffer::granularity() const noexcept {
  return state_ ? state_->granularity : 0;
}
const std::string& LazyBuffer::label() const noexcept {
  static const std::string kNone;
  return state_ ? state_->label : kNone;
}
bool LazyBuffer::live() const noexcept {
  return state_ && !state_->released;
}

void LazyBufferResource::release(Backend&) {
  if (buffer_.live()) buffer_.release();
}

}  // namespace metrale
