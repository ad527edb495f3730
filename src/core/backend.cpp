#include "metrale/backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/launch_trace.h"
#include "core/log.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"

namespace metrale {
namespace {

// An on/off switch: unset, "" or "0" is off, "1" on. Any other value is named in a warning with
// the accepted ones and, as before the warning existed, taken as on.
bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0' || std::strcmp(v, "0") == 0) return false;
  if (std::strcmp(v, "1") != 0) log::warn("{}={} is not one of 0, 1; taken as 1 (on)", name, v);
  return true;
}

}  // namespace

Backend::Backend()
    : ledger_(std::make_shared<AllocationLedger>()),
      debug_sync_(env_flag("METRALE_DEBUG_SYNC_KERNELS")),
      tracer_(trace::LaunchTracer::from_env()) {}

// The tracer's destructor writes the file; a subclass drains its pending launches before.
Backend::~Backend() = default;

void Backend::flush_trace() noexcept {
  if (!tracer_) return;
  try {
    drain_trace();
  } catch (const std::exception& e) {
    log::warn("METRALE_TRACE={}: collecting the pending launches failed: {}", tracer_->path(),
              e.what());
  }
  tracer_->flush();
}

AllocStats Backend::alloc_stats() const {
  AllocStats s = ledger_->stats();
  s.scratch_pool = op_cache().pool_stats();
  return s;
}

DevicePtr Backend::alloc(std::size_t bytes, std::source_location loc) {
  return allocate("alloc", bytes, MemoryKind::kDevice, CallSite::from(loc));
}

DevicePtr Backend::alloc_managed(std::size_t bytes, std::source_location loc) {
  return allocate("alloc_managed", bytes, MemoryKind::kManaged, CallSite::from(loc));
}

void* Backend::alloc_pinned(std::size_t bytes, std::source_location loc) {
  const DevicePtr p = allocate("alloc_pinned", bytes, MemoryKind::kPinnedHost, CallSite::from(loc));
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(p.address()));
}

DevicePtr Backend::allocate(std::string_view api, std::size_t bytes, MemoryKind kind,
                            CallSite site) {
  if (bytes == 0) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("bytes = 0 (from {}): ask for at least one byte", site.str()));
  }
  // Pinned host memory is read through the host; guard bands cover device memory only.
  const GuardBands::Plan plan =
      kind == MemoryKind::kPinnedHost ? GuardBands::Plan{} : guards_.plan_next();
  DevicePtr p;
  try {
    p = raw_alloc(bytes, plan.pad_bytes, kind);
  } catch (const Error& e) {
    ledger_->note_failure();
    if (e.code() == ErrorCode::kOutOfMemory) {
      throw Error(ErrorCode::kOutOfMemory, api,
                  fmt::format("{} of {} memory from {} failed on {}: {}", format_bytes(bytes),
                              to_string(kind), site.str(), name(), e.what()));
    }
    throw;
  }
  try {
    if (plan.pad_bytes > 0) raw_fill(p.offset(bytes), plan.fill, plan.pad_bytes);
    ledger_->record(LedgerEntry{p, bytes, kind, site});
  } catch (...) {
    raw_free(p, kind);
    throw;
  }
  guards_.add(p, bytes, plan);
  return p;
}

