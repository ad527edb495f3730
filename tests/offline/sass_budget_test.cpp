// The decode kernel's instruction budget, proven on its sm_90a SASS without a GPU: each
// innermost loop that runs HMMAs (the steady state of one M variant and layout) issues at most
// 3 instructions, at most 1.25 of them on the integer pipe, per weight per lane, and the kernel
// touches no local memory. The reader's own cases run on small hand-written listings
// (sass_test.cpp).
//
// The counts are taken along each loop's steady path (sass.h, PathChoice::kSteady: interior
// steps, prefetches issued, no boundary arm); the whole body and the shortest path are printed
// beside them. The integer pipe's opcodes are listed in sass.cpp (integer_pipe).
//
// Weights per lane: every weight passes through exactly one BF16 multiply by its block scale,
// and one HMUL2 (BF16x2) scales 2 weights of a lane, so a loop iteration's weights per lane are
// 2 x its HMUL2s. Cross-check: an m16n8k16 HMMA consumes 8 weights per lane (16 x 16 / 32), once
// per n8 activation tile, so HMMAs x 8 = weights x (1 for M <= 8, 2 for M <= 16).
//
// METRALE_SASS_BUDGET_KERNEL=gemm_decode runs the budget case on another entry (today's decode
// kernel, which is over budget). Spills are cuda.fatbin_offline's (STACK and LOCAL of every
// entry on every target); here the kernel's SASS itself is searched for LDL/STL.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "sass.h"
#include "shell.h"

namespace {

namespace fs = std::filesystem;
namespace sass = metrale::offline::sass;

constexpr double kIssuedPerWeight = 3.0;
constexpr double kIntegerPerWeight = 1.25;
const std::string kTarget = "sm_90a";
const std::string kDefaultKernel = "gemm_decode_packed";

// ---- running cuobjdump ----

using metrale::offline::quoted;
using metrale::offline::Ran;
using metrale::offline::run;

// cuobjdump with `args` on `fatbin` (the w4a16 module's by default).
Ran cuobjdump(const std::string& args, const std::string& fatbin = METRALE_W4A16_FATBIN) {
  return run(metrale::offline::cuobjdump_command(METRALE_CUOBJDUMP, METRALE_NVDISASM, args) + " " +
             quoted(fatbin));
}

// ---- one kernel's loops ----

struct LoopReport {
  std::uint64_t begin = 0, end = 0;  // addresses of the head and of the loop branch
  sass::Tally body, path, shortest;
  int weights = 0;  // per lane per iteration, from the path's BF16 multiplies

