// Guard bands (docs/CONTRACT.md, guard bands): an opt-in pad after each allocation, filled with a
// known byte, that a scan reads back to catch kernels writing past the end. Poisoning pads with
// different bytes per allocation bisects out-of-bounds reads. This class keeps the bookkeeping
// only; the backend reads and fills the device bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "metrale/handles.h"

namespace metrale {

inline constexpr std::uint8_t kGuardFill = 0xEE;  // the default pad byte and the poison byte

// The policy: pad size (0 = off), first allocation index that gets a pad, fill byte.
struct GuardBandConfig {
  std::size_t pad_bytes = 0;
  std::uint64_t min_index = 0;
  std::uint8_t fill = kGuardFill;
  // Reads METRALE_REDZONE (bytes), METRALE_REDZONE_MIN_IDX and METRALE_REDZONE_FILL (0..255,
  // decimal or 0x hex); unset or unparsable values keep the defaults (a warning names them).
  static GuardBandConfig from_env();
};

// One pad after one allocation.
struct GuardBand {
  DevicePtr ptr;               // start of the allocation (the pad begins at ptr + user_bytes)
  std::uint64_t index = 0;     // creation index of the allocation
  std::size_t user_bytes = 0;  // what the caller asked for
  std::size_t pad_bytes = 0;
  std::uint8_t fill = kGuardFill;  // the byte the pad must hold now
  // Where the pad starts.
  DevicePtr pad() const noexcept { return ptr.offset(user_bytes); }
};

// What a scan found in one violated pad.
struct GuardViolation {
  GuardBand band;
  std::size_t first_offset = 0;  // offsets into the pad
  std::size_t last_offset = 0;
  std::size_t changed = 0;       // bytes that differ from the fill
  std::uint8_t first_value = 0;  // the byte found at first_offset
  // One log line describing the violation.
  std::string describe() const;
};

// Compares pad bytes with the band's fill; nullopt when intact.
std::optional<GuardViolation> check_guard_band(const GuardBand& band,
                                               std::span<const std::uint8_t> pad);

// Thread-safe registry of live bands and the allocation counter.
class GuardBands {
 public:
  GuardBands() : config_(GuardBandConfig::from_env()) {}
  // Replaces the policy for later allocations; existing bands keep their pads.
  void configure(const GuardBandConfig& config);
  // The next allocation's index and the pad it gets (rounded up to 16; 0 when off).
  struct Plan {
    std::uint64_t index = 0;
    std::size_t pad_bytes = 0;
    std::uint8_t fill = kGuardFill;
  };
  Plan plan_next();
  // Registers the pad of a successful allocation (no-op when plan.pad_bytes is 0).
  void add(DevicePtr ptr, std::size_t user_bytes, const Plan& plan);
  // Forgets ptr's band; returns whether it had one.
  bool remove(DevicePtr ptr);
  // Sets the expected fill of ptr's band.
  void set_fill(DevicePtr ptr, std::uint8_t fill);
  // A copy of the live bands, by creation index.
  std::vector<GuardBand> bands() const;
  // Calls visit(band) for each live band by creation index while holding the registry's lock,
  // so no band's allocation can be freed meanwhile (free forgets the band before the raw free,
  // and that waits for the lock). visit may change band.fill; it must not call back in here.
  void visit(const std::function<void(GuardBand&)>& visit);

 private:
  mutable std::mutex mu_;
  GuardBandConfig config_;
  std::uint64_t next_index_ = 0;
  std::unordered_map<std::uint64_t, GuardBand> bands_;
};

}  // namespace metrale
