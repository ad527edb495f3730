// A small reader of cuobjdump's SASS listings for the offline tests: one function's
// instructions, its loops, the innermost loops that run tensor-core MMAs, and instruction
// counts over a loop's body and over its steady-state path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace metrale::offline::sass {

struct Instr {
  std::uint64_t addr = 0;
  std::string guard;     // "@P0", "@!P2", ... or empty
  std::string opcode;    // with its modifiers: "HMMA.16816.F32.BF16"
  std::string mnemonic;  // the opcode before its first '.': "HMMA"
  std::string operands;  // the rest, up to the ';'
};

// The instructions of `function` in a `cuobjdump -sass` listing, in address order; empty when the
// listing has no such function.
std::vector<Instr> parse_function(const std::string& listing, const std::string& function);

// Whether `i` is a BRA.
bool is_branch(const Instr& i);
// Whether `i` may also fall through: guarded (not @PT), with a predicate operand
// (BRA P1, 0x270), or a .DIV/.CONV/.U form.
bool is_conditional(const Instr& i);

// The target address of a BRA (its last 0x literal); throws std::runtime_error without one.
std::uint64_t branch_target(const Instr& i);

// A loop: the instructions [head, latch] of the function, where latch is the last BRA back to
// head. Indices into the function's instruction vector.
struct Loop {
  std::size_t head = 0;
  std::size_t latch = 0;
};

// Every loop of the function, one per head address, in head order.
std::vector<Loop> loops_of(const std::vector<Instr>& code);

// The loops whose body holds an HMMA, HGMMA or QGMMA and that hold no other such loop: the MMA
// steady states. A loop that crosses another such loop (starts inside it, ends past it: an
// out-of-line retry path jumping back in) is not one.
std::vector<Loop> innermost_mma_loops(const std::vector<Instr>& code);

// Whether the opcode issues to the integer ALU pipe (the list and its reasons are in sass.cpp).
bool integer_pipe(const std::string& mnemonic);

// What a run of instructions holds.
struct Tally {
  int instrs = 0;    // every instruction, NOPs and branches included: all of them issue
  int hmma = 0;      // HMMA (mma.sync)
  int hgmma = 0;     // HGMMA (wgmma BF16)
  int qgmma = 0;     // QGMMA (wgmma E4M3)
  int bf16_mul = 0;  // BF16x2 multiplies: HMUL2.BF16*, or HFMA2.BF16* with a -RZ addend
  int bf16_sub = 0;  // BF16x2 subtractions of a register: HADD2.BF16* whose second operand is -R..
  int integer = 0;   // integer_pipe()
  int imad = 0;      // IMAD* and IMUL (the FMA pipe)
  int isetp = 0;     // ISETP
  int predicated = 0;  // guarded by a predicate (@P..)
  int branches = 0;    // BRA, the loop branch included
  int calls = 0;       // CALL: the callee's instructions are not counted
  int local = 0;       // LDL, STL
  int load_bytes = 0;  // bytes a lane loads from global or shared memory (16 where unknown)
  std::map<std::string, int> by_mnemonic;

  // Counts one more instruction.
  void add(const Instr& i);
};

// Counts over the whole body [head, latch], every path at once.
Tally tally_body(const std::vector<Instr>& code, const Loop& loop);

// How loop_path chooses among the paths through a loop's body.
enum class PathChoice {
  // The steady state: no conditional branch over an if-then that loads or multiplies (those
  // are skipped only when the work is done, such as a prefetch past the last K block), then the
  // most HMMAs (every MMA step runs), the fewest calls (a call is a slow path, such as a 64-bit
  // division), and the fewest instructions (of an if-else's arms, interior steps take the one
  // without the bounds checks).
  kSteady,
  // The steady state of a loop whose iterations cross tiles (a persistent kernel's producer): as
  // kSteady, but an if-then whose loads are all under 16 bytes may be skipped. Such a branch is a
  // tile's lookups (gemm_grouped_fused's expert and rows, from shared memory and the counts),
  // which run once per tile of many stages, not per stage; the data moves 16 bytes at a time.
  kSteadyAcrossTiles,
  // A lower bound: the most HMMAs, then the fewest instructions, whatever it skips.
  kShortest,
};

// The instructions (indices into code) of one iteration: from the head to a taken branch back
// to it, through the forward edges inside the body. Inner loops without HMMA run once. Throws
// std::runtime_error where no path closes the iteration.
std::vector<std::size_t> loop_path(const std::vector<Instr>& code, const Loop& loop,
                                   PathChoice choice);

// Counts along a path of loop_path.
Tally tally_path(const std::vector<Instr>& code, const std::vector<std::size_t>& path);

}  // namespace metrale::offline::sass
