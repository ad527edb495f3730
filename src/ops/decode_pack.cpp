#include "ops/decode_pack.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <system_error>
#include <thread>

#include "kernels/decode_layout.h"
#include "metrale/error.h"
#include "metrale/numerics.h"
#include "ops/pack_source.h"

namespace metrale::ops {

namespace dl = decode_layout;

namespace {

constexpr const char* kApi = "pack_for_decode";

// The fold of MXFP4 weights: the largest finite E8M0 code present minus 128, so that its table
// entry is 2^127, BF16's largest power of two (0 with no finite code).
std::int32_t mxfp4_fold(const std::vector<std::uint8_t>& scales) {
  int largest = -1;
  for (const std::uint8_t c : scales) {
    if (c != 0xFF && c > largest) largest = c;
  }
  return largest < 0 ? 0 : largest - 128;
}

// Entry c of the table: scale(c) x 2^(126 - fold) as a BF16 pair. Every finite entry is a power
// of two (E8M0) or has 4 significant bits (E4M3), so float ldexp is exact down to float's
// subnormals and f32_to_bf16 rounds once, to nearest even; NaN stays NaN.
void write_table(bool mx, std::int32_t fold, std::uint8_t* out) {
  for (int c = 0; c < dl::kTableEntries; ++c) {
    const auto code = static_cast<std::uint8_t>(c);
    const float scale = mx ? num::e8m0_to_f32(code) : num::e4m3_to_f32(code);
    const std::uint32_t pair = num::bf16_pair_of(std::ldexp(scale, 126 - fold));
    std::memcpy(out + 4 * c, &pair, 4);
  }
}

// The bits a code byte (codes j = 2b and 2b + 1 of one row, low nibble first) sets in its word,
// for row half `upper` (row g + 8 of the register pair) and byte b of the 4 codes: one lookup
// per byte instead of a bit at a time.
struct WordTables {
  std::uint32_t bits[2][2][256];
};

const WordTables& word_tables() {
  static const WordTables t = [] {
    WordTables x{};
    for (int upper = 0; upper < 2; ++upper) {
      for (int b = 0; b < 2; ++b) {
        for (int byte = 0; byte < 256; ++byte) {
          std::uint32_t word = 0;
          for (int half = 0; half < 2; ++half) {
            const int code = (byte >> (4 * half)) & 0xF;
            for (int bit = 0; bit < 4; ++bit) {
              if ((code >> bit) & 1) {
                word |= 1u << dl::code_bit_position(2 * b + upper, half, bit);
              }
            }
          }
          x.bits[upper][b][byte] = word;
        }
      }
    }
    return x;
  }();
  return t;
}

// One tile x K block of the source, zero-padded: code bytes [32 rows][64] (low nibble = even k)
// and scale codes [32 rows][8 groups of 16, or 4 of 32].
struct Block {
  std::uint8_t codes[dl::kTileN][dl::kBlockK / 2];
  std::uint8_t scales[dl::kTileN][dl::kBlockK / 16];
};

void gather(const HostQuantWeights& w, std::int64_t tile, std::int64_t kb, Block& b) {
  const int group = group_size(w.format);
  const std::int64_t n0 = tile * dl::kTileN, k0 = kb * dl::kBlockK;
  const int rows = static_cast<int>(std::min<std::int64_t>(dl::kTileN, w.n - n0));
  const int bytes = static_cast<int>(std::min<std::int64_t>(dl::kBlockK, w.k - k0) / 2);
  const int groups = bytes * 2 / group;
  const std::int64_t row_bytes = w.k / 2, row_groups = w.k / group;
  // Only a block at the edge of N or K has padding to clear.
  if (rows < dl::kTileN || bytes < dl::kBlockK / 2) std::memset(&b, 0, sizeof b);
  if (w.layout == WeightLayout::kRowMajor) {
    for (int r = 0; r < rows; ++r) {
      std::memcpy(b.codes[r], w.codes.data() + (n0 + r) * row_bytes + k0 / 2, bytes);
      std::memcpy(b.scales[r], w.scales.data() + (n0 + r) * row_groups + k0 / group, groups);
    }
  } else {
    // Transposed: codes [K/2, N], scales [K/group, N]; each source row gives 32 contiguous bytes.
    for (int kk = 0; kk < bytes; ++kk) {
      const std::uint8_t* src = w.codes.data() + (k0 / 2 + kk) * w.n + n0;
      for (int r = 0; r < rows; ++r) b.codes[r][kk] = src[r];
    }
    for (int g = 0; g < groups; ++g) {
      const std::uint8_t* src = w.scales.data() + (k0 / group + g) * w.n + n0;
      for (int r = 0; r < rows; ++r) b.scales[r][g] = src[r];
    }
  }
}

// Writes one tile x K block: its 2048 code bytes at `codes` and its 32 lanes' scale codes at
// `scales`, in the order of decode_layout::code_slot and scale_byte.
void emit(const Block& b, bool mx, std::uint8_t* codes, std::uint8_t* scales) {
  const WordTables& t = word_tables();
  for (int chunk = 0; chunk < dl::kChunks; ++chunk) {
    for (int lane = 0; lane < dl::kLanes; ++lane) {
      const int g = lane / 4, lt = lane % 4;
      for (int q = 0; q < dl::kChunkBytes / 4; ++q) {
        // Word q of the chunk: step 2 chunk + q / 2, row tile q % 2 (rows g + 16 rt, + 8).
        const int s = 2 * chunk + q / 2, rt = q % 2;
        const int col = 16 * lt + 2 * s;  // byte of k = 32 t + 4 s in the block's rows
        const std::uint8_t* lo = b.codes[g + 16 * rt];
        const std::uint8_t* hi = b.codes[g + 16 * rt + 8];
        const std::uint32_t word = t.bits[0][0][lo[col]] | t.bits[0][1][lo[col + 1]] |
                                   t.bits[1][0][hi[col]] | t.bits[1][1][hi[col + 1]];
        std::memcpy(codes + chunk * (dl::kLanes * dl::kChunkBytes) + lane * dl::kChunkBytes + 4 * q,
                    &word, 4);
      }
    }
  }
  for (int lane = 0; lane < dl::kLanes; ++lane) {
    const int g = lane / 4, lt = lane % 4;
    std::uint8_t* out = scales + lane * dl::scale_bytes_per_lane(mx);
    for (int r = 0; r < 4; ++r) {
      if (mx) {
        out[r] = b.scales[g + 8 * r][lt];
      } else {
        out[2 * r] = b.scales[g + 8 * r][2 * lt];
        out[2 * r + 1] = b.scales[g + 8 * r][2 * lt + 1];
      }
    }
  }
}

std::uint32_t load_word(const std::uint8_t* p) {
  std::uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

void check_read(const char* api, const PackedDecodeWeights& p, std::int64_t n, std::int64_t k) {
  if (n < 0 || n >= dl::padded_n(p.n) || k < 0 || k >= dl::padded_k(p.k)) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("({}, {}) is outside the packed {} x {} weights (padded {} x {})", n, k,
                            p.n, p.k, dl::padded_n(p.n), dl::padded_k(p.k)));
  }
  const bool mx = p.format == WeightFormat::kMxfp4;
  if (p.codes.size() != static_cast<std::size_t>(dl::code_bytes(p.n, p.k)) ||
      p.scales.size() != static_cast<std::size_t>(dl::scale_bytes(p.n, p.k, mx))) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("packed buffers of {} and {} bytes do not fit {} x {}", p.codes.size(),
                            p.scales.size(), p.n, p.k));
  }
}

}  // namespace

