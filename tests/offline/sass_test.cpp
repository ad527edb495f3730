// The SASS reader (sass.h) on small hand-written listings in cuobjdump's format: parsing, loops,
// the steady path, and what is counted where.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "sass.h"

namespace {

namespace sass = metrale::offline::sass;

// A listing of one function as cuobjdump prints it: each instruction 16 bytes from 0, its
// encoding's second half on a line of its own.
std::string listing(const std::string& function, const std::vector<std::string>& text) {
  std::string out = "\tcode for sm_90a\n\t\tFunction : " + function + "\n";
  out += "\t.headerflags\t@\"EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90\"\n";
  std::uint64_t addr = 0;
  for (const auto& t : text) {
    out += fmt::format("        /*{:04x}*/                   {} ;   /* 0x000000ff00037812 */\n",
                       addr, t);
    out += "                                              /* 0x000fe200078ec0ff */\n";
    addr += 16;
  }
  return out + "\t\t..........\n\n";
}

std::vector<std::uint64_t> addrs(const std::vector<sass::Instr>& code,
                                 const std::vector<std::size_t>& path) {
  std::vector<std::uint64_t> out;
  for (const auto i : path) out.push_back(code[i].addr);
  return out;
}

TEST(SassReader, ParsesOneFunctionsInstructions) {
  const std::string text =
      listing("other", {"NOP"}) + listing("f", {"LDC R1, c[0x0][0x28]", "@!P6 BRA 0x0",
                                                "HMMA.16816.F32.BF16 R4, R8, R12, R4", "EXIT"});
  const auto code = sass::parse_function(text, "f");
  ASSERT_EQ(code.size(), 4u);
  EXPECT_EQ(code[1].addr, 0x10u);
  EXPECT_EQ(code[1].guard, "@!P6");
  EXPECT_EQ(code[1].opcode, "BRA");
  EXPECT_EQ(code[1].operands, "0x0");
  EXPECT_EQ(code[2].opcode, "HMMA.16816.F32.BF16");
  EXPECT_EQ(code[2].mnemonic, "HMMA");
  EXPECT_EQ(code[3].operands, "");
  EXPECT_TRUE(sass::parse_function(text, "missing").empty());
  EXPECT_EQ(sass::parse_function(text, "other").size(), 1u);
}

TEST(SassReader, TellsConditionalBranches) {
  const auto code =
      sass::parse_function(listing("f", {"BRA 0x40", "@P0 BRA 0x40", "BRA P1, 0x40",
                                         "BRA.DIV UR4, 0x40", "@PT BRA 0x40", "@!UP0 BRA 0x40"}),
                           "f");
  ASSERT_EQ(code.size(), 6u);
  const std::vector<bool> want = {false, true, true, true, false, true};
  for (std::size_t i = 0; i < code.size(); ++i) {
    EXPECT_TRUE(sass::is_branch(code[i]));
    EXPECT_EQ(sass::is_conditional(code[i]), want[i]) << code[i].guard << " " << code[i].operands;
    EXPECT_EQ(sass::branch_target(code[i]), 0x40u);
  }
}

// An outer loop around an inner HMMA loop and a loop without HMMA: the inner HMMA loop alone is
// a steady state; two branches back to one head make one loop.
TEST(SassReader, FindsTheInnermostMmaLoops) {
  const auto code = sass::parse_function(listing("f",
                                                 {
                                                     "MOV R0, RZ",               // 0x00
                                                     "IADD3 R0, R0, 0x1, RZ",    // 0x10 outer
                                                     "HMMA.16816.F32.BF16 R4",   // 0x20 inner
                                                     "@P1 BRA 0x20",             // 0x30
                                                     "HMMA.16816.F32.BF16 R4",   // 0x40
                                                     "@P2 BRA 0x20",             // 0x50
                                                     "@P0 BRA 0x10",             // 0x60
                                                     "LOP3.LUT R1, R1, R2, RZ",  // 0x70 no HMMA
                                                     "@P3 BRA 0x70",             // 0x80
                                                     "EXIT",                     // 0x90
                                                 }),
                                         "f");
  const auto loops = sass::loops_of(code);
  ASSERT_EQ(loops.size(), 3u);
  EXPECT_EQ(code[loops[0].head].addr, 0x10u);
  EXPECT_EQ(code[loops[0].latch].addr, 0x60u);
  EXPECT_EQ(code[loops[1].head].addr, 0x20u);
  EXPECT_EQ(code[loops[1].latch].addr, 0x50u);
  const auto mma = sass::innermost_mma_loops(code);
  ASSERT_EQ(mma.size(), 1u);
  EXPECT_EQ(code[mma[0].head].addr, 0x20u);
  EXPECT_EQ(code[mma[0].latch].addr, 0x50u);
}

// A body with a prefetch that the last iterations skip, and a checked boundary load beside the
// interior one: the steady path issues the prefetch and takes the interior load; the shortest
// path skips the prefetch; the body counts everything.
TEST(SassReader, SteadyPathIssuesTheLoadsAndSkipsTheBoundaryPath) {
  const auto code = sass::parse_function(
      listing("f",
              {
                  "HMUL2.BF16_V2 R2, R2, R3",                // 0x00 head
                  "@P0 BRA 0x30",                            // 0x10 no prefetch left
                  "LDG.E.128.CONSTANT R8, desc[UR4][R6]",    // 0x20 prefetch
                  "@!P1 BRA 0x70",                           // 0x30 boundary?
                  "LDG.E.128.CONSTANT R12, desc[UR4][R6]",   // 0x40 interior load
                  "BRA 0xc0",                                // 0x50
                  "NOP",                                     // 0x60 (not reached)
                  "ISETP.GE.AND P2, PT, R0, R1, PT",         // 0x70 boundary: checks...
                  "@P2 LDG.E.64 R12, desc[UR4][R6]",         // 0x80
                  "@P2 LDG.E.64 R14, desc[UR4][R6.64+0x8]",  // 0x90
                  "SEL R12, R12, RZ, P2",                    // 0xa0
                  "CALL.REL.NOINC 0x100",                    // 0xb0 ... and a slow path
                  "HMMA.16816.F32.BF16 R20, R2, R12, R20",   // 0xc0 join
                  "HFMA2.BF16_V2 R3, R3, R2, -RZ",           // 0xd0
                  "IMAD.MOV.U32 R5, RZ, RZ, R4",             // 0xe0
                  "@!P3 BRA 0x0",                            // 0xf0 loop branch
                  "EXIT",                                    // 0x100
              }),
      "f");
  const auto loops = sass::innermost_mma_loops(code);
  ASSERT_EQ(loops.size(), 1u);
  const auto steady = sass::loop_path(code, loops[0], sass::PathChoice::kSteady);
  EXPECT_EQ(addrs(code, steady), (std::vector<std::uint64_t>{0x00, 0x10, 0x20, 0x30, 0x40, 0x50,
                                                             0xc0, 0xd0, 0xe0, 0xf0}));
  const sass::Tally t = sass::tally_path(code, steady);
  EXPECT_EQ(t.instrs, 10);
  EXPECT_EQ(t.hmma, 1);
  EXPECT_EQ(t.bf16_mul, 2);
  EXPECT_EQ(t.integer, 0);  // BRA, LDG, HMMA, HMUL2, HFMA2 and IMAD are not on the integer pipe
  EXPECT_EQ(t.imad, 1);
  EXPECT_EQ(t.predicated, 3);
  EXPECT_EQ(t.branches, 4);
  EXPECT_EQ(t.load_bytes, 32);
  EXPECT_EQ(t.calls, 0);
  const auto shortest = sass::loop_path(code, loops[0], sass::PathChoice::kShortest);
  EXPECT_EQ(addrs(code, shortest),
            (std::vector<std::uint64_t>{0x00, 0x10, 0x30, 0x40, 0x50, 0xc0, 0xd0, 0xe0, 0xf0}));
  const sass::Tally body = sass::tally_body(code, loops[0]);
  EXPECT_EQ(body.instrs, 16);
  EXPECT_EQ(body.isetp, 1);
  EXPECT_EQ(body.integer, 2);  // ISETP, SEL
  EXPECT_EQ(body.calls, 1);
}

TEST(SassReader, CountsByPipeAndKind) {
  const auto code = sass::parse_function(listing("f",
                                                 {
                                                     "LOP3.LUT R1, R2, 0x7777, RZ, 0xc0, !PT",
                                                     "PRMT R3, R4, 0x5140, R5",
                                                     "SHF.R.U32.HI R6, RZ, 0x4, R7",
                                                     "LEA.HI R8, R9, R10, RZ, 0x2",
                                                     "VIADD R11, R11, 0x10",
                                                     "IMAD.SHL.U32 R12, R13, 0x10, RZ",
                                                     "IMAD.WIDE R14, R15, 0x4, R16",
                                                     "UIADD3 UR4, UR4, 0x1, URZ",
                                                     "MOV R17, R18",
                                                     "HMUL2 R19, R19, R20",
                                                     "HFMA2.MMA R21, -RZ, RZ, 0, 0",
                                                     "HMUL2.BF16_V2 R22, R22, R23",
                                                     "LDL R24, [R1]",
                                                     "STL [R1], R24",
                                                 }),
                                         "f");
  sass::Tally t;
  for (const auto& i : code) t.add(i);
  EXPECT_EQ(t.instrs, 14);
  EXPECT_EQ(t.integer, 5);  // LOP3, PRMT, SHF, LEA, VIADD
  EXPECT_EQ(t.imad, 2);
  EXPECT_EQ(t.bf16_mul, 1);  // not the FP16 HMUL2, not the HFMA2.MMA move
  EXPECT_EQ(t.local, 2);
  EXPECT_EQ(t.load_bytes, 0);  // local memory is not an operand stream
}

}  // namespace
