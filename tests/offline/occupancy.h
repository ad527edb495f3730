// How many blocks of a kernel one SM holds, worked out offline from its cubin's resources: each
// target's per-SM limits, the rules by which the hardware hands registers and shared memory to
// blocks, and the reader of `cuobjdump -res-usage`. fatbin_test.cpp checks every published
// <entry>_blocks_per_sm with it.
#pragma once

#include <map>
#include <string>
#include <string_view>

namespace metrale::offline {

// One target's SM, as the CUDA C++ Programming Guide's "Compute Capabilities" tables give it.
struct SmLimits {
  std::string_view target;  // "sm_80", as cuobjdump names the cubin's arch
  long threads;             // resident threads
  long blocks;              // resident blocks
  long registers;           // 32-bit registers
  long shared;              // shared memory, the largest carveout (bytes)
  long shared_per_block;    // the most one block may opt in to (bytes)
};

// The limits of `target`, or nullptr for a target this table does not know.
const SmLimits* sm_limits(std::string_view target);

// What one block of a kernel takes.
struct BlockResources {
  long registers_per_thread = 0;  // REG of -res-usage
  long static_shared = 0;         // SHARED of -res-usage
  long dynamic_shared = 0;        // the launch's dynamic shared memory (its published smem_bytes)
  long threads = 0;               // the launch's block (its published block_threads)
};

// The blocks that fit on one SM, and which limit holds them there.
struct Fit {
  long blocks = 0;
  std::string limited_by;  // "threads", "blocks", "registers", "shared memory"
};

// The least number of blocks that the threads, the block slots, the registers and the shared
// memory of an SM of `sm` each allow (0 when one block alone is past a limit).
Fit blocks_that_fit(const SmLimits& sm, const BlockResources& block);

// `cuobjdump -res-usage` output as target -> function -> key -> value (REG, SHARED, STACK, ...).
// Only the machine-code sections ("Fatbin elf code:", then "arch = sm_XX") have usage lines.
using ResUsage = std::map<std::string, std::map<std::string, std::map<std::string, long>>>;
ResUsage parse_res_usage(const std::string& text);

}  // namespace metrale::offline