  // count per weight per lane.
  double per_weight(int count) const { return weights == 0 ? 0.0 : double(count) / weights; }
  // Whether the steady path is over either budget (the decode kernels' by default).
  bool over_budget(double issued = kIssuedPerWeight, double integer = kIntegerPerWeight) const {
    return per_weight(path.instrs) > issued || per_weight(path.integer) > integer;
  }
};

struct KernelReport {
  bool found = false;
  int registers = -1;
  sass::Tally whole;  // the function, every instruction once
  std::vector<LoopReport> loops;
};

// The registers cuobjdump -res-usage gives the function on kTarget, or -1.
int registers_of(const std::string& kernel) {
  const Ran r = cuobjdump("-res-usage -arch " + kTarget + " -fun " + kernel);
  const std::size_t at = r.output.find("Function " + kernel + ":");
  const std::size_t reg = at == std::string::npos ? at : r.output.find("REG:", at);
  return reg == std::string::npos ? -1 : std::atoi(r.output.c_str() + reg + 4);
}

// How a loop's weights per lane are counted: FP4 kernels scale each pair of weights with one BF16
// multiply; the INT4 kernel subtracts each pair's zero with one BF16 subtraction.
enum class WeightsBy { kBf16Mul, kBf16Sub };

// The kernel's SASS on kTarget, its registers and its innermost HMMA loops, counted; found is
// false where the cubin has no such function. Throws std::runtime_error where cuobjdump fails.
KernelReport analyze(const std::string& kernel, WeightsBy by = WeightsBy::kBf16Mul) {
  KernelReport k;
  const Ran r = cuobjdump("-sass -arch " + kTarget + " -fun " + kernel);
  if (r.status != 0) throw std::runtime_error("cuobjdump -sass failed:\n" + r.output);
  const std::vector<sass::Instr> code = sass::parse_function(r.output, kernel);
  k.found = !code.empty();
  if (!k.found) return k;
  for (const auto& i : code) k.whole.add(i);
  k.registers = registers_of(kernel);
  for (const auto& l : sass::innermost_mma_loops(code)) {
    LoopReport lr;
    lr.begin = code[l.head].addr;
    lr.end = code[l.latch].addr;
    lr.body = sass::tally_body(code, l);
    lr.path = sass::tally_path(code, sass::loop_path(code, l, sass::PathChoice::kSteady));
    lr.shortest = sass::tally_path(code, sass::loop_path(code, l, sass::PathChoice::kShortest));
    lr.weights = 2 * (by == WeightsBy::kBf16Mul ? lr.path.bf16_mul : lr.path.bf16_sub);
    k.loops.push_back(std::move(lr));
  }
  return k;
}

// The integer-pipe opcodes of a tally, most frequent first: "LOP3 x120, PRMT x96, ...".
std::string integer_mix(const sass::Tally& t) {
  std::vector<std::pair<int, std::string>> v;
  for (const auto& [m, n] : t.by_mnemonic) {
    if (sass::integer_pipe(m)) v.emplace_back(-n, m);
  }
  std::sort(v.begin(), v.end());
  std::string out;
  for (const auto& [n, m] : v) out += fmt::format("{}{} x{}", out.empty() ? "" : ", ", m, -n);
  return out.empty() ? "none" : out;
}

// The report's figures on stdout (they reach the ctest log).
void print(const std::string& kernel, const KernelReport& k, double issued = kIssuedPerWeight,
           double integer = kIntegerPerWeight) {
  std::printf("%s %s: %d registers, %d instructions, %zu innermost HMMA loop(s)\n", kTarget.c_str(),
              kernel.c_str(), k.registers, k.whole.instrs, k.loops.size());
  for (const auto& l : k.loops) {
    const int per_tile = l.weights == 0 ? 0 : l.path.hmma * 8 / l.weights;
    std::printf(
        "  loop %#lx-%#lx: steady path %d of %d body instructions; %d HMMA, %d BF16x2 multiplies"
        " -> %d weights/lane (HMMA x 8 / %d n8 tile(s) = %d)\n"
        "    per weight per lane: issued %.2f (body %.2f, shortest %.2f), integer pipe %.2f (body "
        "%.2f, shortest %.2f), IMAD %.2f"
        "  [budget %.2f issued, %.2f integer]%s\n"
        "    path: ISETP %d, predicated %d, branches %d, calls %d, loaded %d B/lane; body: ISETP "
        "%d, predicated %d, calls %d\n"
        "    integer pipe on the path: %s\n",
        static_cast<unsigned long>(l.begin), static_cast<unsigned long>(l.end), l.path.instrs,
        l.body.instrs, l.path.hmma, l.path.bf16_mul, l.weights, per_tile,
        per_tile == 0 ? 0 : l.path.hmma * 8 / per_tile, l.per_weight(l.path.instrs),
        l.per_weight(l.body.instrs), l.per_weight(l.shortest.instrs), l.per_weight(l.path.integer),
        l.per_weight(l.body.integer), l.per_weight(l.shortest.integer), l.per_weight(l.path.imad),
        issued, integer, l.over_budget(issued, integer) ? "  OVER BUDGET" : "", l.path.isetp,
        l.path.predicated, l.path.branches, l.path.calls, l.path.load_bytes, l.body.isetp,
        l.body.predicated, l.body.calls, integer_mix(l.path).c_str());
  }
  std::fflush(stdout);
}

// Each loop's weights agree with its HMMAs (8 weights per lane per HMMA and n8 tile, 1 or 2
// tiles: M <= 8 or M <= 16), and its steady path loads at least the weights' codes (half a
// byte each), so the counts cover the weight stream.
void expect_consistent(const LoopReport& l) {
  EXPECT_GT(l.weights, 0) << fmt::format("loop {:#x}: no BF16 multiply or subtraction on its path",
                                         l.begin);
  if (l.weights == 0) return;
  const int product = l.path.hmma * 8;
  EXPECT_TRUE(product == l.weights || product == 2 * l.weights) << fmt::format(
      "loop {:#x}: {} HMMA x 8 = {} is neither 1 nor 2 x the {} weights/lane that "
      "its {} BF16x2 multiplies or subtractions count",
      l.begin, l.path.hmma, product, l.weights, l.weights / 2);
  EXPECT_GE(2 * l.path.load_bytes, l.weights) << fmt::format(
      "loop {:#x}: the steady path loads {} B/lane, less than the codes of its {} "
      "weights/lane: it skips the weight loads",
      l.begin, l.path.load_bytes, l.weights);
}

class SassBudget : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string missing =
        metrale::offline::missing_disassemblers(METRALE_CUOBJDUMP, METRALE_NVDISASM);
    if (!missing.empty()) FAIL() << missing;
    ASSERT_TRUE(fs::exists(METRALE_W4A16_FATBIN))
        << METRALE_W4A16_FATBIN << " is missing: build the metrale target";
  }
};

