#include "memory_fit.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <limits>
#include <string>

#include "metrale/backend.h"
#include "metrale/error.h"
#include "metrale/ledger.h"

namespace metrale::cli {
namespace {

constexpr std::size_t kUnknown = std::numeric_limits<std::size_t>::max();

// "230399999997696 bytes (209.5 TiB)": exact for a script, rounded for a reader.
std::string bytes_text(std::size_t bytes) {
  // A sum that overflowed saturates: it is a lower bound then.
  return fmt::format("{}{} bytes ({})", bytes == kUnknown ? "at least " : "", bytes,
                     format_bytes(bytes));
}

}  // namespace

std::size_t saturating_mul(std::size_t a, std::size_t b) noexcept {
  std::size_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? kUnknown : r;
}

std::size_t saturating_add(std::size_t a, std::size_t b) noexcept {
  std::size_t r = 0;
  return __builtin_add_overflow(a, b, &r) ? kUnknown : r;
}

std::size_t host_available_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::size_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return saturating_mul(kib, 1024);
  }
  const long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) {
    return saturating_mul(static_cast<std::size_t>(pages), static_cast<std::size_t>(page));
  }
  return kUnknown;
}

void require_fit(const Backend& backend, std::string_view api, std::string_view what,
                 std::size_t host_bytes, std::size_t device_bytes) {
  auto refuse = [&](std::size_t need, std::string_view memory, std::size_t have) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("{} needs {} of {} for its weights, activations and outputs; {} "
                            "are available. Choose a smaller shape or M",
                            what, bytes_text(need), memory, bytes_text(have)));
  };
  if (backend.name() == "cpu") {
    // The CPU backend's device memory is host memory.
    const std::size_t need = saturating_add(host_bytes, device_bytes);
    const std::size_t have = backend.free_memory();
    if (need > have) refuse(need, "host memory", have);
    return;
  }
  const std::size_t device_have = backend.free_memory();
  if (device_bytes > device_have) {
    refuse(device_bytes, fmt::format("{} device memory", backend.name()), device_have);
  }
  const std::size_t host_have = host_available_bytes();
  if (host_have != kUnknown && host_bytes > host_have) refuse(host_bytes, "host memory", host_have);
}

void require_gemm_fit(const Backend& backend, std::string_view api,
                      const std::vector<GemmLayerSize>& layers, std::int64_t max_m) {
  std::size_t weights = 0, host_weights = 0, largest = 0;
  std::int64_t widest_n = 0, widest_k = 0;
  std::string largest_name;
  for (const GemmLayerSize& l : layers) {
    const auto n = static_cast<std::size_t>(l.n), k = static_cast<std::size_t>(l.k);
    const std::size_t bytes = saturating_add(saturating_mul(n, k / 2), saturating_mul(n, k / 16));
    weights = saturating_add(weights, bytes);
    if (l.host_copy) host_weights = saturating_add(host_weights, bytes);
    if (bytes >= largest) {
      largest = bytes;
      largest_name = l.name;
    }
    widest_n = std::max(widest_n, l.n);
    widest_k = std::max(widest_k, l.k);
  }
  const auto rows = static_cast<std::size_t>(max_m);
  const std::size_t a_bytes = saturating_mul(saturating_mul(rows, widest_k), 2);
  const std::size_t c_bytes = saturating_mul(saturating_mul(rows, widest_n), 2);
  require_fit(backend, api,
              layers.size() == 1 ? fmt::format("{} at M = {}", largest_name, rows)
                                 : fmt::format("the {} layers (largest {}) at M = {}",
                                               layers.size(), largest_name, rows),
              saturating_add(host_weights, a_bytes),
              saturating_add(weights, saturating_add(a_bytes, c_bytes)));
}

}  // namespace metrale::cli
