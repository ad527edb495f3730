#include "metrale/ledger.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "metrale/error.h"

namespace metrale {

const char* to_string(MemoryKind kind) noexcept {
  switch (kind) {
    case MemoryKind::kDevice:
      return "device";
    case MemoryKind::kManaged:
      return "managed";
    case MemoryKind::kPinnedHost:
      return "pinned";
    case MemoryKind::kLazy:
      return "lazy";
    case MemoryKind::kBorrowed:
      return "borrowed";
  }
  return "?";
}

std::string format_bytes(std::size_t bytes) {
  constexpr double kKiB = 1024.0;
  const double b = static_cast<double>(bytes);
  if (bytes < 1024) return fmt::format("{} B", bytes);
  if (b < kKiB * kKiB) return fmt::format("{:.1f} KiB", b / kKiB);
  if (b < kKiB * kKiB * kKiB) return fmt::format("{:.1f} MiB", b / (kKiB * kKiB));
  return fmt::format("{:.2f} GiB", b / (kKiB * kKiB * kKiB));
}

void AllocationLedger::record(const LedgerEntry& entry) {
  std::lock_guard lock(mu_);
  const auto [it, inserted] = live_.emplace(entry.ptr.address(), entry);
  if (!inserted) {
    throw Error(ErrorCode::kInternal, "ledger",
                fmt::format("0x{:x} recorded twice (first from {}, again from {})",
                            entry.ptr.address(), it->second.site.str(), entry.site.str()));
  }
  if (entry.kind == MemoryKind::kBorrowed) {
    stats_.borrowed_bytes += entry.bytes;
    stats_.borrowed_count += 1;
    stats_.borrow_count += 1;
    return;
  }
  stats_.current_bytes += entry.bytes;
  stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.current_bytes);
  stats_.allocated_bytes += entry.bytes;
  stats_.current_count += 1;
  stats_.allocation_count += 1;
}

std::optional<LedgerEntry> AllocationLedger::take(DevicePtr ptr) {
  std::lock_guard lock(mu_);
  const auto it = live_.find(ptr.address());
  if (it == live_.end()) return std::nullopt;
  LedgerEntry e = it->second;
  live_.erase(it);
  if (e.kind == MemoryKind::kBorrowed) {
    stats_.borrowed_bytes -= e.bytes;
    stats_.borrowed_count -= 1;
    return e;
  }
  stats_.current_bytes -= e.bytes;
  stats_.current_count -= 1;
  stats_.freed_bytes += e.bytes;
  stats_.free_count += 1;
  return e;
}

bool AllocationLedger::resize(DevicePtr ptr, std::size_t bytes) {
  std::lock_guard lock(mu_);
  const auto it = live_.find(ptr.address());
  if (it == live_.end()) return false;
  const std::size_t old = it->second.bytes;
  it->second.bytes = bytes;
  if (bytes >= old) {
    stats_.current_bytes += bytes - old;
    stats_.allocated_bytes += bytes - old;
    stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.current_bytes);
  } else {
    stats_.current_bytes -= old - bytes;
    stats_.freed_bytes += old - bytes;
  }
  return true;
}

void AllocationLedger::note_failure() noexcept {
  std::lock_guard lock(mu_);
  stats_.failed_allocations += 1;
}

std::optional<LedgerEntry> AllocationLedger::find(DevicePtr ptr) const {
  std::lock_guard lock(mu_);
  const auto it = live_.find(ptr.address());
  if (it == live_.end()) return std::nullopt;
  return it->second;
}

std::optional<LedgerEntry> AllocationLedger::containing(std::uint64_t address) const {
  std::lock_guard lock(mu_);
  auto it = live_.upper_bound(address);
  if (it == live_.begin()) return std::nullopt;
  --it;
  if (address - it->first < it->second.bytes) return it->second;
  return std::nullopt;
}

std::size_t AllocationLedger::live_bytes() const {
  std::lock_guard lock(mu_);
  return stats_.current_bytes;
}

std::optional<LedgerEntry> AllocationLedger::overlapping(std::uint64_t address,
                                                         std::size_t bytes) const {
  std::lock_guard lock(mu_);
  auto it = live_.upper_bound(address);
  if (it != live_.begin()) {
    const auto before = std::prev(it);
    if (address - before->first < before->second.bytes) return before->second;
  }
  if (it != live_.end() && it->first - address < bytes) return it->second;
  return std::nullopt;
}