// Every innermost MMA loop of k within the decode budget on its steady path, consistent, with no
// call on it; k touches no local memory.
void expect_within_budget(const std::string& kernel, const KernelReport& k) {
  EXPECT_EQ(k.whole.local, 0) << kernel << " reads or writes local memory (LDL/STL)";
  ASSERT_FALSE(k.loops.empty()) << kernel << " has no loop that runs HMMAs";
  for (const auto& l : k.loops) {
    SCOPED_TRACE(fmt::format("{} loop {:#x}-{:#x}", kernel, l.begin, l.end));
    expect_consistent(l);
    if (l.weights == 0) continue;
    EXPECT_LE(l.per_weight(l.path.instrs), kIssuedPerWeight)
        << fmt::format("issued {} instructions for {} weights/lane", l.path.instrs, l.weights);
    EXPECT_LE(l.per_weight(l.path.integer), kIntegerPerWeight)
        << fmt::format("{} integer-pipe instructions for {} weights/lane ({})", l.path.integer,
                       l.weights, integer_mix(l.path));
    EXPECT_EQ(l.path.calls, 0) << "a call on the steady path: its instructions are not counted";
  }
}

// The decode kernel's steady state stays within the per-weight budget on every MMA loop.
TEST_F(SassBudget, DecodeLoopsMeetTheBudget) {
  const char* env = std::getenv("METRALE_SASS_BUDGET_KERNEL");
  const std::string kernel = env != nullptr && *env != '\0' ? env : kDefaultKernel;
  const KernelReport k = analyze(kernel);
  ASSERT_TRUE(k.found) << kernel << " not in the cubin (" << kTarget << " of "
                       << METRALE_W4A16_FATBIN << ")";
  print(kernel, k);
  expect_within_budget(kernel, k);
}

// The reader sees today's decode kernel as it is: four MMA loops (M <= 8 and M <= 16, row-major
// and transposed), each consistent and each over budget. A reader that lost instructions or
// loops would pass any kernel; this case keeps it honest.
TEST_F(SassBudget, TodaysDecodeIsOverBudget) {
  const KernelReport k = analyze("gemm_decode");
  // Not a skip: without an over-budget kernel to read, nothing shows the reader can fail.
  ASSERT_TRUE(k.found) << "gemm_decode is not in the cubin (" << kTarget
                       << "): point this case at another kernel that is over budget";
  print("gemm_decode", k);
  EXPECT_EQ(k.loops.size(), 4u) << "gemm_decode: 2 layouts x 2 M variants";
  for (const auto& l : k.loops) {
    SCOPED_TRACE(fmt::format("gemm_decode loop {:#x}-{:#x}", l.begin, l.end));
    expect_consistent(l);
    EXPECT_TRUE(l.over_budget());
  }
}

// ---- gemm_int4_decode ----

// The INT4 decode kernel (decode_int4.cuh) within the decode budget on each of its 8 MMA loops
// (M <= 8 and M <= 16, FP16 and BF16 scales, a scale per K block or per 32-K span): every weight
// pair passes through exactly one BF16 subtraction of its zero pair (HADD2.BF16 Rd, Ra, -Rb), so
// a loop's weights per lane are 2 x those, and its HMMAs must agree (8 weights per lane per HMMA
// and n8 tile). It touches no local memory.
TEST_F(SassBudget, Int4DecodeLoopsMeetTheBudget) {
  const std::string kernel = "gemm_int4_decode";
  const KernelReport k = analyze(kernel, WeightsBy::kBf16Sub);
  ASSERT_TRUE(k.found) << kernel << " not in the cubin (" << kTarget << ")";
  print(kernel, k);
  EXPECT_EQ(k.loops.size(), 8u) << "2 M variants x 2 scale formats x 2 scale spans";
  expect_within_budget(kernel, k);
}

// ---- the grouped GEMMs ----

