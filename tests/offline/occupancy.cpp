#include "occupancy.h"

#include <algorithm>
#include <cstdlib>

namespace metrale::offline {
namespace {

// Per SM: resident threads and blocks, 64 K registers, the largest shared-memory carveout and the
// most a block may opt in to (the carveout less the driver's 1 KiB reserve). From the CUDA C++
// Programming Guide, "Compute Capabilities", technical specifications per compute capability
// (https://docs.nvidia.com/cuda/cuda-programming-guide/05-appendices/compute-capabilities.html):
// 8.0 2048 threads, 32 blocks, 164 KB (163 KB a block); 8.6 1536, 16, 100 KB (99 KB); 8.9 1536,
// 24, 100 KB (99 KB); 9.0 2048, 32, 228 KB (227 KB). NVIDIA's libcu++ (cuda/__device/
// arch_traits.h) and the toolkit's cuda_occupancy.h (the block counts) give the same numbers.
constexpr SmLimits kSms[] = {
    {"sm_80", 2048, 32, 65536, 164 * 1024, 163 * 1024},
    {"sm_86", 1536, 16, 65536, 100 * 1024, 99 * 1024},
    {"sm_89", 1536, 24, 65536, 100 * 1024, 99 * 1024},
    {"sm_90a", 2048, 32, 65536, 228 * 1024, 227 * 1024},
};

// How the hardware hands them out, as the toolkit's cuda_occupancy.h computes it for compute
// capability 8.x and 9.x: registers go to warps, each warp's rounded up to 256, from four
// sub-partitions of a quarter of the file each; shared memory goes in units of 128 bytes, and
// the driver reserves 1 KiB more of it for every block (added to the function's static size:
// on sm_90a cuobjdump's SHARED already holds 1 KiB for a kernel that declares none, so this
// counts it twice, as NVIDIA's calculator does, and can only under-count what fits).
constexpr long kWarp = 32, kRegisterUnit = 256, kSubPartitions = 4;
constexpr long kSharedUnit = 128, kReservedShared = 1024;

long round_up(long v, long unit) {
  return (v + unit - 1) / unit * unit;
}

}  // namespace

const SmLimits* sm_limits(std::string_view target) {
  for (const SmLimits& s : kSms) {
    if (s.target == target) return &s;
  }
  return nullptr;
}

Fit blocks_that_fit(const SmLimits& sm, const BlockResources& block) {
  Fit fit{sm.blocks, "blocks"};
  const auto take = [&fit](long blocks, const char* limit) {
    if (blocks < fit.blocks) fit = Fit{std::max(blocks, 0L), limit};
  };
  const long warps = (block.threads + kWarp - 1) / kWarp;
  if (warps < 1) return Fit{0, "threads"};
  take(sm.threads / kWarp / warps, "threads");
  if (block.registers_per_thread > 0) {
    const long per_warp = round_up(block.registers_per_thread * kWarp, kRegisterUnit);
    // A block must fit the register file as if its warps were spread evenly over the
    // sub-partitions; then each sub-partition holds whole warps.
    const bool one_fits = per_warp * round_up(warps, kSubPartitions) <= sm.registers;
    take(one_fits ? sm.registers / kSubPartitions / per_warp * kSubPartitions / warps : 0,
         "registers");
  }
  const long shared =
      round_up(block.static_shared + block.dynamic_shared + kReservedShared, kSharedUnit);
  take(shared > sm.shared_per_block + kReservedShared ? 0 : sm.shared / shared, "shared memory");
  return fit;
}

ResUsage parse_res_usage(const std::string& text) {
  ResUsage out;
  std::string target, function;
  bool elf = false;
  std::size_t pos = 0;
  while (pos < text.size()) {
    const std::size_t eol = std::min(text.find('\n', pos), text.size());
    const std::string line = text.substr(pos, eol - pos);
    pos = eol + 1;
    if (line.starts_with("Fatbin ")) {
      elf = line.starts_with("Fatbin elf code");
      target.clear();
    } else if (line.starts_with("arch = ")) {
      target = line.substr(7);
    } else if (elf && line.starts_with(" Function ") && line.ends_with(":")) {
      function = line.substr(10, line.size() - 11);
    } else if (elf && !function.empty() && line.find("REG:") != std::string::npos) {
      auto& usage = out[target][function];
      std::size_t p = 0;
      while ((p = line.find_first_not_of(' ', p)) != std::string::npos) {
        const std::size_t end = std::min(line.find(' ', p), line.size());
        const std::string kv = line.substr(p, end - p);
        if (const auto colon = kv.rfind(':'); colon != std::string::npos) {
          usage[kv.substr(0, colon)] = std::strtol(kv.c_str() + colon + 1, nullptr, 10);
        }
        p = end;
      }
      function.clear();
    }
  }
  return out;
}

}  // namespace metrale::offline
