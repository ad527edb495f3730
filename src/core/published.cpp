#include "core/published.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "metrale/error.h"

namespace metrale {
namespace {

std::uint32_t read_u32(std::string_view full, const std::string& symbol, const SymbolReader& read) {
  const auto bytes = read(symbol);
  if (!bytes) return 0;
  if (bytes->size() != sizeof(std::uint32_t)) {
    throw Error(ErrorCode::kDriver, "kernel",
                fmt::format("{} publishes {} as {} byte(s); it must be a 4-byte unsigned", full,
                            symbol, bytes->size()));
  }
  std::uint32_t v = 0;
  std::memcpy(&v, bytes->data(), sizeof v);
  return v;
}

bool read_flag(const std::string& symbol, const SymbolReader& read) {
  const auto bytes = read(symbol);
  return bytes &&
         std::any_of(bytes->begin(), bytes->end(), [](std::byte b) { return b != std::byte{0}; });
}

}  // namespace

KernelMeta read_published(std::string_view full, std::string_view function,
                          const SymbolReader& read) {
  const std::string f(function);
  KernelMeta meta;
#define METRALE_PUBLISHED_U32(field) meta.field = read_u32(full, f + "_" #field, read);
#define METRALE_PUBLISHED_FLAG(field) meta.field = read_flag(f + "_" #field, read);
#include "kernels/published.def"
#undef METRALE_PUBLISHED_U32
#undef METRALE_PUBLISHED_FLAG
  return meta;
}

}  // namespace metrale
