#include "sass.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <set>
#include <stdexcept>
#include <string_view>
#include <tuple>

namespace metrale::offline::sass {

namespace {

std::string trim(std::string_view s) {
  const std::size_t b = s.find_first_not_of(" \t");
  if (b == std::string_view::npos) return {};
  const std::size_t e = s.find_last_not_of(" \t");
  return std::string(s.substr(b, e - b + 1));
}

// One listing line as an instruction: "  /*0070*/  @!P6 BRA 0x110 ;  /* 0x...47 */". The
// encoding's second half sits alone on the next line, which has no opcode and is skipped.
std::optional<Instr> parse_line(std::string_view line) {
  const std::size_t open = line.find_first_not_of(" \t");
  if (open == std::string_view::npos || line.substr(open, 2) != "/*") return std::nullopt;
  const std::size_t close = line.find("*/", open);
  if (close == std::string_view::npos) return std::nullopt;
  const std::string_view addr = line.substr(open + 2, close - open - 2);
  if (addr.empty() || addr.find_first_not_of("0123456789abcdef") != std::string_view::npos) {
    return std::nullopt;
  }
  const std::size_t semi = line.find(';', close);
  if (semi == std::string_view::npos) return std::nullopt;
  std::string text = trim(line.substr(close + 2, semi - close - 2));
  if (text.empty()) return std::nullopt;
  Instr i;
  i.addr = std::stoull(std::string(addr), nullptr, 16);
  if (text[0] == '@') {
    const std::size_t sp = text.find(' ');
    if (sp == std::string::npos) return std::nullopt;
    i.guard = text.substr(0, sp);
    text = trim(std::string_view(text).substr(sp));
  }
  const std::size_t sp = text.find(' ');
  i.opcode = text.substr(0, sp);
  i.operands = sp == std::string::npos ? std::string() : trim(std::string_view(text).substr(sp));
  i.mnemonic = i.opcode.substr(0, i.opcode.find('.'));
  return i;
}

// The modifiers of an opcode: "LDG.E.128.CONSTANT" -> {E, 128, CONSTANT}.
std::vector<std::string> modifiers(const std::string& opcode) {
  std::vector<std::string> out;
  std::size_t p = opcode.find('.');
  while (p != std::string::npos) {
    const std::size_t next = opcode.find('.', p + 1);
    out.push_back(
        opcode.substr(p + 1, next == std::string::npos ? std::string::npos : next - p - 1));
    p = next;
  }
  return out;
}

// Bytes one lane reads with a load from global or shared memory; 0 for anything else.
int load_bytes_of(const Instr& i) {
  static const std::set<std::string> sized = {"LDG", "LD", "LDS", "LDGSTS"};
  const std::vector<std::string> mods = modifiers(i.opcode);
  if (i.mnemonic == "LDSM") {  // ldmatrix: .x1/.x2/.x4 print as a trailing 1, 2 or 4 words
    const std::string& n = mods.empty() ? std::string("1") : mods.back();
    return n == "4" ? 16 : n == "2" ? 8 : 4;
  }
  // Bulk and tensor copies move a tile for the whole CTA; a lane's share is not in the opcode.
  if (i.mnemonic == "UBLKCP" || i.mnemonic == "UTMALDG") return 16;
  if (!sized.contains(i.mnemonic)) return 0;
  for (const auto& m : mods) {
    if (m == "128") return 16;
    if (m == "64") return 8;
    if (m == "U16" || m == "S16") return 2;
    if (m == "U8" || m == "S8") return 1;
  }
  return 4;
}

bool is_bf16_mul(const Instr& i) {
  const bool bf16 = i.opcode.find(".BF16") != std::string::npos;
  if (i.mnemonic == "HMUL2") return bf16;
  // A BF16 multiply may also be encoded as a fused multiply-add of -0 (-RZ).
  if (i.mnemonic == "HFMA2" && bf16) {
    const std::size_t comma = i.operands.rfind(',');
    return comma != std::string::npos && trim(i.operands.substr(comma + 1)) == "-RZ";
  }
  return false;
}

// HADD2.BF16_V2 Rd, Ra, -Rb: the INT4 kernels' one subtraction per register of weights.
bool is_bf16_sub(const Instr& i) {
  if (i.mnemonic != "HADD2" || i.opcode.find(".BF16") == std::string::npos) return false;
  const std::size_t comma = i.operands.rfind(',');
  if (comma == std::string::npos) return false;
  const std::string b = trim(i.operands.substr(comma + 1));
  return b.size() > 2 && b[0] == '-' && b[1] == 'R' && b != "-RZ";
}

}  // namespace

std::vector<Instr> parse_function(const std::string& listing, const std::string& function) {
  std::vector<Instr> out;
  bool inside = false;
  std::size_t pos = 0;
  while (pos < listing.size()) {
    const std::size_t eol = std::min(listing.find('\n', pos), listing.size());
    const std::string_view line(listing.data() + pos, eol - pos);
    pos = eol + 1;
    if (const std::size_t f = line.find("Function : "); f != std::string_view::npos) {
      inside = trim(line.substr(f + 11)) == function;
      continue;
    }
    if (!inside) continue;
    if (auto i = parse_line(line)) out.push_back(std::move(*i));
  }
  std::sort(out.begin(), out.end(), [](const Instr& a, const Instr& b) { return a.addr < b.addr; });
  return out;
}

bool is_branch(const Instr& i) {
  return i.mnemonic == "BRA";
}

bool is_conditional(const Instr& i) {
  if (!i.guard.empty() && i.guard != "@PT") return true;
  if (i.opcode != "BRA") return true;  // BRA.DIV, BRA.CONV, BRA.U with a uniform predicate
  // A predicate operand before the target: BRA P1, 0x270 or BRA !P2, 0x...
  const std::string first = i.operands.substr(0, i.operands.find(','));
  return i.operands.find(',') != std::string::npos &&
         (first.starts_with("P") || first.starts_with("!P") || first.starts_with("UP") ||
          first.starts_with("!UP"));
}

std::uint64_t branch_target(const Instr& i) {
  const std::size_t x = i.operands.rfind("0x");
  if (x == std::string::npos) {
    throw std::runtime_error(
        fmt::format("branch at {:#x} has no target: {} {}", i.addr, i.opcode, i.operands));
  }
  return std::stoull(i.operands.substr(x + 2), nullptr, 16);
}

namespace {

// The index of the instruction at `addr`, if there is one.
std::optional<std::size_t> index_of(const std::vector<Instr>& code, std::uint64_t addr) {
  const auto it = std::lower_bound(code.begin(), code.end(), addr,
                                   [](const Instr& i, std::uint64_t a) { return i.addr < a; });
  if (it == code.end() || it->addr != addr) return std::nullopt;
  return static_cast<std::size_t>(it - code.begin());
}

// A tensor-core MMA: mma.sync (HMMA) or wgmma (HGMMA BF16, QGMMA FP8).
bool is_mma(const Instr& i) {
  return i.mnemonic == "HMMA" || i.mnemonic == "HGMMA" || i.mnemonic == "QGMMA";
}

bool holds_hmma(const std::vector<Instr>& code, const Loop& l) {
  for (std::size_t i = l.head; i <= l.latch; ++i) {
    if (is_mma(code[i])) return true;
  }
  return false;
}

}  // namespace

std::vector<Loop> loops_of(const std::vector<Instr>& code) {
  std::map<std::size_t, std::size_t> latch_of;  // head -> last branch back to it
  for (std::size_t i = 0; i < code.size(); ++i) {
    if (!is_branch(code[i])) continue;
    const std::uint64_t target = branch_target(code[i]);
    if (target > code[i].addr) continue;
    const auto head = index_of(code, target);
    if (!head) continue;  // not an instruction of this function
    auto [it, fresh] = latch_of.emplace(*head, i);
    if (!fresh) it->second = std::max(it->second, i);
  }
  std::vector<Loop> out;
  for (const auto& [head, latch] : latch_of) out.push_back({head, latch});
  return out;
}

std::vector<Loop> innermost_mma_loops(const std::vector<Instr>& code) {
  std::vector<Loop> mma;
  for (const auto& l : loops_of(code)) {
    if (holds_hmma(code, l)) mma.push_back(l);
  }
  std::vector<Loop> out;
  for (const auto& l : mma) {
    const bool holds_another = std::any_of(mma.begin(), mma.end(), [&](const Loop& m) {
      return (m.head != l.head || m.latch != l.latch) && m.head >= l.head && m.latch <= l.latch;
    });
    // A loop that starts inside another and ends past it crosses it: not a loop of the source
    // but a retry path ptxas moved out of line (an mbarrier wait's, placed after the EXITs) that
    // jumps back into the body. The loop it crosses is the steady state.
    const bool crosses = std::any_of(mma.begin(), mma.end(), [&](const Loop& m) {
      return m.head < l.head && l.head <= m.latch && m.latch < l.latch;
    });
    if (!holds_another && !crosses) out.push_back(l);
  }
  return out;
}

// The integer ALU pipe, per lane: adds, logic, shifts, byte permutes, compares, selects,
// min/max, bit counts and field ops, and the predicate logic (PLOP3, P2R, R2P) it also runs.
// VIADD (sm_90's vector integer add) is counted here although it may issue to the FMA pipe, so
// that a budget met here is met either way. Not counted: IMAD, IMUL and their forms (the FMA
// pipe), MOV (either pipe), the uniform datapath's U* ops (one per warp, not per lane), and
// floating-point compares (FSETP, FSEL, FMNMX); the per-opcode table shows them all.
bool integer_pipe(const std::string& mnemonic) {
  static const std::set<std::string> alu = {
      "IADD3", "IADD", "VIADD", "VIADDMNMX", "LOP3", "LOP",  "PLOP3", "SHF",    "SHL",
      "SHR",   "PRMT", "ISETP", "ICMP",      "LEA",  "SEL",  "IMNMX", "VIMNMX", "VIMNMX3",
      "IABS",  "FLO",  "POPC",  "BMSK",      "BREV", "SGXT", "P2R",   "R2P"};
  return alu.contains(mnemonic);
}

void Tally::add(const Instr& i) {
  ++instrs;
  ++by_mnemonic[i.mnemonic];
  if (i.mnemonic == "HMMA") ++hmma;
  if (i.mnemonic == "HGMMA") ++hgmma;
  if (i.mnemonic == "QGMMA") ++qgmma;
  if (is_bf16_mul(i)) ++bf16_mul;
  if (is_bf16_sub(i)) ++bf16_sub;
  if (integer_pipe(i.mnemonic)) ++integer;
  if (i.mnemonic == "IMAD" || i.mnemonic == "IMUL") ++imad;
  if (i.mnemonic == "ISETP") ++isetp;
  if (!i.guard.empty() && i.guard != "@PT") ++predicated;
  if (is_branch(i)) ++branches;
  if (i.mnemonic == "CALL") ++calls;
  if (i.mnemonic == "LDL" || i.mnemonic == "STL") ++local;
  load_bytes += load_bytes_of(i);
}

Tally tally_body(const std::vector<Instr>& code, const Loop& loop) {
  Tally t;
  for (std::size_t i = loop.head; i <= loop.latch; ++i) t.add(code[i]);
  return t;
}

namespace {

// What a path is chosen by, best first under the choice's order.
struct PathKey {
  int hmma = 0, calls = 0, instrs = 0;