PackedDecodeWeights pack_for_decode(const HostQuantWeights& w) {
  // N and K round up by at most 31 and 127.
  pack::check_source(kApi, w, dl::kTileN, dl::kBlockK);
  const bool mx = w.format == WeightFormat::kMxfp4;
  PackedDecodeWeights p;
  p.format = w.format;
  p.n = w.n;
  p.k = w.k;
  p.tensor_scale = w.tensor_scale;
  p.fold = mx ? mxfp4_fold(w.scales) : dl::kNvfp4Fold;
  p.codes.resize(static_cast<std::size_t>(dl::code_bytes(w.n, w.k)));
  p.scales.resize(static_cast<std::size_t>(dl::scale_bytes(w.n, w.k, mx)));
  write_table(mx, p.fold, p.scales.data());
  const std::int64_t tiles = dl::padded_n(w.n) / dl::kTileN, kbs = dl::k_blocks(w.k);
  const std::int64_t lane_scales = std::int64_t{dl::kLanes} * dl::scale_bytes_per_lane(mx);
  const auto pack_block = [&](Block& b, std::int64_t tile, std::int64_t kb) {
    const std::int64_t i = tile * kbs + kb;
    gather(w, tile, kb, b);
    emit(b, mx, p.codes.data() + i * dl::kTileBlockBytes,
         p.scales.data() + dl::kTableBytes + i * lane_scales);
  };
  // Blocks in the order the source is stored: tile by tile through K for row-major sources; for
  // transposed ones K block by K block across the tiles, so each source row of N codes is read
  // front to back (tile-major order uses 32 of every 64-byte line and must fetch the line again
  // for the next tile once a tile's 64 x 224 lines have been evicted).
  const bool transposed = w.layout == WeightLayout::kTransposed;
  const auto pack_tiles = [&](std::int64_t t0, std::int64_t t1) {
    Block b;
    if (transposed) {
      for (std::int64_t kb = 0; kb < kbs; ++kb) {
        for (std::int64_t tile = t0; tile < t1; ++tile) pack_block(b, tile, kb);
      }
    } else {
      for (std::int64_t tile = t0; tile < t1; ++tile) {
        for (std::int64_t kb = 0; kb < kbs; ++kb) pack_block(b, tile, kb);
      }
    }
  };
  // Tiles are independent: a large matrix is cut into one range of tiles per hardware thread,
  // each of at least kBlocksPerThread tile blocks (2 MiB of codes).
  constexpr std::int64_t kBlocksPerThread = 1024;
  pack::split(tiles, std::max<std::int64_t>(1, kBlocksPerThread / kbs), pack_tiles);
  return p;
}

