#include "core/published.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "metrale/error.h"

namespace metrale {
namespace {

std::optional<std::uint32_t> read_u32(std::string_view full, const std::string& symbol,
                                      const SymbolReader& read) {
  const auto bytes = read(symbol);
  if (!bytes) return std::nullopt;
  if (bytes->size() != sizeof(std::uint32_t)) {
    throw Error(ErrorCode::kDriver, "kernel",
                fmt::format("{} publishes {} as {} byte(s); it must be a 4-byte unsigned", full,
                            symbol, bytes->size()));
  }
  std::uint32_t v = 0;
  std::memcpy(&v, bytes->data(), sizeof v);
  return v;
}

}  // namespace

void record_published(OpCache& cache, KernelHandle kernel, std::string_view full,
                      std::string_view function, const SymbolReader& read) {
  const std::string f(function);
  if (const auto tile = read_u32(full, f + "_n_tile", read)) cache.record_n_tile(kernel, *tile);
  KernelLaunchMeta meta;
  meta.m_tile = read_u32(full, f + "_m_tile", read).value_or(0);
  meta.smem_bytes = read_u32(full, f + "_smem_bytes", read).value_or(0);
  meta.split_k = read_u32(full, f + "_split_k", read).value_or(0);
  cache.record_launch_meta(kernel, meta);
  if (const auto flag = read(f + "_a_e4m3")) {
    if (std::any_of(flag->begin(), flag->end(), [](std::byte b) { return b != std::byte{0}; })) {
      cache.record_a_e4m3(kernel);
    }
  }
}

}  // namespace metrale
