// The allocation ledger (docs/CONTRACT.md, ledger): every live pointer a backend handed out, with
// its size, kind and call site. Shared by all backends; thread-safe. The ledger only records:
// freeing is the backend's job, and the ledger is told first so a pointer is never freed twice.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "metrale/call_site.h"
#include "metrale/handles.h"
#include "metrale/pool_stats.h"

namespace metrale {

// Which allocator a pointer came from; the sweep frees each with the matching call.
enum class MemoryKind {
  kDevice,
  kManaged,
  kPinnedHost,
  kLazy,     // a LazyBuffer's mapped part
  kBorrowed  // memory another owner lent (Backend::borrow): never freed, counted apart
};

// Stable lower-case name of a kind ("device", "managed", "pinned", "lazy", "borrowed").
const char* to_string(MemoryKind kind) noexcept;

// One live allocation.
struct LedgerEntry {
  DevicePtr ptr;
  std::size_t bytes = 0;
  MemoryKind kind = MemoryKind::kDevice;
  CallSite site;
};

// Usage counters since the ledger was made (PyTorch's allocator stats, in our terms). The owned
// counters leave borrowed ranges out; the borrowed_* ones count only those.
struct AllocStats {
  std::size_t current_bytes = 0;
  std::size_t peak_bytes = 0;
  std::size_t allocated_bytes = 0;  // sum over every allocation ever recorded
  std::size_t freed_bytes = 0;      // sum over every entry taken off (free or sweep)
  std::size_t current_count = 0;
  std::size_t allocation_count = 0;
  std::size_t free_count = 0;
  std::size_t failed_allocations = 0;  // allocations the backend reported as failed
  std::size_t borrowed_bytes = 0;      // bytes of the live borrows
  std::size_t borrowed_count = 0;      // live borrows
  std::size_t borrow_count = 0;        // borrows ever recorded
  // The OpCache's stream-ordered scratch pool (all zero without one). Its mapped bytes are one
  // kLazy entry among the counts above; these say how they are used.
  PoolStats scratch_pool;
};

class AllocationLedger {
 public:
  // Records a live allocation. A pointer already on the ledger is an internal error (throws).
  void record(const LedgerEntry& entry);
  // Takes ptr's entry off and returns it; nullopt when ptr is not on the ledger.
  std::optional<LedgerEntry> take(DevicePtr ptr);
  // Sets the size of ptr's entry (a lazy buffer that grew): live and peak bytes follow, and
  // growth counts as allocated bytes. False when ptr is not on the ledger.
  bool resize(DevicePtr ptr, std::size_t bytes);
  // Counts an allocation that the backend could not satisfy.
  void note_failure() noexcept;

  // The entry whose allocation starts at ptr, if any.
  std::optional<LedgerEntry> find(DevicePtr ptr) const;
  // The entry whose [ptr, ptr + bytes) holds address (interior pointers too), if any.
  std::optional<LedgerEntry> containing(std::uint64_t address) const;
  // The lowest entry that shares at least one byte with [address, address + bytes), if any.
  std::optional<LedgerEntry> overlapping(std::uint64_t address, std::size_t bytes) const;
  // Sum of the sizes of live owned entries (borrowed ranges are not metrale's bytes).
  std::size_t live_bytes() const;
  // Number of live owned entries.
  std::size_t live_count() const;
  // A copy of the counters.
  AllocStats stats() const;
  // A copy of every live entry, largest first.
  std::vector<LedgerEntry> entries() const;
  // Empties the ledger and returns what it held, largest first (the sweep's first step).
  std::vector<LedgerEntry> drain();

  // Human-readable report: a header (total, site count), the top_n call sites of at least
  // min_mb MiB largest first, one folded line for the rest, and a by-file rollup.
  std::string report(std::size_t top_n = 10, double min_mb = 0.0) const;

 private:
  mutable std::mutex mu_;
  std::map<std::uint64_t, LedgerEntry> live_;  // ordered: containing() finds interior pointers
  AllocStats stats_;
};

// A read-only view of a ledger that stays valid after the backend that owns the ledger is moved
// or destroyed (it shares ownership of the ledger, never of the memory).
class LedgerProbe {
 public:
  explicit LedgerProbe(std::shared_ptr<const AllocationLedger> ledger)
      : ledger_(std::move(ledger)) {}
  // Live bytes now.
  std::size_t live_bytes() const { return ledger_->live_bytes(); }
  // Live allocations now.
  std::size_t live_count() const { return ledger_->live_count(); }
  // Counters now.
  AllocStats stats() const { return ledger_->stats(); }
  // The live entry that starts at ptr, if any (tests check a pointer is still owned).
  std::optional<LedgerEntry> find(DevicePtr ptr) const { return ledger_->find(ptr); }
  // The live entry whose range holds address (interior pointers too), if any.
  std::optional<LedgerEntry> containing(std::uint64_t address) const {
    return ledger_->containing(address);
  }
  // The report, as AllocationLedger::report.
  std::string report(std::size_t top_n = 10, double min_mb = 0.0) const {
    return ledger_->report(top_n, min_mb);
  }

 private:
  std::shared_ptr<const AllocationLedger> ledger_;
};

// Formats "12.3 MiB"-style sizes for reports and logs.
std::string format_bytes(std::size_t bytes);

}  // namespace metrale
