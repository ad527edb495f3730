// pack_for_decode (ops/decode_pack.h): every code and scale code read back through the layout's
// own slot functions (kernels/decode_layout.h), the padding, every E2M1 code times every scale
// code against the host reference bit for bit, the MXFP4 fold and its range of exactness, the
// two source layouts, and the errors.
#include "ops/decode_pack.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/decode_layout.h"
#include "metrale/error.h"
#include "metrale/numerics.h"
#include "metrale/quant.h"
#include "support/random.h"

namespace metrale::ops {
namespace {

namespace dl = decode_layout;
using testing::rng;

// Row-major weights with uniformly random code and scale bytes (NaN scale codes included).
HostQuantWeights random_source(WeightFormat format, std::int64_t n, std::int64_t k) {
  HostQuantWeights w;
  w.format = format;
  w.n = n;
  w.k = k;
  w.codes.resize(static_cast<std::size_t>(n * k / 2));
  w.scales.resize(static_cast<std::size_t>(n * k / group_size(format)));
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& c : w.codes) c = static_cast<std::uint8_t>(byte(rng()));
  for (auto& s : w.scales) s = static_cast<std::uint8_t>(byte(rng()));
  return w;
}

// The source's scale code of W[n, k], in either layout.
std::uint8_t source_scale_code(const HostQuantWeights& w, std::int64_t n, std::int64_t k) {
  const int group = group_size(w.format);
  return w.layout == WeightLayout::kRowMajor ? w.scales[n * (w.k / group) + k / group]
                                             : w.scales[(k / group) * w.n + n];
}

// Entry `code` of the scales buffer's table (a BF16 pair).
std::uint32_t table_entry(const PackedDecodeWeights& p, int code) {
  std::uint32_t e;
  std::memcpy(&e, p.scales.data() + 4 * code, 4);
  return e;
}

// Bit-equal floats, or both NaN.
bool same_float(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return num::f32_bits(a) == num::f32_bits(b);
}

// Random shapes: N from 1 to 100 (mostly not a multiple of 32), K a multiple of the group, often
// not of 128.
struct Shape {
  std::int64_t n, k;
};
std::vector<Shape> shapes(WeightFormat format) {
  const std::int64_t group = group_size(format);
  std::vector<Shape> s = {{1, group}, {32, 128}, {33, 128 + group}, {31, 256 - group}};
  std::uniform_int_distribution<std::int64_t> n(1, 100), groups(1, 24);
  for (int i = 0; i < 6; ++i) s.push_back({n(rng()), groups(rng()) * group});
  return s;
}

TEST(DecodePack, EveryCodeAndScaleCodeReadsBackAndThePaddingIsZero) {
  for (const WeightFormat format : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    const bool mx = format == WeightFormat::kMxfp4;
    for (const Shape s : shapes(format)) {
      const HostQuantWeights row_major = random_source(format, s.n, s.k);
      for (const WeightLayout layout : {WeightLayout::kRowMajor, WeightLayout::kTransposed}) {
        const HostQuantWeights w = with_layout(row_major, layout);
        SCOPED_TRACE(fmt::format("{} n = {} k = {} {}", to_string(format), s.n, s.k,
                                 layout == WeightLayout::kRowMajor ? "row-major" : "transposed"));
        const PackedDecodeWeights p = pack_for_decode(w);
        ASSERT_EQ(p.codes.size(), static_cast<std::size_t>(dl::code_bytes(s.n, s.k)));
        ASSERT_EQ(p.scales.size(), static_cast<std::size_t>(dl::scale_bytes(s.n, s.k, mx)));
        std::int64_t bad = 0;
        for (std::int64_t n = 0; n < dl::padded_n(s.n); ++n) {
          for (std::int64_t k = 0; k < dl::padded_k(s.k); ++k) {
            const bool inside = n < s.n && k < s.k;
            const std::uint8_t code = inside ? w.code(n, k) : 0;
            const std::uint8_t scale = inside ? source_scale_code(w, n, k) : 0;
            if (packed_code(p, n, k) != code || packed_scale_code(p, n, k) != scale ||
                (!inside && packed_weight(p, n, k) != 0.0f)) {
              if (++bad <= 5) {
                ADD_FAILURE() << fmt::format(
                    "W[{}, {}]: code {} scale code {} weight {} read back, {} {} expected", n, k,
                    packed_code(p, n, k), packed_scale_code(p, n, k), packed_weight(p, n, k), code,
                    scale);
              }
            }
          }
        }
        EXPECT_EQ(bad, 0);
      }
    }
  }
}

TEST(DecodePack, ALargeMatrixPackedOnSeveralThreadsReadsBack) {
  // 32 x 65 = 2080 tile blocks: two or more threads where the machine has them.
  for (const WeightLayout layout : {WeightLayout::kRowMajor, WeightLayout::kTransposed}) {
    const HostQuantWeights w =
        with_layout(random_source(WeightFormat::kNvfp4, 1000, 8192 + 16), layout);
    const PackedDecodeWeights p = pack_for_decode(w);
    std::int64_t bad = 0;
    for (std::int64_t n = 0; n < w.n; ++n) {
      for (std::int64_t k = 0; k < w.k; ++k) {
        bad += packed_code(p, n, k) != w.code(n, k);
        if (k % 16 == 0) bad += packed_scale_code(p, n, k) != source_scale_code(w, n, k);
      }
    }
    EXPECT_EQ(bad, 0) << (layout == WeightLayout::kRowMajor ? "row-major" : "transposed");
  }
}

TEST(DecodePack, TransposedAndRowMajorSourcesPackToTheSameBytes) {
  for (const WeightFormat format : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    for (const Shape s : shapes(format)) {
      SCOPED_TRACE(fmt::format("{} n = {} k = {}", to_string(format), s.n, s.k));
      const HostQuantWeights w = random_source(format, s.n, s.k);
      const PackedDecodeWeights a = pack_for_decode(w);
      const PackedDecodeWeights b = pack_for_decode(with_layout(w, WeightLayout::kTransposed));
      EXPECT_EQ(a.codes, b.codes);
      EXPECT_EQ(a.scales, b.scales);
      EXPECT_EQ(a.fold, b.fold);
    }
  }
}

// One row per scale code in `codes` (all of its groups), each group's k the 16 E2M1 codes in turn.
HostQuantWeights every_code_times(WeightFormat format, const std::vector<int>& codes) {
  const int group = group_size(format);
  HostQuantWeights w;
  w.format = format;
  w.n = static_cast<std::int64_t>(codes.size());
  w.k = group;
  for (const int c : codes) {
    for (int k = 0; k < group; k += 2) {
      w.codes.push_back(static_cast<std::uint8_t>((k % 16) | ((k + 1) % 16) << 4));
    }
    w.scales.push_back(static_cast<std::uint8_t>(c));
  }
  return w;
}

// packed_weight(n, k) against HostQuantWeights::weight (tensor scale 1), bit for bit; returns
// the number of mismatches (the first few reported).
int mismatches(const PackedDecodeWeights& p, const HostQuantWeights& w, std::int64_t row) {
  int bad = 0;
  for (std::int64_t k = 0; k < w.k; ++k) {
    const float got = packed_weight(p, row, k), want = w.weight(row, k);
    if (!same_float(got, want) && ++bad <= 3) {
      ADD_FAILURE() << fmt::format("row {} (scale code {}) k {} (e2m1 code {}): {} != {}", row,
                                   source_scale_code(w, row, k), k, w.code(row, k), got, want);
    }
  }
  return bad;
}

TEST(DecodePack, EveryE4m3ScaleTimesEveryE2m1CodeIsExactAndNanStaysNan) {
  std::vector<int> all(256);
  for (int c = 0; c < 256; ++c) all[c] = c;
  const HostQuantWeights w = every_code_times(WeightFormat::kNvfp4, all);
  const PackedDecodeWeights p = pack_for_decode(w);
  EXPECT_EQ(p.fold, dl::kNvfp4Fold);
  EXPECT_EQ(table_entry(p, 0x7E), 0x7F607F60u);  // 448 x 2^119 = 1.75 x 2^127, BF16's top binade
  for (int c = 0; c < 256; ++c) EXPECT_EQ(mismatches(p, w, c), 0) << "E4M3 scale code " << c;
  for (const int nan : {0x7F, 0xFF}) EXPECT_TRUE(std::isnan(packed_weight(p, nan, 2)));
}

TEST(DecodePack, EveryE8m0ScaleAloneTimesEveryE2m1CodeIsExact) {
  // Each scale code as the tensor's only one: the fold puts it at 2^127 (NaN: fold 0).
  for (int c = 0; c < 256; ++c) {
    const HostQuantWeights w = every_code_times(WeightFormat::kMxfp4, {c});
    const PackedDecodeWeights p = pack_for_decode(w);
    EXPECT_EQ(p.fold, c == 255 ? 0 : c - 128) << "E8M0 code " << c;
    EXPECT_EQ(mismatches(p, w, 0), 0) << "E8M0 code " << c;
  }
  // The codes the header names, by value: 0 is 2^-127, 254 is 2^127, 255 NaN (code 2 is 1.0).
  const auto weight_of = [](int c) {
    return packed_weight(pack_for_decode(every_code_times(WeightFormat::kMxfp4, {c})), 0, 2);
  };
  EXPECT_EQ(weight_of(0), std::ldexp(1.0f, -127));
  EXPECT_EQ(weight_of(1), std::ldexp(1.0f, -126));
  EXPECT_EQ(weight_of(127), 1.0f);
  EXPECT_EQ(weight_of(253), std::ldexp(1.0f, 126));
  EXPECT_EQ(weight_of(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(weight_of(255)));
}

TEST(DecodePack, Mxfp4FoldsFromTheLargestFiniteCodeAndIsExactWithin133BinadesOfIt) {
  // Rows with scale codes 0..255 in one tensor: the largest finite code is 254 (255 is NaN and
  // does not count), so fold 126 and code c's table entry is 2^(c - 127).
  std::vector<int> all(256);
  for (int c = 0; c < 256; ++c) all[c] = c;
  const HostQuantWeights w = every_code_times(WeightFormat::kMxfp4, all);
  const PackedDecodeWeights p = pack_for_decode(w);
  ASSERT_EQ(p.fold, 126);
  EXPECT_EQ(table_entry(p, 254), 0x7F007F00u);  // the largest code's entry is 2^127
  EXPECT_EQ(pack_for_decode(every_code_times(WeightFormat::kMxfp4, {3, 255, 200})).fold, 72);
  EXPECT_EQ(pack_for_decode(every_code_times(WeightFormat::kMxfp4, {255, 255})).fold, 0);
  for (int c = 254 - 133; c <= 254; ++c) EXPECT_EQ(mismatches(p, w, c), 0) << "E8M0 code " << c;
  for (int c = 0; c < 254 - 133; ++c) {
    int inexact = 0;
    for (std::int64_t k = 0; k < w.k; ++k) {
      // Below: the weight x 2^-fold rounded to nearest even in BF16 (subnormals, then 0).
      const double exact = static_cast<double>(w.weight(c, k));
      const float scaled = static_cast<float>(std::ldexp(exact, -p.fold));
      const float want = std::ldexp(num::bf16_to_f32(num::f32_to_bf16(scaled)), p.fold);
      const float got = packed_weight(p, c, k);
      EXPECT_TRUE(same_float(got, want)) << fmt::format("code {} k {}: {} != {}", c, k, got, want);
      inexact += got != w.weight(c, k);
    }
    // 0.5 x 2^(c - 127) is the first weight to leave the range.
    EXPECT_NE(packed_weight(p, c, 1), w.weight(c, 1)) << "E8M0 code " << c;
    EXPECT_GT(inexact, 0) << "E8M0 code " << c;
  }
  EXPECT_EQ(packed_weight(p, 0, 7), 0.0f);  // 6 x 2^-127 x 2^-126: flushed
  EXPECT_TRUE(std::isnan(packed_weight(p, 255, 2)));
}

// Whether pack_for_decode(w) throws Error(kInvalidArgument) naming itself and every fragment.
void expect_rejected(const HostQuantWeights& w, const std::vector<std::string>& fragments) {
  try {
    pack_for_decode(w);
    ADD_FAILURE() << "accepted; expected an error naming " << fragments.front();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_EQ(e.api(), "pack_for_decode") << e.what();
    for (const std::string& f : fragments) {
      EXPECT_NE(e.message().find(f), std::string::npos) << e.what() << " lacks " << f;
    }
  }
}

// Source buffers of the sizes n x k asks for (k / group rounded down), so only the shape is bad.
HostQuantWeights sized(WeightFormat format, std::int64_t n, std::int64_t k) {
  HostQuantWeights w;
  w.format = format;
  w.n = n;
  w.k = k;
  w.codes.assign(static_cast<std::size_t>(std::max<std::int64_t>(0, n * k / 2)), 0x21);
  w.scales.assign(static_cast<std::size_t>(std::max<std::int64_t>(0, n * (k / group_size(format)))),
                  1);
  return w;
}

TEST(DecodePack, BadShapesAndSizesAreErrorsNamingTheValue) {
  expect_rejected(sized(WeightFormat::kMxfp4, 0, 96), {"n = 0"});
  expect_rejected(sized(WeightFormat::kMxfp4, -3, 96), {"n = -3"});
  expect_rejected(sized(WeightFormat::kNvfp4, 4, 0), {"k = 0"});
  expect_rejected(sized(WeightFormat::kNvfp4, 4, -16), {"k = -16"});
  // A multiple of 16, not of MXFP4's 32; and not of NVFP4's 16.
  expect_rejected(sized(WeightFormat::kMxfp4, 40, 80), {"k = 80", "32"});
  expect_rejected(sized(WeightFormat::kNvfp4, 4, 24), {"k = 24", "16"});
  const HostQuantWeights good = random_source(WeightFormat::kMxfp4, 40, 96);
  HostQuantWeights w = good;
  w.codes.pop_back();
  expect_rejected(w, {std::to_string(good.codes.size()), std::to_string(good.codes.size() - 1)});
  w = good;
  w.scales.push_back(0);
  expect_rejected(w, {std::to_string(good.scales.size()), std::to_string(good.scales.size() + 1)});
  w = good;
  w.n = std::int64_t{1} << 62;
  expect_rejected(w, {std::to_string(w.n)});
  w = good;
  w.format = static_cast<WeightFormat>(7);
  expect_rejected(w, {"format 7"});
  w = good;
  w.layout = static_cast<WeightLayout>(5);
  expect_rejected(w, {"layout 5"});
  // The read-backs refuse a position outside the padded weights.
  const PackedDecodeWeights p = pack_for_decode(good);
  EXPECT_THROW(packed_code(p, dl::padded_n(40), 0), Error);
  EXPECT_THROW(packed_scale_code(p, 0, dl::padded_k(96)), Error);
  EXPECT_THROW(packed_weight(p, -1, 0), Error);
}

// The repack of the largest Llama-3 matrix, timed (run by hand:
// ops_tests --gtest_also_run_disabled_tests --gtest_filter=*DISABLED_Times*).
TEST(DecodePack, DISABLED_TimesTheRepackOf8192x28672) {
  for (const WeightFormat format : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    const HostQuantWeights row_major = random_source(format, 8192, 28672);
    for (const WeightLayout layout : {WeightLayout::kRowMajor, WeightLayout::kTransposed}) {
      const HostQuantWeights w = with_layout(row_major, layout);
      for (int rep = 0; rep < 3; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        const PackedDecodeWeights p = pack_for_decode(w);
        const auto t1 = std::chrono::steady_clock::now();
        std::cout << fmt::format("pack_for_decode 8192 x 28672 {} {}: {:.1f} ms ({} threads)\n",
                                 to_string(format),
                                 layout == WeightLayout::kRowMajor ? "row-major" : "transposed",
                                 std::chrono::duration<double, std::milli>(t1 - t0).count(),
                                 std::thread::hardware_concurrency());
      }
    }
  }
}

}  // namespace
}  // namespace metrale::ops