// Each grouped kernel (grouped.cuh: the expert's arguments in shared memory, then the decode
// kernel of its layout) has its dense kernel's MMA loops. The two on the decode layouts, the fast
// path on Hopper (what kBackendPreferred uploads once verified), are within the decode budget and
// within 1% of their dense kernels' steady paths (measured: packed equal, int4 918 against 914).
// gemm_grouped on the source layout issues 1.10x gemm_decode's on its two longest loops (1875 and
// 2093 against 1710 and 1893 at sm_90a; gemm_decode is itself over budget): recorded here at
// 1.12x so that a change which makes it worse fails, not folded into the budget.
TEST_F(SassBudget, GroupedLoopsAreTheirDenseKernels) {
  const struct {
    const char *grouped, *dense;
    WeightsBy by;
    double allowed;  // grouped / dense issued instructions on a loop's steady path
    bool budget;
  } pairs[] = {{"gemm_grouped_packed", "gemm_decode_packed", WeightsBy::kBf16Mul, 1.01, true},
               {"gemm_grouped_int4_decode", "gemm_int4_decode", WeightsBy::kBf16Sub, 1.01, true},
               {"gemm_grouped", "gemm_decode", WeightsBy::kBf16Mul, 1.12, false}};
  for (const auto& pair : pairs) {
    SCOPED_TRACE(pair.grouped);
    const KernelReport g = analyze(pair.grouped, pair.by), d = analyze(pair.dense, pair.by);
    ASSERT_TRUE(g.found && d.found);
    print(pair.grouped, g);
    ASSERT_EQ(g.loops.size(), d.loops.size());
    std::vector<std::size_t> gi, di;
    for (const auto& l : g.loops) gi.push_back(l.path.instrs);
    for (const auto& l : d.loops) di.push_back(l.path.instrs);
    std::sort(gi.begin(), gi.end());
    std::sort(di.begin(), di.end());
    for (std::size_t i = 0; i < gi.size(); ++i) {
      EXPECT_LE(static_cast<double>(gi[i]), pair.allowed * static_cast<double>(di[i]))
          << "loop " << i << " (by length): " << gi[i] << " issued against the dense " << di[i];
    }
    // The same work: each loop's HMMAs and weights per lane those of a dense loop (sorted;
    // ptxas lays the loops out, and schedules them, a little differently: some grouped loops run
    // shorter than their dense twins, others longer).
    std::vector<std::pair<int, int>> gw, dw;
    for (const auto& l : g.loops) gw.emplace_back(l.path.hmma, l.weights);
    for (const auto& l : d.loops) dw.emplace_back(l.path.hmma, l.weights);
    std::sort(gw.begin(), gw.end());
    std::sort(dw.begin(), dw.end());
    EXPECT_EQ(gw, dw) << "HMMAs and weights per lane of the loops differ from the dense kernel's";
    EXPECT_EQ(g.whole.local, 0) << pair.grouped << " reads or writes local memory";
    if (pair.budget) expect_within_budget(pair.grouped, g);
  }
}

// ---- gemm_fused: wgmma with the weights as the register operand ----

// gemm_fused's budgets (the arithmetic: docs/PERF.md, "gemm_fused's issue budget"). It is
// compute-bound, so the limit is the issue slots its warps may take beside the tensor cores, not
// DRAM: one HGMMA m64n128k16 is 64 x 128 x 16 MACs, 64 cycles of an H100/H200 SM at its dense
// BF16 rate (2048 MACs per cycle: 989 TFLOP/s over 132 SMs at 1.83 GHz), so a stage (128 K: 8
// HGMMAs of each consumer warpgroup) keeps the tensor cores busy 1024 cycles, in which each of
// the SM's four schedulers issues at most 1024 instructions for its three warps: one of each
// consumer warpgroup (64 weights a lane a stage) and one of the producer (128 activations a lane
// a stage). Consumers at 4 per weight and the producer at 2 per activation take 2 x 256 + 256 =
// 768 of the 1024 (75%), the rest left to the turns' waits, the bulk copies' issue (lane 0 of
// each producer warp), the epilogue and stalls; integer work (16 INT32 lanes a scheduler: 2
// cycles a warp instruction) at 2 per weight and 0.5 per activation takes 2 x 256 + 128 = 640
// of the 1024 cycles' integer issue.
constexpr double kFusedIssuedPerWeight = 4.0;
constexpr double kFusedIntegerPerWeight = 2.0;
// gemm_grouped_int4_fused's loops on FP16 scales (Note [grouped fused INT4]): rounding (q - z)
// times an FP16 scale once takes the scale in two BF16 parts and one BF16 FMA more per register
// (0.5 a weight), and splitting a block's scales costs 8 instructions per two (at most 8 scales a
// lane a block, groups of 32 and 64: 0.5 a weight). The issue ceiling is 8 a weight; consumers at
// 5 and the producer at its measured 1.56 take 2 x 320 + 200 = 840 of the 1024 slots (82%; 75%
// at the BF16 budget). Their integer budget is gemm_fused's. (The analyzer's own report above the
// loops prints them against gemm_fused's 4.0.)
constexpr double kFusedInt4F16Extra = 1.0;
constexpr double kProducerIssuedPerElement = 2.0;
constexpr double kProducerIntegerPerElement = 0.5;

// The A operand of an HGMMA: its second operand, a register (R..) in the RS form, a descriptor
// (gdesc[..]) in the SS form.
std::string hgmma_a_operand(const sass::Instr& i) {
  const std::size_t first = i.operands.find(',');
  if (first == std::string::npos) return "";
  std::size_t b = first + 1;
  while (b < i.operands.size() && i.operands[b] == ' ') ++b;
  const std::size_t e = i.operands.find(',', b);
  return i.operands.substr(b, e == std::string::npos ? std::string::npos : e - b);
}