void Backend::borrow(DevicePtr ptr, std::size_t bytes, std::function<void()> release,
                     std::source_location loc) {
  const CallSite site = CallSite::from(loc);
  if (!ptr || bytes == 0) {
    throw Error(ErrorCode::kInvalidArgument, "borrow",
                fmt::format("{} (from {}): lend a non-null range of at least one byte",
                            !ptr ? "ptr is null" : "bytes = 0", site.str()));
  }
  if (bytes > UINT64_MAX - ptr.address()) {
    throw Error(ErrorCode::kInvalidArgument, "borrow",
                fmt::format("0x{:x} + {} bytes wraps around the address space (from {})",
                            ptr.address(), bytes, site.str()));
  }
  // One borrow at a time, so that the overlap check and the record agree.
  std::lock_guard lock(borrow_mu_);
  if (const auto other = ledger_->overlapping(ptr.address(), bytes)) {
    throw Error(ErrorCode::kInvalidArgument, "borrow",
                fmt::format("0x{:x} + {} bytes (from {}) overlaps {} memory at 0x{:x} ({} bytes, "
                            "from {}): a range is owned or lent once",
                            ptr.address(), bytes, site.str(), to_string(other->kind),
                            other->ptr.address(), other->bytes, other->site.str()));
  }
  raw_borrow(ptr, bytes);
  try {
    borrow_release_[ptr.address()] = std::move(release);
    ledger_->record(LedgerEntry{ptr, bytes, MemoryKind::kBorrowed, site});
  } catch (...) {
    borrow_release_.erase(ptr.address());
    raw_unborrow(ptr);
    throw;
  }
}

void Backend::unborrow(DevicePtr ptr) {
  give_back_borrow("unborrow", ptr, true);
}

void Backend::unborrow_ordered(DevicePtr ptr) {
  give_back_borrow("unborrow_ordered", ptr, false);
}

StreamHandle Backend::adopt_stream(std::uint64_t raw) {
  throw Error(
      ErrorCode::kUnavailable, "adopt_stream",
      fmt::format("the {} backend runs no work on another library's streams (stream 0x{:x})",
                  name(), raw));
}

void Backend::release_stream(StreamHandle) noexcept {}

bool Backend::capturing(std::string_view, StreamHandle stream) {
  return is_capturing(stream);
}

void Backend::give_back_borrow(std::string_view api, DevicePtr ptr, bool wait) {
  const auto found = ledger_->find(ptr);
  if (!found || found->kind != MemoryKind::kBorrowed) {
    throw Error(ErrorCode::kInvalidArgument, api,
                found ? fmt::format("0x{:x} is {} memory from {}, not a borrow; free it instead",
                                    ptr.address(), to_string(found->kind), found->site.str())
                      : fmt::format("0x{:x} starts no live borrow of the {} backend", ptr.address(),
                                    name()));
  }
  // Work queued before this call may still read or write the memory, unless the owner orders
  // its reuse after that work itself.
  if (wait) synchronize_device();
  if (!ledger_->take(ptr)) return;  // a concurrent unborrow won
  give_back(ptr);
}

void Backend::give_back(DevicePtr ptr) noexcept {
  raw_unborrow(ptr);
  std::function<void()> release;
  {
    std::lock_guard lock(borrow_mu_);
    const auto it = borrow_release_.find(ptr.address());
    if (it == borrow_release_.end()) return;
    release = std::move(it->second);
    borrow_release_.erase(it);
  }
  if (!release) return;
  try {
    release();
  } catch (const std::exception& e) {
    log::warn("{}: the release of the borrow at 0x{:x} threw: {}", name(), ptr.address(), e.what());
  } catch (...) {
    log::warn("{}: the release of the borrow at 0x{:x} threw", name(), ptr.address());
  }
}

void Backend::raw_borrow(DevicePtr, std::size_t) {}

void Backend::raw_unborrow(DevicePtr) noexcept {}

void Backend::free(DevicePtr ptr) {
  release("free", ptr, false);
}

void Backend::free_pinned(void* host) {
  release("free_pinned", DevicePtr{reinterpret_cast<std::uintptr_t>(host)}, true);
}

