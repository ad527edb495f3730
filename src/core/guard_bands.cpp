#include "metrale/guard_bands.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <string>
#include <string_view>
#include <system_error>

#include "core/log.h"

namespace metrale {
namespace {

// Parses a non-negative integer (decimal or 0x hex); nullopt when text is not one. Leading
// zeros stay decimal, and signs, spaces and values beyond 64 bits are refused (strtoull would
// read "010" as octal, " -1" as 2^64-1 and clamp an overflow to 2^64-1).
std::optional<std::uint64_t> parse_u64(const char* text) {
  if (text == nullptr) return std::nullopt;
  const std::string_view s(text);
  const bool hex = s.size() > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X');
  const std::string_view digits = hex ? s.substr(2) : s;
  if (digits.empty()) return std::nullopt;
  std::uint64_t v = 0;
  const char* last = digits.data() + digits.size();
  const auto [end, ec] = std::from_chars(digits.data(), last, v, hex ? 16 : 10);
  if (ec != std::errc{} || end != last) return std::nullopt;
  return v;
}

template <class T>
void read_env(const char* name, T& out, std::uint64_t max) {
  const char* text = std::getenv(name);
  if (text == nullptr) return;
  const auto v = parse_u64(text);
  if (!v || *v > max) {
    log::warn("{}={} is not an integer in [0, {}]; ignored", name, text, max);
    return;
  }
  out = static_cast<T>(*v);
}

}  // namespace

GuardBandConfig GuardBandConfig::from_env() {
  GuardBandConfig c;
  read_env("METRALE_REDZONE", c.pad_bytes, std::uint64_t{1} << 30);
  read_env("METRALE_REDZONE_MIN_IDX", c.min_index, ~std::uint64_t{0});
  read_env("METRALE_REDZONE_FILL", c.fill, 255);
  return c;
}

std::string GuardViolation::describe() const {
  return fmt::format(
      "guard band of allocation #{} (0x{:x}, {} bytes, pad {}) overwritten: {} byte(s) changed "
      "at pad offsets {}..{}, first value 0x{:02x} (expected 0x{:02x})",
      band.index, band.ptr.address(), band.user_bytes, band.pad_bytes, changed, first_offset,
      last_offset, first_value, band.fill);
}

std::optional<GuardViolation> check_guard_band(const GuardBand& band,
                                               std::span<const std::uint8_t> pad) {
  GuardViolation v{band};
  for (std::size_t i = 0; i < pad.size(); ++i) {
    if (pad[i] == band.fill) continue;
    if (v.changed == 0) {
      v.first_offset = i;
      v.first_value = pad[i];
    }
    v.last_offset = i;
    ++v.changed;
  }
  if (v.changed == 0) return std::nullopt;
  return v;
}

void GuardBands::configure(const GuardBandConfig& config) {
  std::lock_guard lock(mu_);
  config_ = config;
}

GuardBands::Plan GuardBands::plan_next() {
  std::lock_guard lock(mu_);
  Plan p;
  p.index = next_index_++;
  p.fill = config_.fill;
  if (config_.pad_bytes > 0 && p.index >= config_.min_index) {
    p.pad_bytes = (config_.pad_bytes + 15) / 16 * 16;
  }
  return p;
}

void GuardBands::add(DevicePtr ptr, std::size_t user_bytes, const Plan& plan) {
  if (plan.pad_bytes == 0) return;
  std::lock_guard lock(mu_);
  bands_[ptr.address()] = GuardBand{ptr, plan.index, user_bytes, plan.pad_bytes, plan.fill};
}

bool GuardBands::remove(DevicePtr ptr) {
  std::lock_guard lock(mu_);
  return bands_.erase(ptr.address()) > 0;
}

void GuardBands::set_fill(DevicePtr ptr, std::uint8_t fill) {
  std::lock_guard lock(mu_);
  const auto it = bands_.find(ptr.address());
  if (it != bands_.end()) it->second.fill = fill;
}

std::vector<GuardBand> GuardBands::bands() const {
  std::vector<GuardBand> out;
  {
    std::lock_guard lock(mu_);
    out.reserve(bands_.size());
    for (const auto& [_, b] : bands_) out.push_back(b);
  }
  std::sort(out.begin(), out.end(),
            [](const GuardBand& a, const GuardBand& b) { return a.index < b.index; });
  return out;
}

void GuardBands::visit(const std::function<void(GuardBand&)>& visit) {
  std::lock_guard lock(mu_);
  std::vector<GuardBand*> order;
  order.reserve(bands_.size());
  for (auto& [_, b] : bands_) order.push_back(&b);
  std::sort(order.begin(), order.end(),
            [](const GuardBand* a, const GuardBand* b) { return a->index < b->index; });
  for (GuardBand* b : order) visit(*b);
}

}  // namespace metrale
