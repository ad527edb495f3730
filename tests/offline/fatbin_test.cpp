// Checks the built CUDA fatbins with cuobjdump, no GPU: published launch shapes, the published
// blocks per SM against each cubin's registers and shared memory, tensor-core SASS, and no stack
// or local memory in any kernel of any target.
#include <elf.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/decode_layout.h"
#include "kernels/fused_tile.h"
#include "kernels/grouped_fp8_tiles.h"
#include "kernels/int4_decode_layout.h"
#include "kernels/manifest.h"
#include "kernels/tile_math.h"
#include "kernels/verified_devices.h"
#include "occupancy.h"
#include "shell.h"

namespace {

namespace fs = std::filesystem;
namespace dl = metrale::decode_layout;
namespace tl = metrale::tiles;

// ---- what the kernel sources say (the expectations) ----

// The machine-code targets of every module (src/CMakeLists.txt); compute_80 is PTX only.
const std::vector<std::string> kTargets = {"sm_80", "sm_89", "sm_90a"};

// Constants private to w4a16.cu (its anonymous namespace, so not includable): restated here.
constexpr std::uint32_t kW4a16Threads = 256;
constexpr std::uint32_t kCastPerThread = 16;
constexpr std::uint32_t kDequantRowsPerBlock = 8;
constexpr std::uint32_t kSimpleWarps = 256 / 32;  // simple.cuh: the fallback's warps per block
// The blocks per SM every w4a16 GEMM kernel is compiled for (its k*BlocksPerSm).
constexpr std::uint32_t kGemmBlocksPerSm = 1;
// Likewise core.cu's.
constexpr std::uint32_t kCoreThreads = 256;

using Published = std::map<std::string, std::uint32_t>;

constexpr std::uint32_t u32(int v) {
  return static_cast<std::uint32_t>(v);
}

// What run 6 of 2026-12-04 verified on an H200 (docs/GPU.md): the sm_90a code only.
void add_run6_verified(Published& p, const std::string& target,
                       std::initializer_list<const char*> entries) {
  if (target != "sm_90a") return;
  for (const char* e : entries) {
    p[std::string(e) + "_verified"] = 20261204;
    p[std::string(e) + "_verified_on"] = metrale::verified::kH200;
  }
}

Published w4a16_published(const std::string& target) {
  // The tiled and E4M3 routes run wgmma on sm_90a only; elsewhere the warp-per-column fallback.
  const bool wgmma = target == "sm_90a";
  Published p = {
      {"bf16_to_fp8_n_tile", kW4a16Threads * kCastPerThread},
      {"dequant_e4m3_n_tile", kDequantRowsPerBlock},
      {"dequant_bf16_n_tile", kW4a16Threads},
      {"gemm_split_reduce_n_tile", kW4a16Threads},
      {"gemm_decode_n_tile", u32(tl::kDecodeNTile)},
      {"gemm_decode_split_k", u32(tl::kDecodeSplitUnit)},
      {"gemm_decode_a_e4m3", 0},
      {"gemm_decode_packed_n_tile", u32(dl::kTileN)},
      {"gemm_decode_packed_split_k", u32(tl::kDecodeSplitUnit)},
      {"gemm_decode_packed_a_e4m3", 0},
      {"gemm_decode_packed_block_threads", u32(tl::kDecodeThreads)},
      {"gemm_decode_packed_layout", dl::kLayoutId},
      {"gemm_decode_packed_max_m", u32(tl::kDecodeMaxM)},
      {"gemm_tiled_n_tile", wgmma ? u32(tl::kTiledNTile) : kSimpleWarps},
      {"gemm_tiled_m_tile", wgmma ? u32(tl::kTiledMTile) : 0},
      {"gemm_tiled_smem_bytes", wgmma ? u32(tl::kTiledSmemBytes) : 0},
      {"gemm_tiled_a_e4m3", 0},
      {"gemm_e4m3_n_tile", wgmma ? u32(tl::kE4m3NTile) : kSimpleWarps},
      {"gemm_e4m3_m_tile", wgmma ? u32(tl::kE4m3MTile) : 0},
      {"gemm_e4m3_smem_bytes", wgmma ? u32(tl::kE4m3SmemBytes) : 0},
      {"gemm_e4m3_a_e4m3", 1},
      {"gemm_decode_max_m", u32(tl::kDecodeMaxM)},
      {"dequant_bf16_min_m", u32(tl::kDequantMinM)},
      {"bf16_to_fp8_block_threads", kW4a16Threads},
      {"dequant_e4m3_block_threads", kW4a16Threads},
      {"dequant_bf16_block_threads", kW4a16Threads},
      {"gemm_split_reduce_block_threads", kW4a16Threads},
      {"gemm_decode_block_threads", u32(tl::kDecodeThreads)},
      {"gemm_tiled_block_threads", kW4a16Threads},
      {"gemm_e4m3_block_threads", kW4a16Threads},
      // Every kernel that writes C honours kGemmOutF32 (epilogue.cuh's write_final).
      {"gemm_decode_out_f32", 1},
      {"gemm_decode_packed_out_f32", 1},
      {"gemm_split_reduce_out_f32", 1},
      {"gemm_tiled_out_f32", 1},
      {"gemm_e4m3_out_f32", 1},
      // The GEMM kernels' occupancy; the casts, dequantizations and the reduction publish none.
      {"gemm_decode_blocks_per_sm", kGemmBlocksPerSm},
      {"gemm_decode_packed_blocks_per_sm", kGemmBlocksPerSm},
      {"gemm_tiled_blocks_per_sm", kGemmBlocksPerSm},
      {"gemm_e4m3_blocks_per_sm", kGemmBlocksPerSm},
      // INT4 in the INT4 decode layout: decode as gemm_decode_packed's grid, the dequantization
      // and act order's gather of A a thread per 8 elements. No verification yet.
      {"gemm_int4_decode_n_tile", u32(dl::kTileN)},
      {"gemm_int4_decode_split_k", u32(tl::kDecodeSplitUnit)},
      {"gemm_int4_decode_block_threads", u32(tl::kDecodeThreads)},
      {"gemm_int4_decode_blocks_per_sm", kGemmBlocksPerSm},
      {"gemm_int4_decode_layout", metrale::int4_decode::kLayoutId},
      {"gemm_int4_decode_max_m", u32(tl::kDecodeMaxM)},
      {"gemm_int4_decode_a_e4m3", 0},
      {"gemm_int4_decode_out_f32", 1},
      {"gemm_int4_decode_int4", 1},
      {"dequant_int4_bf16_n_tile", kW4a16Threads},
      {"dequant_int4_bf16_block_threads", kW4a16Threads},
      {"dequant_int4_bf16_layout", metrale::int4_decode::kLayoutId},
      {"dequant_int4_bf16_int4", 1},
      {"permute_a_int4_n_tile", kW4a16Threads},
      {"permute_a_int4_block_threads", kW4a16Threads},
      {"permute_a_int4_layout", metrale::int4_decode::kLayoutId},
      {"permute_a_int4_int4", 1},
      // The grouped GEMMs: the decode kernels' grids per expert (grid y), K split as theirs (grid
      // z) and summed by the grouped reduction, a block per 256 columns of an expert. No
      // verification yet.
      {"gemm_grouped_n_tile", u32(tl::kDecodeNTile)},
      {"gemm_grouped_block_threads", u32(tl::kDecodeThreads)},
      {"gemm_grouped_out_f32", 1},
      {"gemm_grouped_split_k", u32(tl::kDecodeSplitUnit)},
      {"gemm_grouped_blocks_per_sm", kGemmBlocksPerSm},
      {"gemm_grouped_packed_n_tile", u32(dl::kTileN)},
      {"gemm_grouped_packed_block_threads", u32(tl::kDecodeThreads)},
      {"gemm_grouped_packed_layout", dl::kLayoutId},
      {"gemm_grouped_packed_out_f32", 1},
      {"gemm_grouped_packed_split_k", u32(tl::kDecodeSplitUnit)},
      {"gemm_grouped_packed_blocks_per_sm", kGemmBlocksPerSm},
      {"gemm_grouped_int4_decode_n_tile", u32(dl::kTileN)},
      {"gemm_grouped_int4_decode_block_threads", u32(tl::kDecodeThreads)},
      {"gemm_grouped_int4_decode_layout", metrale::int4_decode::kLayoutId},
      {"gemm_grouped_int4_decode_out_f32", 1},
      {"gemm_grouped_int4_decode_int4", 1},
      {"gemm_grouped_int4_decode_split_k", u32(tl::kDecodeSplitUnit)},
      {"gemm_grouped_int4_decode_blocks_per_sm", kGemmBlocksPerSm},
      {"gemm_grouped_split_reduce_n_tile", kW4a16Threads},
      {"gemm_grouped_split_reduce_block_threads", kW4a16Threads},
      {"gemm_grouped_split_reduce_out_f32", 1},
  };
  if (wgmma) {
    // gemm_fused: wgmma on sm_90a; elsewhere a placeholder that publishes only that it is absent.
    p.insert({{"gemm_fused_n_tile", u32(metrale::fused::kRows)},
              {"gemm_fused_m_tile", u32(metrale::fused::kTokens)},
              {"gemm_fused_smem_bytes", u32(metrale::fused::kSmemBytes)},
              {"gemm_fused_block_threads", u32(metrale::fused::kThreads)},
              {"gemm_fused_layout", dl::kLayoutId},
              {"gemm_fused_a_e4m3", 0},
              {"gemm_fused_out_f32", 1},
              {"gemm_fused_persistent", 1},
              {"gemm_fused_blocks_per_sm", kGemmBlocksPerSm}});
    // gemm_grouped_fused: gemm_fused's pipeline over the experts, its larger shared memory (each
    // stage carries an expert's scale table). No verification yet.
    p.insert({{"gemm_grouped_fused_n_tile", u32(metrale::fused::kRows)},
              {"gemm_grouped_fused_m_tile", u32(metrale::fused::kTokens)},
              {"gemm_grouped_fused_smem_bytes", u32(metrale::fused::kGroupedSmemBytes)},
              {"gemm_grouped_fused_block_threads", u32(metrale::fused::kThreads)},
              {"gemm_grouped_fused_layout", dl::kLayoutId},
              {"gemm_grouped_fused_out_f32", 1},
              {"gemm_grouped_fused_persistent", 1},
              {"gemm_grouped_fused_blocks_per_sm", kGemmBlocksPerSm}});
    // gemm_grouped_int4_fused: the same pipeline on INT4 experts (the INT4 decode layout).
    p.insert({{"gemm_grouped_int4_fused_n_tile", u32(metrale::fused::kRows)},
              {"gemm_grouped_int4_fused_m_tile", u32(metrale::fused::kTokens)},
              {"gemm_grouped_int4_fused_smem_bytes", u32(metrale::fused::kGroupedSmemBytes)},
              {"gemm_grouped_int4_fused_block_threads", u32(metrale::fused::kThreads)},
              {"gemm_grouped_int4_fused_layout", metrale::int4_decode::kLayoutId},
              {"gemm_grouped_int4_fused_out_f32", 1},
              {"gemm_grouped_int4_fused_int4", 1},
              {"gemm_grouped_int4_fused_persistent", 1},
              {"gemm_grouped_int4_fused_blocks_per_sm", kGemmBlocksPerSm}});
    // What run 5 of 2026-11-29 verified on an H200 (docs/GPU.md): this target's code only.
    for (const char* e : {"bf16_to_fp8", "dequant_e4m3", "gemm_decode", "gemm_split_reduce",
                          "gemm_tiled", "gemm_e4m3"}) {
      p[std::string(e) + "_verified"] = 20261129;
      p[std::string(e) + "_verified_on"] = metrale::verified::kH200;
    }
  } else {
    p["gemm_fused_absent"] = 1;
    p["gemm_grouped_fused_absent"] = 1;
    p["gemm_grouped_int4_fused_absent"] = 1;
  }
  add_run6_verified(p, target, {"gemm_decode_packed", "gemm_fused", "dequant_bf16"});
  return p;
}

Published core_published(const std::string& target) {
  Published p = {
      {"fill_u32_n_tile", kCoreThreads},          {"axpy_f32_n_tile", kCoreThreads * 4},
      {"cast_f32_bf16_n_tile", kCoreThreads * 4}, {"fill_u32_block_threads", kCoreThreads},
      {"axpy_f32_block_threads", kCoreThreads},   {"cast_f32_bf16_block_threads", kCoreThreads}};
  add_run6_verified(p, target, {"fill_u32", "axpy_f32", "cast_f32_bf16"});
  return p;
}

// Module "fp8": the cast a warp per (row, 128-K block) pair, 8 warps a block, on every target;
// the grouped W8A8 GEMM 4 columns a warp, 32 a block, FP32 C, not yet verified; the tiled one
// (sm_90a: tiles of 128 x 128, persistent, one block an SM for its shared memory, kAuto from 16
// rows an expert; a placeholder elsewhere), not yet verified.
Published fp8_published(const std::string& target) {
  namespace gt = metrale::grouped_fp8::tiled;
  Published p = {{"cast_e4m3_block128_n_tile", 8},
                 {"cast_e4m3_block128_block_threads", 256},
                 {"gemm_grouped_e4m3_block128_n_tile", 32},
                 {"gemm_grouped_e4m3_block128_block_threads", 256},
                 {"gemm_grouped_e4m3_block128_out_f32", 1}};
  if (target == "sm_90a") {
    p.insert({{"gemm_grouped_e4m3_block128_tiled_n_tile", u32(gt::kNTile)},
              {"gemm_grouped_e4m3_block128_tiled_m_tile", u32(gt::kMTile)},
              {"gemm_grouped_e4m3_block128_tiled_smem_bytes", u32(gt::kSmemBytes)},
              {"gemm_grouped_e4m3_block128_tiled_block_threads", u32(gt::kThreads)},
              {"gemm_grouped_e4m3_block128_tiled_out_f32", 1},
              {"gemm_grouped_e4m3_block128_tiled_persistent", 1},
              {"gemm_grouped_e4m3_block128_tiled_blocks_per_sm", 1},
              {"gemm_grouped_e4m3_block128_tiled_min_m", 16}});
  } else {
    p["gemm_grouped_e4m3_block128_tiled_absent"] = 1;
  }
  add_run6_verified(p, target, {"cast_e4m3_block128"});
  return p;
}

// Module "moe": a warp per token (route) or entry (gather), 8 warps a block; count one block over
// up to 1024 experts; scatter a block per expert; combine a block per token; glu a block per row.
// Not yet verified.
Published moe_published(const std::string& /*target*/) {
  Published p = {{"moe_route_n_tile", 8},  {"moe_count_n_tile", 1024}, {"moe_scatter_n_tile", 1},
                 {"moe_gather_n_tile", 8}, {"moe_combine_n_tile", 1},  {"moe_glu_n_tile", 1}};
  for (const char* e :
       {"moe_route", "moe_count", "moe_scatter", "moe_gather", "moe_combine", "moe_glu"}) {
    p[std::string(e) + "_block_threads"] = 256;
  }
  return p;
}

struct Module {
  std::string name;
  std::string fatbin;
  std::set<std::string> entries;  // every __global__ of the source
  Published (*published)(const std::string& target);
};

const std::vector<Module>& modules() {
  static const std::vector<Module> all = {
      {"core", METRALE_CORE_FATBIN, {"fill_u32", "axpy_f32", "cast_f32_bf16"}, core_published},
      {"w4a16",
       METRALE_W4A16_FATBIN,
       {metrale::manifest::kW4a16Entries.begin(), metrale::manifest::kW4a16Entries.end()},
       w4a16_published},
      {"fp8",
       METRALE_FP8_FATBIN,
       {"cast_e4m3_block128", "gemm_grouped_e4m3_block128", "gemm_grouped_e4m3_block128_tiled"},
       fp8_published},
      {"moe",
       METRALE_MOE_FATBIN,
       {"moe_route", "moe_count", "moe_scatter", "moe_gather", "moe_combine", "moe_glu"},
       moe_published},
  };
  return all;
}

const Module& module_named(const std::string& name) {
  for (const auto& m : modules()) {
    if (m.name == name) return m;
  }
  throw std::runtime_error("no module " + name);
}

// ---- running cuobjdump ----

using metrale::offline::quoted;
using metrale::offline::Ran;
using metrale::offline::run;

std::string cuobjdump(const std::string& args) {
  return metrale::offline::cuobjdump_command(METRALE_CUOBJDUMP, METRALE_NVDISASM, args);
}

// ---- the ELF64 of a cubin ----

struct Section {
  std::string name;
  std::uint32_t type = 0;
  std::uint64_t offset = 0;
  std::uint64_t size = 0;
};

struct Symbol {
  std::string name;
  std::uint64_t value = 0;
  std::uint64_t size = 0;
  unsigned type = 0;
  unsigned other = 0;
  std::uint16_t section = 0;
};

// st_other bit that marks a kernel entry (what cuModuleGetFunction can find) in a CUDA ELF.
constexpr unsigned kStoCudaEntry = 0x10;

struct Cubin {
  std::string target;
  std::vector<unsigned char> bytes;
  std::vector<Section> sections;
  std::vector<Symbol> symbols;
};

template <typename T>
T read_at(const std::vector<unsigned char>& bytes, std::uint64_t offset) {
  if (offset > bytes.size() || bytes.size() - offset < sizeof(T)) {
    throw std::runtime_error(fmt::format("ELF read of {} bytes at {} past the end ({} bytes)",
                                         sizeof(T), offset, bytes.size()));
  }
  T v;
  std::memcpy(&v, bytes.data() + offset, sizeof(T));
  return v;
}

std::string string_at(const std::vector<unsigned char>& bytes, const Section& table,
                      std::uint64_t index) {
  if (index >= table.size || table.offset + table.size > bytes.size()) {
    throw std::runtime_error("ELF string index outside its table");
  }
  const auto* begin = reinterpret_cast<const char*>(bytes.data() + table.offset + index);
  return std::string(begin, strnlen(begin, table.size - index));
}

Cubin parse_cubin(std::string target, std::vector<unsigned char> bytes) {
  Cubin c{std::move(target), std::move(bytes), {}, {}};
  const auto eh = read_at<Elf64_Ehdr>(c.bytes, 0);
  if (std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0 || eh.e_ident[EI_CLASS] != ELFCLASS64 ||
      eh.e_ident[EI_DATA] != ELFDATA2LSB || eh.e_shentsize != sizeof(Elf64_Shdr)) {
    throw std::runtime_error("not a little-endian ELF64 with 64-byte section headers");
  }
  std::vector<Elf64_Shdr> headers;
  for (std::uint64_t i = 0; i < eh.e_shnum; ++i) {
    headers.push_back(read_at<Elf64_Shdr>(c.bytes, eh.e_shoff + i * sizeof(Elf64_Shdr)));
  }
  const auto raw = [](const Elf64_Shdr& h) {
    return Section{"", h.sh_type, h.sh_offset, h.sh_size};
  };
  if (eh.e_shstrndx >= headers.size()) throw std::runtime_error("no section name table");
  const Section names = raw(headers[eh.e_shstrndx]);
  for (const auto& h : headers) {
    Section s = raw(h);
    s.name = string_at(c.bytes, names, h.sh_name);
    c.sections.push_back(s);
  }
  for (const auto& h : headers) {
    if (h.sh_type != SHT_SYMTAB) continue;
    if (h.sh_link >= headers.size()) throw std::runtime_error("symbol table without strings");
    const Section strings = raw(headers[h.sh_link]);
    for (std::uint64_t off = 0; off + sizeof(Elf64_Sym) <= h.sh_size; off += sizeof(Elf64_Sym)) {
      const auto sym = read_at<Elf64_Sym>(c.bytes, h.sh_offset + off);
      c.symbols.push_back({string_at(c.bytes, strings, sym.st_name), sym.st_value, sym.st_size,
                           ELF64_ST_TYPE(sym.st_info), sym.st_other, sym.st_shndx});
    }
  }
  return c;
}

// The kernel entries of a cubin.
std::set<std::string> entries_of(const Cubin& c) {
  std::set<std::string> out;
  for (const auto& s : c.symbols) {
    if (s.type == STT_FUNC && (s.other & kStoCudaEntry) != 0) out.insert(s.name);
  }
  return out;
}

// Every cubin of a fatbin, extracted once per process.
const std::vector<Cubin>& cubins_of(const Module& m) {
  static std::map<std::string, std::vector<Cubin>> cache;
  if (auto it = cache.find(m.name); it != cache.end()) return it->second;
  std::string dir_template = (fs::temp_directory_path() / "metrale-fatbin-XXXXXX").string();
  if (mkdtemp(dir_template.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  const fs::path dir = dir_template;
  const Ran r =
      run("cd " + quoted(dir.string()) + " && " + cuobjdump("-xelf all " + quoted(m.fatbin)));
  std::vector<Cubin> out;
  for (const auto& f : fs::directory_iterator(dir)) {
    // cuobjdump names them <module>.<n>.<target>.cubin.
    const std::string name = f.path().filename().string();
    if (!name.ends_with(".cubin")) continue;
    const std::string stem = name.substr(0, name.size() - std::strlen(".cubin"));
    std::ifstream in(f.path(), std::ios::binary);
    std::vector<unsigned char> bytes{std::istreambuf_iterator<char>(in), {}};
    out.push_back(parse_cubin(stem.substr(stem.rfind('.') + 1), std::move(bytes)));
  }
  fs::remove_all(dir);
  if (r.status != 0 || out.empty()) {
    throw std::runtime_error(fmt::format("cuobjdump -xelf all {} failed (status {}):\n{}", m.fatbin,
                                         r.status, r.output));
  }
  return cache.emplace(m.name, std::move(out)).first->second;
}

// The opcodes of a SASS listing whose base name (before the first '.') is `mnemonic`, e.g. HMMA
// for HMMA.16816.F32.BF16; a guard predicate (@P0) may precede the opcode.
int count_opcode(const std::string& sass, const std::string& mnemonic) {
  int n = 0;
  std::size_t pos = 0;
  while (pos < sass.size()) {
    const std::size_t eol = std::min(sass.find('\n', pos), sass.size());
    const std::string line = sass.substr(pos, eol - pos);
    pos = eol + 1;
    // Instruction lines start with their address: /*0120*/ OPCODE ...
    const std::size_t addr = line.find("/*");
    const std::size_t close = line.find("*/");
    if (addr == std::string::npos || close == std::string::npos ||
        line.find_first_not_of(" \t") != addr) {
      continue;
    }
    std::size_t t = line.find_first_not_of(" \t", close + 2);
    if (t != std::string::npos && line[t] == '@')
      t = line.find_first_not_of(" \t", line.find(' ', t));
    if (t == std::string::npos) continue;
    const std::string opcode = line.substr(t, line.find_first_of(" ;.", t) - t);
    if (opcode == mnemonic) ++n;
  }
  return n;
}

class FatbinOffline : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string missing =
        metrale::offline::missing_disassemblers(METRALE_CUOBJDUMP, METRALE_NVDISASM);
    if (!missing.empty()) FAIL() << missing;
    for (const auto& m : modules()) {
      ASSERT_TRUE(fs::exists(m.fatbin)) << m.fatbin << " is missing: build the metrale target";
    }
  }
};

// Every module carries a cubin per target and the compute_80 PTX that newer GPUs JIT-compile;
// the other checks loop over these cubins, so a lost target must fail here, not pass vacuously.
TEST_F(FatbinOffline, EveryModuleCarriesEveryTarget) {
  for (const auto& m : modules()) {
    std::multiset<std::string> found;
    for (const auto& c : cubins_of(m)) found.insert(c.target);
    EXPECT_EQ(found, std::multiset<std::string>(kTargets.begin(), kTargets.end()))
        << "module " << m.name;
    const Ran ptx = run(cuobjdump("-lptx " + quoted(m.fatbin)));
    EXPECT_NE(ptx.output.find(".sm_80.ptx"), std::string::npos)
        << "module " << m.name << " has no compute_80 PTX:\n"
        << ptx.output;
  }
}

// The <entry>_<field> globals a cubin of module m publishes, by name: each must be a 4-byte
// unsigned in .nv.global (a failure of the test otherwise).
Published published_in(const Module& m, const Cubin& c) {
  Published seen;
  for (const auto& s : c.symbols) {
    if (s.type != STT_OBJECT || s.section == SHN_UNDEF || s.section >= c.sections.size()) {
      continue;
    }
    // Published names are <entry>_<field>; other device globals are not ours to check.
    bool ours = false;
    for (const auto& e : m.entries) ours = ours || s.name.starts_with(e + "_");
    if (!ours) continue;
    const Section& sec = c.sections[s.section];
    EXPECT_TRUE(sec.name.starts_with(".nv.global")) << s.name << " lives in " << sec.name;
    EXPECT_EQ(s.size, 4u) << s.name << " is not a std::uint32_t";
    if (s.size != 4 || s.value + 4 > sec.size) {
      ADD_FAILURE() << s.name << " at " << s.value << " does not fit in " << sec.name;
      continue;
    }
    // Zero-initialised globals go to .nv.global, which has no bytes in the file.
    seen[s.name] =
        sec.type == SHT_NOBITS ? 0 : read_at<std::uint32_t>(c.bytes, sec.offset + s.value);
  }
  return seen;
}

// The op code sizes every launch from the published globals alone, so each must hold what the
// code of that target uses, and every entry must publish its grid tile.
TEST_F(FatbinOffline, PublishedLaunchShapesMatchTheCode) {
  for (const auto& m : modules()) {
    for (const auto& c : cubins_of(m)) {
      SCOPED_TRACE(fmt::format("module {}, {}", m.name, c.target));
      EXPECT_EQ(entries_of(c), m.entries) << "the kernel entries differ from the test's list";
      const Published expected = m.published(c.target);
      const Published seen = published_in(m, c);
      for (const auto& [name, want] : expected) {
        const auto it = seen.find(name);
        if (it == seen.end()) {
          ADD_FAILURE() << name << " is not published";
          continue;
        }
        EXPECT_EQ(it->second, want) << name << " (published) differs from the code's constant";
      }
      for (const auto& [name, value] : seen) {
        EXPECT_TRUE(expected.contains(name)) << name << " = " << value << " has no expectation";
      }
      for (const auto& e : m.entries) {
        if (seen.contains(e + "_absent")) continue;  // a placeholder publishes no launch shape
        const auto it = seen.find(e + "_n_tile");
        EXPECT_TRUE(it != seen.end() && it->second != 0) << e << "_n_tile is missing or zero";
        // The ops size every launch from the block size the entry publishes.
        const auto bt = seen.find(e + "_block_threads");
        EXPECT_TRUE(bt != seen.end() && bt->second != 0) << e << "_block_threads is missing or 0";
      }
    }
  }
}

// The tensor-core routes really compiled to tensor-core instructions on the targets meant for
// them (a lost #if or arch macro would silently fall back to the slow kernels).
TEST_F(FatbinOffline, TensorCoreRoutesUseTensorCores) {
  struct Want {
    std::string target, function, opcode, module = "w4a16";
  };
  const std::vector<Want> wants = {
      {"sm_90a", "gemm_tiled", "HGMMA"},
      {"sm_90a", "gemm_e4m3", "QGMMA"},
      {"sm_80", "gemm_decode", "HMMA"},
      {"sm_89", "gemm_decode", "HMMA"},
      {"sm_90a", "gemm_decode", "HMMA"},
      {"sm_80", "gemm_decode_packed", "HMMA"},
      {"sm_89", "gemm_decode_packed", "HMMA"},
      {"sm_90a", "gemm_decode_packed", "HMMA"},
      {"sm_90a", "gemm_fused", "HGMMA"},
      {"sm_90a", "gemm_grouped_fused", "HGMMA"},
      {"sm_90a", "gemm_grouped_int4_fused", "HGMMA"},
      {"sm_90a", "gemm_grouped_e4m3_block128_tiled", "QGMMA", "fp8"},
  };
  for (const auto& w : wants) {
    const Ran r = run(cuobjdump("-sass -arch " + w.target + " -fun " + w.function + " " +
                                quoted(module_named(w.module).fatbin)));
    ASSERT_EQ(r.status, 0) << r.output;
    // An unknown -fun or -arch still exits 0, with an empty listing.
    ASSERT_NE(r.output.find("Function : " + w.function + "\n"), std::string::npos)
        << "no SASS for " << w.function << " on " << w.target << ":\n"
        << r.output.substr(0, 2000);
    const int n = count_opcode(r.output, w.opcode);
    std::printf("%-7s %-32s %-6s x%d\n", w.target.c_str(), w.function.c_str(), w.opcode.c_str(), n);
    EXPECT_GT(n, 0) << w.function << " on " << w.target << " has no " << w.opcode;
  }
}

// The full opcodes (mnemonic with its modifiers, e.g. "STG.E.128") of a listing's instructions
// whose mnemonic is `mnemonic`.
std::vector<std::string> opcodes_of(const std::string& sass, const std::string& mnemonic) {
  std::vector<std::string> found;
  std::size_t pos = 0;
  while (pos < sass.size()) {
    const std::size_t eol = std::min(sass.find('\n', pos), sass.size());
    const std::string line = sass.substr(pos, eol - pos);
    pos = eol + 1;
    const std::size_t addr = line.find("/*"), close = line.find("*/");
    if (addr == std::string::npos || close == std::string::npos ||
        line.find_first_not_of(" \t") != addr) {
      continue;
    }
    std::size_t t = line.find_first_not_of(" \t", close + 2);
    if (t != std::string::npos && line[t] == '@')
      t = line.find_first_not_of(" \t", line.find(' ', t));
    if (t == std::string::npos) continue;
    const std::string opcode = line.substr(t, line.find_first_of(" ;", t) - t);
    if (opcode.substr(0, opcode.find('.')) == mnemonic) found.push_back(opcode);
  }
  return found;
}

// dequant_bf16 is bandwidth-bound (2.5625 bytes moved per NVFP4 weight, 2.53125 per MXFP4): on
// every target its stores are all 16 bytes wide (4 per 32 weights), its row-major codes come in
// by one 16-byte load, and it touches no local memory (a dynamically indexed table would).
TEST_F(FatbinOffline, DequantBf16MovesSixteenBytesPerAccess) {
  const Module& w4a16 = module_named("w4a16");
  for (const auto& target : kTargets) {
    const Ran r =
        run(cuobjdump("-sass -arch " + target + " -fun dequant_bf16 " + quoted(w4a16.fatbin)));
    ASSERT_EQ(r.status, 0) << r.output;
    ASSERT_NE(r.output.find("Function : dequant_bf16\n"), std::string::npos)
        << "no SASS for dequant_bf16 on " << target;
    const auto wide = [](const std::vector<std::string>& ops) {
      return std::count_if(ops.begin(), ops.end(), [](const std::string& o) {
        return o.find(".128") != std::string::npos;
      });
    };
    const auto stores = opcodes_of(r.output, "STG"), loads = opcodes_of(r.output, "LDG");
    std::printf("%-7s dequant_bf16: %zu STG (%ld of 16 B), %zu LDG (%ld of 16 B)\n", target.c_str(),
                stores.size(), static_cast<long>(wide(stores)), loads.size(),
                static_cast<long>(wide(loads)));
    EXPECT_GE(stores.size(), 4u) << target;
    EXPECT_EQ(wide(stores), static_cast<long>(stores.size()))
        << "dequant_bf16 on " << target << " has stores narrower than 16 bytes";
    EXPECT_GE(wide(loads), 1) << "dequant_bf16 on " << target << " has no 16-byte load";
    for (const char* local : {"LDL", "STL"}) {
      EXPECT_TRUE(opcodes_of(r.output, local).empty())
          << "dequant_bf16 on " << target << " uses local memory (" << local << ")";
    }
  }
}

// `cuobjdump -res-usage` of module m's fatbin, read once per process.
const metrale::offline::ResUsage& res_usage_of(const Module& m) {
  static std::map<std::string, metrale::offline::ResUsage> cache;
  if (auto it = cache.find(m.name); it != cache.end()) return it->second;
  const Ran r = run(cuobjdump("-res-usage " + quoted(m.fatbin)));
  if (r.status != 0) {
    throw std::runtime_error(fmt::format("cuobjdump -res-usage {} failed (status {}):\n{}",
                                         m.fatbin, r.status, r.output));
  }
  return cache.emplace(m.name, metrale::offline::parse_res_usage(r.output)).first->second;
}

// No kernel of any target spills to or allocates local memory (STACK and LOCAL both 0); the
// table records the register and shared-memory use in the ctest log.
TEST_F(FatbinOffline, NoStackOrLocalMemory) {
  std::printf("%-7s %-6s %-18s %5s %7s\n", "target", "module", "function", "REG", "SHARED");
  for (const auto& m : modules()) {
    const metrale::offline::ResUsage& all = res_usage_of(m);
    for (const auto& [target, functions] : all) {
      for (auto [function, usage] : functions) {
        std::printf("%-7s %-6s %-18s %5ld %7ld\n", target.c_str(), m.name.c_str(), function.c_str(),
                    usage.contains("REG") ? usage["REG"] : -1L,
                    usage.contains("SHARED") ? usage["SHARED"] : -1L);
        for (const char* key : {"STACK", "LOCAL"}) {
          EXPECT_TRUE(usage.contains(key) && usage[key] == 0)
              << m.name << " " << function << " on " << target << ": " << key
              << " is not 0 (spills or a local array)";
        }
      }
    }
    for (const auto& t : kTargets) {
      std::set<std::string> functions;
      if (auto it = all.find(t); it != all.end()) {
        for (const auto& [function, usage] : it->second) functions.insert(function);
      }
      EXPECT_EQ(functions, m.entries) << "resource usage of module " << m.name << " on " << t;
    }
  }
}

// A wave of a split-K or persistent grid is sm_count x <entry>_blocks_per_sm blocks, so every
// entry that publishes it must, on every target, fit that many blocks on one SM with the
// registers and static shared memory of its cubin (-res-usage REG, SHARED) and the dynamic
// shared memory and block it publishes; a kernel the op sizes by occupancy (one that splits K
// or is persistent) must publish it.
TEST_F(FatbinOffline, PublishedBlocksPerSmFitTheCubinsResources) {
  int checked = 0;
  for (const auto& m : modules()) {
    const metrale::offline::ResUsage& all = res_usage_of(m);
    for (const auto& c : cubins_of(m)) {
      SCOPED_TRACE(fmt::format("module {}, {}", m.name, c.target));
      const Published seen = published_in(m, c);
      const auto value = [&seen](const std::string& name) {
        const auto it = seen.find(name);
        return it == seen.end() ? 0u : it->second;
      };
      const metrale::offline::SmLimits* sm = metrale::offline::sm_limits(c.target);
      ASSERT_NE(sm, nullptr) << "no SM limits for target " << c.target << " (occupancy.cpp)";
      for (const auto& e : m.entries) {
        const std::uint32_t published = value(e + "_blocks_per_sm");
        if (value(e + "_split_k") != 0 || value(e + "_persistent") != 0) {
          EXPECT_NE(published, 0u) << e << " is sized by occupancy but publishes no blocks_per_sm";
        }
        if (published == 0) continue;
        const auto target = all.find(c.target);
        ASSERT_NE(target, all.end()) << "no resource usage for " << c.target;
        const auto usage = target->second.find(e);
        ASSERT_NE(usage, target->second.end()) << "no resource usage for " << e;
        const auto field = [&usage](const char* key) {
          const auto it = usage->second.find(key);
          return it == usage->second.end() ? 0L : it->second;
        };
        const metrale::offline::BlockResources block{
            field("REG"), field("SHARED"), value(e + "_smem_bytes"), value(e + "_block_threads")};
        const metrale::offline::Fit fit = metrale::offline::blocks_that_fit(*sm, block);
        std::printf(
            "%-7s %-18s publishes %u block(s)/SM; %ld fit (%s: REG %ld, SHARED %ld + %ld "
            "B, %ld threads)\n",
            c.target.c_str(), e.c_str(), published, fit.blocks, fit.limited_by.c_str(),
            block.registers_per_thread, block.static_shared, block.dynamic_shared, block.threads);
        EXPECT_LE(published, fit.blocks)
            << e << " publishes " << published << " blocks per SM, but on " << c.target << " only "
            << fit.blocks << " fit (limited by " << fit.limited_by << ")";
        ++checked;
      }
    }
  }
  // Twelve GEMM entries on sm_90a (the grouped FP8 tiled, fused INT4 and three grouped decode
  // ones among them), eight (no fused or tiled grouped kernels) on sm_80 and sm_89.
  EXPECT_EQ(checked, 28) << "entries checked; a lost blocks_per_sm must not pass unseen";
}

}  // namespace
