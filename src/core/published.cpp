#include "core/published.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/verified_devices.h"
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

bool automatic_choice_allowed(const KernelMeta& meta) noexcept {
  return !meta.absent && meta.verified_on != verified::kNone;
}

std::string verification_text(const KernelMeta& meta) {
  if (meta.absent) return "not on this target";
  if (meta.verified_on == verified::kNone) return "not yet run on a GPU";
  if (meta.verified_on == verified::kHostReference) return "the host reference";
  const char* device = verified::device_name(meta.verified_on);
  const std::string name = device ? device : fmt::format("device {}", meta.verified_on);
  const std::uint32_t y = meta.verified / 10000, m = meta.verified / 100 % 100,
                      d = meta.verified % 100;
  if (y < 2000 || m < 1 || m > 12 || d < 1 || d > 31) {
    return fmt::format("verified on {}, date {} unreadable", name, meta.verified);
  }
  return fmt::format("verified on {}, {:04}-{:02}-{:02}", name, y, m, d);
}

}  // namespace metrale