std::uint8_t packed_code(const PackedDecodeWeights& p, std::int64_t n, std::int64_t k) {
  check_read("packed_code", p, n, k);
  const dl::CodeSlot slot = dl::code_slot(n, k, dl::k_blocks(p.k));
  const std::uint32_t word = load_word(p.codes.data() + slot.byte);
  std::uint8_t code = 0;
  for (int bit = 0; bit < 4; ++bit) {
    const int at = dl::code_bit_position(slot.reg, slot.half, bit);
    code = static_cast<std::uint8_t>(code | (((word >> at) & 1u) << bit));
  }
  return code;
}

std::uint8_t packed_scale_code(const PackedDecodeWeights& p, std::int64_t n, std::int64_t k) {
  check_read("packed_scale_code", p, n, k);
  const bool mx = p.format == WeightFormat::kMxfp4;
  return p.scales[static_cast<std::size_t>(dl::scale_byte(n, k, dl::k_blocks(p.k), mx))];
}

float packed_weight(const PackedDecodeWeights& p, std::int64_t n, std::int64_t k) {
  check_read("packed_weight", p, n, k);
  const std::uint16_t bits = dl::weight_bits(p.codes.data(), p.scales.data(), n, k,
                                             dl::k_blocks(p.k), p.format == WeightFormat::kMxfp4);
  return std::ldexp(num::bf16_to_f32(bits), p.fold);
}

}  // namespace metrale::ops