std::size_t AllocationLedger::live_count() const {
  std::lock_guard lock(mu_);
  return stats_.current_count;
}

AllocStats AllocationLedger::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

namespace {
void sort_largest_first(std::vector<LedgerEntry>& v) {
  std::sort(v.begin(), v.end(), [](const LedgerEntry& a, const LedgerEntry& b) {
    return a.bytes != b.bytes ? a.bytes > b.bytes : a.ptr < b.ptr;
  });
}
}  // namespace

std::vector<LedgerEntry> AllocationLedger::entries() const {
  std::vector<LedgerEntry> out;
  {
    std::lock_guard lock(mu_);
    out.reserve(live_.size());
    for (const auto& [_, e] : live_) out.push_back(e);
  }
  sort_largest_first(out);
  return out;
}

std::vector<LedgerEntry> AllocationLedger::drain() {
  std::vector<LedgerEntry> out;
  {
    std::lock_guard lock(mu_);
    out.reserve(live_.size());
    for (const auto& [_, e] : live_) {
      out.push_back(e);
      if (e.kind == MemoryKind::kBorrowed) continue;  // given back, not freed
      stats_.freed_bytes += e.bytes;
      stats_.free_count += 1;
    }
    live_.clear();
    stats_.current_bytes = 0;
    stats_.current_count = 0;
    stats_.borrowed_bytes = 0;
    stats_.borrowed_count = 0;
  }
  sort_largest_first(out);
  return out;
}

std::string AllocationLedger::report(std::size_t top_n, double min_mb) const {
  struct Total {
    std::size_t bytes = 0, count = 0;
  };
  std::vector<LedgerEntry> live = entries();
  Total borrowed;
  std::erase_if(live, [&](const LedgerEntry& e) {
    if (e.kind != MemoryKind::kBorrowed) return false;
    borrowed.bytes += e.bytes;
    borrowed.count += 1;
    return true;
  });
  std::map<std::string, Total> by_site, by_file;
  std::size_t total = 0;
  for (const LedgerEntry& e : live) {
    total += e.bytes;
    Total& s = by_site[e.site.str()];
    s.bytes += e.bytes;
    s.count += 1;
    Total& f = by_file[e.site.file_name()];
    f.bytes += e.bytes;
    f.count += 1;
  }
  auto ranked = [](const std::map<std::string, Total>& m) {
    std::vector<std::pair<std::string, Total>> v(m.begin(), m.end());
    std::stable_sort(v.begin(), v.end(),
                     [](const auto& a, const auto& b) { return a.second.bytes > b.second.bytes; });
    return v;
  };

  std::string out =
      fmt::format("allocation ledger: {} live in {} allocation(s) from {} call site(s)\n",
                  format_bytes(total), live.size(), by_site.size());
  if (borrowed.count > 0) {
    out += fmt::format("  and {} borrowed in {} range(s), not owned\n",
                       format_bytes(borrowed.bytes), borrowed.count);
  }
  const auto min_bytes = static_cast<std::size_t>(min_mb * 1024.0 * 1024.0);
  Total rest;
  std::size_t rest_sites = 0, shown = 0;
  for (const auto& [site, t] : ranked(by_site)) {
    if (shown < top_n && t.bytes >= min_bytes) {
      out += fmt::format("  {:>10}  {:>5} alloc(s)  {}\n", format_bytes(t.bytes), t.count, site);
      ++shown;
    } else {
      rest.bytes += t.bytes;
      rest.count += t.count;
      ++rest_sites;
    }
  }
  if (rest_sites > 0) {
    out += fmt::format("  {:>10}  {:>5} alloc(s)  ({} more site(s))\n", format_bytes(rest.bytes),
                       rest.count, rest_sites);
  }
  if (!by_file.empty()) {
    out += "by file:\n";
    for (const auto& [file, t] : ranked(by_file)) {
      out += fmt::format("  {:>10}  {:>5} alloc(s)  {}\n", format_bytes(t.bytes), t.count, file);
    }
  }
  return out;
}

}  // namespace metrale
