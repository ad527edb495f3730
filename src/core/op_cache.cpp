#include "metrale/op_cache.h"

#include <fmt/format.h>

#include <optional>
#include <vector>

#include "core/log.h"
#include "metrale/backend.h"
#include "metrale/error.h"

namespace metrale {

std::size_t OpCache::KeyHash::operator()(const KeyView& k) const noexcept {
  // FNV-1a over "module\0function": short names hash in a few nanoseconds, and the separator
  // keeps ("ab","c") and ("a","bc") apart.
  std::uint64_t h = fnv1a64(k.module);
  h = (h ^ 0u) * 1099511628211ull;
  for (char c : k.function) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return static_cast<std::size_t>(h);
}

std::size_t OpCache::ShapeHash::operator()(
    const std::tuple<std::uint64_t, std::uint32_t, std::uint32_t, std::uint32_t>& t) const noexcept {
  std::uint64_t h = std::get<0>(t);
  for (std::uint64_t v : {std::uint64_t{std::get<1>(t)}, std::uint64_t{std::get<2>(t)},
                          std::uint64_t{std::get<3>(t)}}) {
    h = (h ^ v) * 1099511628211ull;
  }
  return static_cast<std::size_t>(h);
}

KernelHandle OpCache::kernel(Backend& backend, std::string_view module, std::string_view function,
                             std::source_location loc) {
  {
    std::shared_lock lock(kernels_mu_);
    const auto it = kernels_.find(KeyView{module, function});
    if (it != kernels_.end()) return it->second;
  }
  // The lookup runs without the lock: it may call the driver, which can be slow or re-enter
  // this cache to record metadata. Two threads racing here both resolve; the first insert wins
  // and both return the same handle.
  const KernelHandle h = backend.kernel(module, function, loc);
  std::unique_lock lock(kernels_mu_);
  const auto [it, _] = kernels_.try_emplace(KernelKey{std::string(module), std::string(function)}, h);
  return it->second;
}

DevicePtr OpCache::scratch(Backend& backend, std::string_view tag, std::size_t bytes,
                           std::source_location loc) {
  if (bytes == 0) {
    throw Error(ErrorCode::kInvalidArgument, "scratch",
                fmt::format("tag '{}': a scratch request of 0 bytes", tag));
  }
  const std::string key(tag);
  {
    std::lock_guard lock(scratch_mu_);
    const auto it = scratch_.find(key);
    if (it != scratch_.end() && it->second.bytes >= bytes) return it->second.ptr;
  }
  // Allocate outside the lock (never hold a lock across a driver call), then install unless
  // another thread installed a buffer that fits meanwhile.
  const DevicePtr fresh = backend.alloc(bytes, loc);
  std::optional<DevicePtr> winner;
  {
    std::lock_guard lock(scratch_mu_);
    Scratch& slot = scratch_[key];
    if (slot.ptr && slot.bytes >= bytes) {
      winner = slot.ptr;
    } else {
      // The replaced pointer is dropped, not freed: work queued before this call may still
      // read it. It stays on the ledger until the sweep.
      slot = Scratch{fresh, bytes};
    }
  }
  if (winner) {
    backend.free(fresh);
    return *winner;
  }
  return fresh;
}

void OpCache::record_n_tile(KernelHandle kernel, std::uint32_t n_tile) {
  std::unique_lock lock(meta_mu_);
  n_tiles_[kernel] = n_tile;
}

std::uint32_t OpCache::n_tile(KernelHandle kernel) const {
  std::shared_lock lock(meta_mu_);
  const auto it = n_tiles_.find(kernel);
  return it == n_tiles_.end() ? 0 : it->second;
}

void OpCache::record_a_e4m3(KernelHandle kernel) {
  std::unique_lock lock(meta_mu_);
  a_e4m3_.insert(kernel);
}

bool OpCache::a_e4m3(KernelHandle kernel) const {
  std::shared_lock lock(meta_mu_);
  return a_e4m3_.contains(kernel);
}

bool OpCache::first_n(std::string_view key, std::uint32_t n) {
  std::lock_guard lock(gates_mu_);
  auto it = counters_.find(std::string(key));
  if (it == counters_.end()) it = counters_.emplace(std::string(key), 0).first;
  // Saturate instead of wrapping, so a gate that closed stays closed.
  if (it->second < UINT32_MAX) ++it->second;
  return it->second <= n;
}

bool OpCache::first_shape(std::string_view name, std::uint32_t m, std::uint32_t n,
                          std::uint32_t k) {
  std::lock_guard lock(gates_mu_);
  return seen_shapes_.emplace(fnv1a64(name), m, n, k).second;
}

std::size_t OpCache::kernel_count() const {
  std::shared_lock lock(kernels_mu_);
  return kernels_.size();
}

std::size_t OpCache::scratch_count() const {
  std::lock_guard lock(scratch_mu_);
  return scratch_.size();
}

std::string OpCache::summary() const {
  return fmt::format("OpCache{{kernels: {}, scratch: {}}}", kernel_count(), scratch_count());
}

void OpCache::release(Backend& backend) {
  std::unordered_map<std::string, Scratch> taken;
  {
    std::lock_guard lock(scratch_mu_);
    taken.swap(scratch_);
  }
  std::optional<Error> first;
  std::string first_other;
  for (const auto& [tag, s] : taken) {
    try {
      backend.free(s.ptr);
    } catch (const Error& e) {
      log::warn("op scratch: freeing '{}' failed: {}", tag, e.what());
      if (!first && first_other.empty()) first = e;
    } catch (const std::exception& e) {
      log::warn("op scratch: freeing '{}' failed: {}", tag, e.what());
      if (!first && first_other.empty()) first_other = e.what();
    }
  }
  if (first) throw *first;
  if (!first_other.empty()) throw Error(ErrorCode::kInternal, "op scratch", first_other);
}

}  // namespace metrale