// Every HGMMA of the fused kernel takes A from registers, its wgmmas of one K block issue back
// to back (one scoreboard wait, gsb0, per 8: ptxas serializes each one when it finds registers
// of an in-flight wgmma written, C7513), it touches no local memory, and each MMA loop's steady
// state is counted per weight per lane (8 weights per lane per HGMMA m64n128k16: 64 x 16 / 128).
// `loops`: one per weight format the kernel's consumers read; `by`: how their weights are counted;
// `fma_extra`: the issue budget's addition for loops that round with an FMA (INT4 on FP16 scales).
void expect_fused_consumers(const std::string& kernel, WeightsBy by = WeightsBy::kBf16Mul,
                            std::size_t loops = 2, double fma_extra = 0.0);
void expect_fused_producer(const std::string& kernel, int loops = 2);

// gemm_grouped_fused is held to the same: it is gemm_fused's pipeline over the experts' tiles.
TEST_F(SassBudget, FusedTakesRegisterAAndIsCounted) {
  for (const std::string kernel : {"gemm_fused", "gemm_grouped_fused"}) {
    SCOPED_TRACE(kernel);
    expect_fused_consumers(kernel);
  }
}

// gemm_grouped_int4_fused too: the same pipeline on INT4 experts, four consumer loops (the two
// side shapes by the two scale formats; Note [grouped fused INT4]), each pair of weights counted
// by its zero points' one BF16 subtraction, and one producer loop (the shapes differ only in the
// side bytes its lane 0 copies).
TEST_F(SassBudget, FusedInt4TakesRegisterAAndIsCounted) {
  expect_fused_consumers("gemm_grouped_int4_fused", WeightsBy::kBf16Sub, 4, kFusedInt4F16Extra);
  expect_fused_producer("gemm_grouped_int4_fused", 1);
}

void expect_fused_consumers(const std::string& kernel, WeightsBy by, std::size_t loops,
                            double fma_extra) {
  const KernelReport k = analyze(kernel, by);
  ASSERT_TRUE(k.found) << kernel << " not in the cubin (" << kTarget << ")";
  print(kernel, k, kFusedIssuedPerWeight, kFusedIntegerPerWeight);
  const Ran r = cuobjdump("-sass -arch " + kTarget + " -fun " + kernel);
  const std::vector<sass::Instr> code = sass::parse_function(r.output, kernel);
  int hgmma = 0, waits = 0;
  for (const auto& i : code) {
    if (i.mnemonic != "HGMMA") continue;
    ++hgmma;
    waits += i.operands.find("gsb0") != std::string::npos ? 1 : 0;
    const std::string a = hgmma_a_operand(i);
    EXPECT_TRUE(a.size() > 1 && a[0] == 'R' && a.find("gdesc") == std::string::npos) << fmt::format(
        "HGMMA at {:#x} takes A as '{}', not a register: {} {}", i.addr, a, i.opcode, i.operands);
  }
  EXPECT_GT(hgmma, 0) << kernel << " runs no HGMMA";
  // The epilogue's C stores are 16 bytes where C's rows allow (the 2- and 4-byte ones are its
  // edge path): issue 35 found only 2-byte stores.
  int wide = 0;
  for (const auto& i : code)
    wide += i.mnemonic == "STG" && i.opcode.find(".128") != std::string::npos;
  EXPECT_GE(wide, 2) << "no 16-byte global store of C (one per C format: BF16, FP32)";
  EXPECT_EQ(waits * 8, hgmma) << "HGMMAs that wait on their own scoreboard: serialized wgmmas";
  EXPECT_EQ(k.whole.local, 0) << kernel << " reads or writes local memory (LDL/STL)";
  EXPECT_EQ(k.loops.size(), loops) << "one MMA loop per weight format (NVFP4, MXFP4; INT4's four)";
  int fma_loops = 0;
  for (const auto& l : k.loops) {
    SCOPED_TRACE(fmt::format("{} loop {:#x}-{:#x}", kernel, l.begin, l.end));
    EXPECT_EQ(l.path.hgmma, 8) << "one K block of 128: 8 wgmma k16 steps";
    EXPECT_EQ(l.weights, 8 * l.path.hgmma)
        << "every A register scaled once (HMUL2 x 2; INT4: its zero points subtracted once)";
    EXPECT_EQ(l.path.calls, 0);
    // A loop rounding with an FMA: one HFMA2 a register beside its multiply (HMUL2).
    const auto fma = l.path.by_mnemonic.find("HFMA2");
    const bool rounds_by_fma = fma_extra > 0 && fma != l.path.by_mnemonic.end() &&
                               fma->second == l.weights / 2 && l.path.bf16_mul == l.weights / 2;
    fma_loops += rounds_by_fma ? 1 : 0;
    const double issued_budget = kFusedIssuedPerWeight + (rounds_by_fma ? fma_extra : 0.0);
    std::printf(
        "  %s loop %#lx: %.3f issued, %.3f integer-pipe instructions per weight "
        "per consumer thread (%d for %d) [fused budget %.2f issued, %.2f integer]\n",
        kernel.c_str(), static_cast<unsigned long>(l.begin), l.per_weight(l.path.instrs),
        l.per_weight(l.path.integer), l.path.instrs, l.weights, issued_budget,
        kFusedIntegerPerWeight);
    EXPECT_LE(l.per_weight(l.path.instrs), issued_budget)
        << fmt::format("issued {} instructions for {} weights/lane", l.path.instrs, l.weights);
    EXPECT_LE(l.per_weight(l.path.integer), kFusedIntegerPerWeight)
        << fmt::format("{} integer-pipe instructions for {} weights/lane ({})", l.path.integer,
                       l.weights, integer_mix(l.path));
  }
  // INT4's two FP16 loops (one per side shape), and no other, take the FMA's allowance.
  if (fma_extra > 0) {
    EXPECT_EQ(fma_loops, 2) << "loops rounding FP16 scales' products by FMA";
  }
}