void Backend::release(std::string_view api, DevicePtr ptr, bool pinned) {
  if (!ptr) return;
  const auto found = ledger_->find(ptr);
  if (found && found->kind == MemoryKind::kBorrowed) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("0x{:x} is borrowed memory (lent at {}); metrale never frees it: give "
                            "it back with unborrow",
                            ptr.address(), found->site.str()));
  }
  if (found && (found->kind == MemoryKind::kPinnedHost) != pinned) {
    throw Error(
        ErrorCode::kInvalidArgument, api,
        fmt::format("0x{:x} is {} memory from {}; free it with {}", ptr.address(),
                    to_string(found->kind), found->site.str(), pinned ? "free" : "free_pinned"));
  }
  if (found && found->kind == MemoryKind::kLazy) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("0x{:x} is the base of a lazy buffer reserved at {}; release it with "
                            "LazyBuffer::release",
                            ptr.address(), found->site.str()));
  }
  // Taken off before the raw free, whatever that returns, so the sweep never frees it twice.
  const auto entry = found ? ledger_->take(ptr) : std::nullopt;
  if (!entry) {
    std::string why = describe_unknown_pointer(ptr);
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("0x{:x} is not a live allocation of the {} backend{}{}", ptr.address(),
                            name(), why.empty() ? "" : ": ", why));
  }
  guards_.remove(ptr);
  raw_free(ptr, entry->kind);
}

std::vector<LedgerEntry> Backend::sweep_unreleased_entries() {
  std::vector<LedgerEntry> left = ledger_->drain();
  if (left.empty()) return left;
  // Borrows never given back are given back now, after the work that may use them; they are
  // not leaks of metrale's memory, so they are logged apart and never freed.
  const auto lent = std::stable_partition(left.begin(), left.end(), [](const LedgerEntry& e) {
    return e.kind != MemoryKind::kBorrowed;
  });
  if (lent != left.end()) {
    try {
      synchronize_device();
    } catch (const std::exception& ex) {
      log::warn("{} sweep: waiting for the device before giving back borrows failed: {}", name(),
                ex.what());
    }
    for (auto it = lent; it != left.end(); ++it) {
      log::warn(
          "{} sweep: the borrow of {} at 0x{:x} (lent at {}) was never given back; giving "
          "it back",
          name(), format_bytes(it->bytes), it->ptr.address(), it->site.str());
      give_back(it->ptr);
    }
  }
  const auto owned = static_cast<std::size_t>(lent - left.begin());
  if (owned == 0) return left;
  std::size_t total = 0;
  for (std::size_t i = 0; i < owned; ++i) total += left[i].bytes;
  std::string sites;
  for (std::size_t i = 0; i < owned && i < 5; ++i) {
    sites +=
        fmt::format("{}{} at {}", i ? ", " : "", format_bytes(left[i].bytes), left[i].site.str());
  }
  log::warn("{} sweep: {} allocation(s) never freed, {} in all; largest: {}", name(), owned,
            format_bytes(total), sites);
  for (std::size_t i = 0; i < owned; ++i) {
    const LedgerEntry& e = left[i];
    if (e.kind == MemoryKind::kLazy) {
      sweep_lazy(e);
      continue;
    }
    guards_.remove(e.ptr);
    try {
      raw_free(e.ptr, e.kind);
    } catch (const std::exception& ex) {
      log::warn("{} sweep: freeing 0x{:x} ({} from {}) failed: {}", name(), e.ptr.address(),
                format_bytes(e.bytes), e.site.str(), ex.what());
    }
  }
  return left;
}

void Backend::launch_typed(KernelHandle kernel, Dim3 grid, Dim3 block, std::uint32_t shared_bytes,
                           StreamHandle stream, std::span<const KernelArg> args) {
  check_args(kernel, args);
  PackedArgs packed(args);
  launch(kernel, grid, block, shared_bytes, stream,
         std::span<void*>(packed.params(), packed.count()));
}

ResolvedKernel Backend::kernel(std::string_view module, std::string_view function,
                               std::source_location loc) {
  constexpr std::size_t kAuditCap = 4096;
  const CallSite site = CallSite::from(loc);
  KernelLookup entry{std::string(module), std::string(function), false, site, {}};
  auto remember = [&] {
    std::lock_guard lock(audit_mu_);
    if (audit_.size() < kAuditCap) audit_.push_back(entry);
  };
  try {
    const ResolvedKernel k = resolve_kernel(module, function, site);
    entry.resolved = true;
    remember();
    return k;
  } catch (const std::exception& e) {
    entry.error = e.what();
    remember();
    throw;
  }
}