  void add(const Instr& i) {
    hmma += is_mma(i) ? 1 : 0;
    calls += i.mnemonic == "CALL";
    ++instrs;
  }
  bool better_than(const PathKey& o, PathChoice c) const {
    if (c == PathChoice::kShortest) {
      return std::make_tuple(hmma, -instrs) > std::make_tuple(o.hmma, -o.instrs);
    }
    return std::make_tuple(hmma, -calls, -instrs) > std::make_tuple(o.hmma, -o.calls, -o.instrs);
  }
};

// Whether the steady state must not take the forward branch at b: it skips an if-then whose
// body holds loads or MMAs (the branch is taken only when that work is done, as when no K block
// is left to prefetch). An if-then: every jump out of (b, target) lands on target, so the
// skipped code has no other way round it, unlike one arm of an if-else.
// kSteadyAcrossTiles counts only loads of 16 bytes as work.
bool skips_work(const std::vector<Instr>& code, std::size_t b, std::size_t target,
                PathChoice choice) {
  const int least = choice == PathChoice::kSteadyAcrossTiles ? 16 : 1;
  bool work = false;
  for (std::size_t i = b + 1; i < target; ++i) {
    const Instr& in = code[i];
    work = work || is_mma(in) || load_bytes_of(in) >= least;
    if (in.mnemonic == "EXIT" || in.mnemonic == "RET" || in.mnemonic == "BRX" ||
        in.mnemonic == "JMX") {
      return false;
    }
    if (is_branch(in)) {
      const auto j = index_of(code, branch_target(in));
      if (!j || *j <= b || *j > target) return false;
    }
  }
  return work;
}

}  // namespace

std::vector<std::size_t> loop_path(const std::vector<Instr>& code, const Loop& loop,
                                   PathChoice choice) {
  // Edges inside the body all run forward once back edges are set aside, so one pass in address
  // order finds the best path to every instruction (a longest path in a DAG).
  constexpr std::size_t kNone = static_cast<std::size_t>(-1);
  const std::size_t n = loop.latch - loop.head + 1;
  std::vector<std::optional<PathKey>> best(n);
  std::vector<std::size_t> from(n, kNone);  // the previous instruction on the best path
  std::optional<PathKey> done;
  std::size_t done_at = kNone;
  const auto offer = [&](std::size_t k, std::size_t prev) {
    PathKey t = *best[prev];
    t.add(code[loop.head + k]);
    if (!best[k] || t.better_than(*best[k], choice)) {
      best[k] = t;
      from[k] = prev;
    }
  };
  best[0] = PathKey{};
  best[0]->add(code[loop.head]);
  for (std::size_t k = 0; k < n; ++k) {
    if (!best[k]) continue;
    const Instr& in = code[loop.head + k];
    bool falls_through = true;
    if (is_branch(in)) {
      falls_through = is_conditional(in);
      const std::uint64_t target = branch_target(in);
      if (target == code[loop.head].addr) {
        if (!done || best[k]->better_than(*done, choice)) {  // the path closes the iteration
          done = best[k];
          done_at = k;
        }
      } else if (target > in.addr) {
        // A forward branch inside the body; one past its end leaves the loop.
        const auto j = index_of(code, target);
        if (j && *j <= loop.latch &&
            (choice == PathChoice::kShortest || !is_conditional(in) ||
             !skips_work(code, loop.head + k, *j, choice))) {
          offer(*j - loop.head, k);
        }
      }  // an inner loop's back edge: its body is counted once
    } else if (in.mnemonic == "EXIT" || in.mnemonic == "RET" || in.mnemonic == "BRX" ||
               in.mnemonic == "JMX") {
      falls_through = !in.guard.empty() && in.guard != "@PT";
    }
    if (falls_through && k + 1 < n) offer(k + 1, k);
  }
  if (!done) {
    throw std::runtime_error(
        fmt::format("no path from the loop head at {:#x} back to it", code[loop.head].addr));
  }
  std::vector<std::size_t> path;
  for (std::size_t k = done_at; k != kNone; k = from[k]) path.push_back(loop.head + k);
  std::reverse(path.begin(), path.end());
  return path;
}

Tally tally_path(const std::vector<Instr>& code, const std::vector<std::size_t>& path) {
  Tally t;
  for (const std::size_t i : path) t.add(code[i]);
  return t;
}

}  // namespace metrale::offline::sass