// The producer warpgroup's steady loop (two stages an iteration: its two register sets): each
// stage's 16 16-byte activation loads of a lane are issued before the previous stage's 16 stores,
// so two stages of loads (2 x 32 KiB a block) are in flight while one is stored, and the loop
// holds the producer budget per activation element per lane (16 bytes stored = 8 elements). The
// bulk copies' issue, which lane 0 of each warp alone runs (the others branch over it), is
// counted apart and printed: one decode tile's two copies a warp.
// gemm_grouped_fused's producer is held to the same; its per-tile work (the expert's weights and
// table, the tile for the consumers) lies outside the steady loop's path or is counted in it.
TEST_F(SassBudget, FusedProducerOverlapsItsLoadsAndIsCounted) {
  for (const std::string kernel : {"gemm_fused", "gemm_grouped_fused"}) {
    SCOPED_TRACE(kernel);
    expect_fused_producer(kernel);
  }
}

void expect_fused_producer(const std::string& kernel, int loops) {
  const Ran r = cuobjdump("-sass -arch " + kTarget + " -fun " + kernel);
  const std::vector<sass::Instr> code = sass::parse_function(r.output, kernel);
  ASSERT_FALSE(code.empty()) << kernel << " not in the cubin (" << kTarget << ")";
  const auto is_load = [](const sass::Instr& i) {
    return i.mnemonic == "LDG" && i.opcode.find(".128") != std::string::npos;
  };
  const auto is_store = [](const sass::Instr& i) { return i.opcode == "STS.128"; };
  std::map<std::uint64_t, std::size_t> index_of;
  for (std::size_t i = 0; i < code.size(); ++i) index_of[code[i].addr] = i;
  int found = 0;
  for (const sass::Loop& l : sass::loops_of(code)) {
    int loads = 0, stores = 0, hgmma = 0;
    for (std::size_t i = l.head; i <= l.latch; ++i) {
      loads += is_load(code[i]) ? 1 : 0;
      stores += is_store(code[i]) ? 1 : 0;
      hgmma += code[i].mnemonic == "HGMMA" ? 1 : 0;
    }
    // The loop of two stages (its body has both arms of each stage's loads: inside the matrix
    // and at its edges). An mbarrier wait's out-of-line retry, which branches back into the
    // middle of it, makes another loop that spans more and closes through the retry: no path.
    // The grouped kernel's producer also stores each tile's entry for the consumers (one 16-byte
    // store a stage's claim, on the branch of a tile's first stage: off the steady path).
    const int entries = kernel != "gemm_fused" ? 2 : 0;  // the grouped kernels'
    if (loads < 32 || stores != 32 + entries || hgmma != 0) continue;
    // The grouped producer's walk looks each new tile up (a binary search in shared memory, the
    // expert's counts): once per tile of K / 128 stages, so off the steady path
    // (sass::PathChoice::kSteadyAcrossTiles); the dense one's tile is arithmetic only.
    const sass::PathChoice choice =
        entries != 0 ? sass::PathChoice::kSteadyAcrossTiles : sass::PathChoice::kSteady;
    std::vector<std::size_t> path;
    try {
      path = sass::loop_path(code, l, choice);
    } catch (const std::runtime_error&) {
      continue;
    }
    ++found;
    SCOPED_TRACE(
        fmt::format("{} producer loop {:#x}-{:#x}", kernel, code[l.head].addr, code[l.latch].addr));
    // The ranges a forward branch skips that hold bulk copies and no activations: lane 0's.
    std::set<std::size_t> tma;
    for (const std::size_t i : path) {
      if (!sass::is_branch(code[i]) || !sass::is_conditional(code[i])) continue;
      const auto to = index_of.find(sass::branch_target(code[i]));
      if (to == index_of.end() || to->second <= i) continue;
      bool copies = false, activations = false;
      for (std::size_t j = i + 1; j < to->second; ++j) {
        copies |= code[j].mnemonic == "UBLKCP";
        activations |= is_load(code[j]) || is_store(code[j]);
      }
      for (std::size_t j = i + 1; copies && !activations && j < to->second; ++j) tma.insert(j);
    }
    sass::Tally t, lane0;
    std::string order;
    for (const std::size_t i : path) {
      (tma.count(i) != 0 ? lane0 : t).add(code[i]);
      if (is_load(code[i])) order += 'L';
      if (is_store(code[i])) order += 'S';
    }
    const std::string stage = std::string(16, 'L') + std::string(16, 'S');
    EXPECT_EQ(order, stage + stage) << "each stage's loads before the stores of the one before";
    const int elements = 8 * static_cast<int>(std::count(order.begin(), order.end(), 'S'));
    const double issued = double(t.instrs) / elements, integer = double(t.integer) / elements;
    std::printf(
        "  %s producer loop %#lx: %d instructions for %d activations a lane: %.3f issued, "
        "%.3f integer-pipe per element [budget %.2f, %.2f]; lane 0's bulk-copy issue %d more; "
        "in flight: 2 stages of 16 x 16 B a lane (64 KiB a block)\n",
        kernel.c_str(), static_cast<unsigned long>(code[l.head].addr), t.instrs, elements, issued,
        integer, kProducerIssuedPerElement, kProducerIntegerPerElement, lane0.instrs);
    EXPECT_GT(lane0.by_mnemonic["UBLKCP"], 0) << "the bulk copies were not found on the path";
    EXPECT_LE(issued, kProducerIssuedPerElement);
    EXPECT_LE(integer, kProducerIntegerPerElement) << integer_mix(t);
    EXPECT_EQ(t.local, 0);
  }
  EXPECT_EQ(found, loops) << "one producer loop per scale format (NVFP4, MXFP4; INT4's one)";
}