std::vector<KernelLookup> Backend::lookup_audit() const {
  std::lock_guard lock(audit_mu_);
  return audit_;
}

bool Backend::has_kernel(std::string_view module, std::string_view function) const {
  if (!has_module(module)) return false;
  for (const ModuleListing& m : modules()) {
    if (m.name != module) continue;
    for (const std::string& k : m.kernels) {
      if (k == function) return true;
    }
  }
  return false;
}

std::uint32_t Backend::kernel_n_tile(const ResolvedKernel& kernel) const {
  const std::uint32_t tile = kernel.meta.n_tile;
  if (tile == 0) {
    throw Error(ErrorCode::kNotFound, "kernel_n_tile",
                fmt::format("{} publishes no N tile (its <entry>_n_tile symbol is missing or 0); "
                            "a launcher cannot size its grid from an assumed width",
                            kernel_name(kernel)));
  }
  return tile;
}

bool Backend::kernel_casts_a_to_e4m3(const ResolvedKernel& kernel) {
  return kernel.meta.a_e4m3;
}

std::string Backend::kernel_name(KernelHandle kernel) const {
  return fmt::format("kernel 0x{:x}", kernel.value());
}

std::string Backend::describe_unknown_pointer(DevicePtr) const {
  return {};
}

void Backend::check_args(KernelHandle, std::span<const KernelArg>) {}

// What the ledger can tell: a range that starts inside one of this backend's allocations must
// end inside it. A pointer into no allocation is let through: it may be memory the caller got
// elsewhere (another library's allocator), which only the driver can judge.
void Backend::check_owned_range(std::string_view api, std::string_view what, DevicePtr ptr,
                                std::uint64_t bytes) const {
  if (!ledger_->containing(ptr.address())) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("{} 0x{:x} lies in no allocation of this {} backend", what,
                            ptr.address(), name()));
  }
  check_range(api, what, ptr, bytes);
}

void Backend::check_range(std::string_view api, std::string_view what, DevicePtr ptr,
                          std::uint64_t bytes) const {
  if (!ptr || bytes == 0) return;
  check_lazy_range(api, what, ptr, bytes);
  const std::optional<LedgerEntry> e = ledger_->containing(ptr.address());
  if (!e) return;
  const std::uint64_t offset = ptr.address() - e->ptr.address();
  if (bytes > e->bytes - offset) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("{} 0x{:x} + {} bytes overruns the allocation at 0x{:x} ({} bytes, "
                            "from {}) by {} bytes",
                            what, ptr.address(), bytes, e->ptr.address(), e->bytes, e->site.str(),
                            bytes - (e->bytes - offset)));
  }
}

// Both walk the bands under the registry's lock, so a concurrent free waits for the scan. See
// Note [guard-band scans hold the lock] in docs/NOTES.md.
std::size_t Backend::scan_redzones() {
  std::size_t violated = 0;
  std::vector<std::uint8_t> pad;
  guards_.visit([&](GuardBand& band) {
    pad.resize(band.pad_bytes);
    raw_read(band.pad(), pad.data(), pad.size());
    if (const auto v = check_guard_band(band, pad)) {
      log::warn("{} scan_redzones: {}", name(), v->describe());
      raw_fill(band.pad(), band.fill, band.pad_bytes);
      ++violated;
    }
  });
  return violated;
}

void Backend::poison_redzones(std::size_t lo, std::size_t hi) {
  guards_.visit([&](GuardBand& band) {
    band.fill = (band.index >= lo && band.index < hi) ? kGuardFill : 0x00;
    raw_fill(band.pad(), band.fill, band.pad_bytes);
  });
}

}  // namespace metrale