// ---- gemm_grouped_e4m3_block128_tiled: wgmma E4M3, both operands in shared memory ----

// The grouped W8A8 GEMM's prefill kernel (grouped_e4m3_sm90.cuh) streams one-byte weights, so at
// the 4.2 TB/s that the decode budget's 4.4 issued and 2.2 integer-pipe instructions per 4-bit
// weight a lane are sized for, it may issue twice as many per weight: 8.8 and 4.4. A stage (one
// 128-K block of a 128 x 128 tile) is 64 weights a lane over the block's 256 threads, whatever
// the rows of A beside them. Its steady loop: the stage's eight 16-byte cp.async copies (four of
// A, four of W), four QGMMA m64n128k32 with one scoreboard wait (unserialized), no call, and no
// local memory anywhere in the kernel.
constexpr double kTiledFp8IssuedPerWeight = 8.8;
constexpr double kTiledFp8IntegerPerWeight = 4.4;

// The sm_90a SASS of `kernel` in the fp8 module, with its whole-function tally in *whole; a
// failure of the test where cuobjdump fails, the cubin lacks the kernel, or it touches local
// memory.
void fp8_kernel_code(const std::string& kernel, std::vector<sass::Instr>* code,
                     sass::Tally* whole) {
  const Ran r = cuobjdump("-sass -arch " + kTarget + " -fun " + kernel, METRALE_FP8_FATBIN);
  ASSERT_EQ(r.status, 0) << r.output;
  *code = sass::parse_function(r.output, kernel);
  ASSERT_FALSE(code->empty()) << kernel << " not in the fp8 cubin (" << kTarget << ")";
  for (const auto& i : *code) whole->add(i);
  EXPECT_EQ(whole->local, 0) << kernel << " reads or writes local memory (LDL/STL)";
}

TEST_F(SassBudget, GroupedFp8TiledLoopIsCounted) {
  const std::string kernel = "gemm_grouped_e4m3_block128_tiled";
  std::vector<sass::Instr> code;
  sass::Tally whole;
  ASSERT_NO_FATAL_FAILURE(fp8_kernel_code(kernel, &code, &whole));
  const std::vector<sass::Loop> loops = sass::innermost_mma_loops(code);
  ASSERT_EQ(loops.size(), 1u) << "one K loop of QGMMAs";
  const sass::Loop& l = loops[0];
  const sass::Tally path =
      sass::tally_path(code, sass::loop_path(code, l, sass::PathChoice::kSteady));
  constexpr int kWeights = 128 * 128 / 256;  // a stage's weights a lane
  const double issued = static_cast<double>(path.instrs) / kWeights,
               integer = static_cast<double>(path.integer) / kWeights;
  int waits = 0;
  for (std::size_t i = l.head; i <= l.latch; ++i) {
    if (code[i].mnemonic == "QGMMA") waits += code[i].operands.find("gsb0") != std::string::npos;
  }
  std::printf(
      "%s %s: %d instructions; K loop %#lx-%#lx: steady path %d, %d QGMMA, %d LDGSTS; per weight "
      "per lane %.2f issued, %.2f integer pipe (%s) [budget %.1f, %.1f]\n",
      kTarget.c_str(), kernel.c_str(), whole.instrs, static_cast<unsigned long>(code[l.head].addr),
      static_cast<unsigned long>(code[l.latch].addr), path.instrs, path.qgmma,
      path.by_mnemonic.contains("LDGSTS") ? path.by_mnemonic.at("LDGSTS") : 0, issued, integer,
      integer_mix(path).c_str(), kTiledFp8IssuedPerWeight, kTiledFp8IntegerPerWeight);
  EXPECT_EQ(path.qgmma, 4) << "one 128-K block: 4 wgmma k32 steps";
  EXPECT_EQ(waits, 1) << "QGMMAs that wait on their own scoreboard: serialized wgmmas";
  EXPECT_EQ(path.by_mnemonic.contains("LDGSTS") ? path.by_mnemonic.at("LDGSTS") : 0, 8)
      << "the stage's copies: 4 chunks of A and 4 of W a thread";
  EXPECT_EQ(path.calls, 0);
  EXPECT_LE(issued, kTiledFp8IssuedPerWeight);
  EXPECT_LE(integer, kTiledFp8IntegerPerWeight) << integer_mix(path);
}

// ---- gemm_grouped_e4m3_block128: FP8 experts' decode kernel on CUDA cores ----

// Its K loops (no MMA: codes widened through FP16, FFMA products) read 16 K of 4 weight rows a
// lane an iteration, 64 one-byte weights, held to the tiled kernel's budget per one-byte weight:
// one loop for a pair of rows (128 FFMA) and one for an odd last row (64 FFMA), which must issue
// at most three quarters of the pair's (a token's expert at decode has one row).
TEST_F(SassBudget, GroupedFp8DecodeLoopsAreCounted) {
  const std::string kernel = "gemm_grouped_e4m3_block128";
  std::vector<sass::Instr> code;
  sass::Tally whole;
  ASSERT_NO_FATAL_FAILURE(fp8_kernel_code(kernel, &code, &whole));
  const std::vector<sass::Loop> all = sass::loops_of(code);
  std::map<int, sass::Tally> by_ffma;  // innermost FFMA loops by their FFMAs
  for (const sass::Loop& l : all) {
    const bool inner = std::none_of(all.begin(), all.end(), [&l](const sass::Loop& m) {
      return (m.head != l.head || m.latch != l.latch) && m.head >= l.head && m.latch <= l.latch;
    });
    const sass::Tally body = sass::tally_body(code, l);
    const int ffma = body.by_mnemonic.contains("FFMA") ? body.by_mnemonic.at("FFMA") : 0;
    if (!inner || ffma == 0) continue;
    by_ffma[ffma] = sass::tally_path(code, sass::loop_path(code, l, sass::PathChoice::kSteady));
  }
  ASSERT_TRUE(by_ffma.contains(128) && by_ffma.contains(64) && by_ffma.size() == 2)
      << "one K loop for a pair of rows (128 FFMA) and one for a row alone (64)";
  constexpr int kWeights = 16 * 4;  // 16 K of 4 weight rows a lane
  for (const auto& [ffma, path] : by_ffma) {
    const double issued = static_cast<double>(path.instrs) / kWeights,
                 integer = static_cast<double>(path.integer) / kWeights;
    std::printf(
        "%s %s: K loop of %d row(s): steady path %d; per weight per lane %.2f issued, "
        "%.2f integer pipe (%s) [budget %.1f, %.1f]\n",
        kTarget.c_str(), kernel.c_str(), ffma / 64, path.instrs, issued, integer,
        integer_mix(path).c_str(), kTiledFp8IssuedPerWeight, kTiledFp8IntegerPerWeight);
    EXPECT_EQ(path.calls, 0);
    EXPECT_LE(issued, kTiledFp8IssuedPerWeight) << ffma / 64 << " row(s)";
    EXPECT_LE(integer, kTiledFp8IntegerPerWeight) << ffma / 64 << " row(s)";
  }
  EXPECT_LE(4 * by_ffma.at(64).instrs, 3 * by_ffma.at(128).instrs)
      << "a row alone issues no less than three quarters of a pair";
}

}  // namespace
