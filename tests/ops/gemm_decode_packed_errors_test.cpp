// Bad input around weights in the decode layout, on the CPU backend: routes that cannot read the
// layout, a plan made for the other layout or another fold, packed descriptions whose sizes or
// fold are wrong, host weights the packer refuses, and allocations that fail during a packed
// upload. Each error names the call and the bad value, and the backend's ledger ends where it
// started.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "kernels/decode_layout.h"
#include "kernels/gemm_params.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"
#include "metrale/ops/gemm.h"
#include "metrale/ops/quant_weights.h"
#include "ops/decode_pack.h"
#include "ops/gemm_reference.h"
#include "support/cpu_faults.h"
#include "support/log_capture.h"

namespace metrale::ops {
namespace {

namespace ref = metrale::testing::gemm;
using metrale::testing::expect_error;
using metrale::testing::failing_call;
using ::testing::HasSubstr;

constexpr std::int64_t kN = 45, kK = 160, kM = 3;

// A CPU backend with one layer's buffers: the same weights in both layouts, A, C and a bias.
class PackedErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    b_ = std::make_unique<CpuBackend>(CpuBackendOptions{builtin_host_modules(), 1});
    start_ = b_->live_bytes();
    std::mt19937_64 gen(ref::fresh_seed());
    host_ = ref::quantize(WeightFormat::kNvfp4, ref::random_weight_values(gen, kN, kK), kN, kK);
    source_ = upload_weights(*b_, host_, UploadLayout::kSource);
    packed_ = upload_weights(*b_, host_, UploadLayout::kDecode);
    a_ = b_->alloc(kM * kK * 2);
    b_->memset(a_, 0, kM * kK * 2);
    c_ = b_->alloc(kM * kN * 2);
  }
  void TearDown() override {
    free_weights(*b_, source_);
    free_weights(*b_, packed_);
    b_->free(a_);
    b_->free(c_);
    b_->op_cache().release(*b_);
    EXPECT_EQ(b_->live_bytes(), start_) << b_->alloc_report();
  }

  // The error of both planning and the one-call GEMM on w.
  void expect_refused(const QuantWeights& w, const GemmOptions& opt, ErrorCode code,
                      const std::string& what) {
    const std::size_t allocs_before = b_->alloc_stats().allocation_count;
    const Error p = expect_error([&] { (void)plan(*b_, kM, w, opt); });
    EXPECT_EQ(p.code(), code);
    EXPECT_THAT(p.what(), HasSubstr("[plan] " + what));
    const Error g =
        expect_error([&] { w4a16_gemm(*b_, b_->default_stream(), a_, kM, w, c_, opt); });
    EXPECT_EQ(g.code(), code);
    EXPECT_THAT(g.what(), HasSubstr("[w4a16_gemm] " + what));
    // Refused before any scratch was taken.
    EXPECT_EQ(b_->alloc_stats().allocation_count, allocs_before);
  }

  std::unique_ptr<CpuBackend> b_;
  std::size_t start_ = 0;
  HostQuantWeights host_;
  QuantWeights source_, packed_;
  DevicePtr a_, c_;
};

TEST_F(PackedErrors, RoutesThatReadTheSourceLayoutAreRefusedNamingTheRoute) {
  GemmOptions tiled;
  tiled.route = GemmRoute::kTiled;
  expect_refused(packed_, tiled, ErrorCode::kInvalidArgument,
                 "route tiled reads weights in their source layout, but these were uploaded in "
                 "the decode layout");
  GemmOptions e4m3;
  e4m3.route = GemmRoute::kE4m3;
  e4m3.activations = Activations::kAllowE4m3;
  expect_refused(packed_, e4m3, ErrorCode::kInvalidArgument,
                 "route e4m3 reads weights in their source layout, but these were uploaded in "
                 "the decode layout");
  // The decode route, forced or chosen, takes them; above the decode sizes the fused route is
  // chosen (both read the decode layout).
  GemmOptions decode;
  decode.route = GemmRoute::kDecode;
  EXPECT_EQ(plan(*b_, kM, packed_, decode).route, GemmRoute::kDecode);
  EXPECT_EQ(plan(*b_, 100, packed_, decode).route, GemmRoute::kDecode);
  EXPECT_EQ(plan(*b_, 100, packed_).route, GemmRoute::kFused);
}

// A plan edited to say other weights than the ones its kernel flags were made for is refused
// before anything launches: the packed kernel on source-layout buffers, or the transposed flag
// on row-major codes.
TEST_F(PackedErrors, RunRefusesAPlanWhoseFlagsDoNotSayItsWeights) {
  const StreamHandle s = b_->default_stream();
  GemmPlan edited = plan(*b_, kM, packed_);
  edited.packing = WeightPacking::kSource;
  edited.fold = 0;
  const Error e1 =
      expect_error([&] { run(edited, s, a_, source_, c_, scratch_workspace(edited, s)); });
  EXPECT_EQ(e1.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e1.what(), HasSubstr("[run] the plan's kernel flags are 0x8, but its weights (nvfp4 "
                                   "row-major, source layout) need 0x0"));
  GemmPlan relaid = plan(*b_, kM, source_);
  relaid.flags |= kGemmTransposed;
  const Error e2 =
      expect_error([&] { run(relaid, s, a_, source_, c_, scratch_workspace(relaid, s)); });
  EXPECT_EQ(e2.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e2.what(), HasSubstr("[run] the plan's kernel flags are 0x2, but its weights"));
}

TEST_F(PackedErrors, RunRefusesWeightsInAnotherLayoutOrFoldThanThePlan) {
  const GemmPlan for_source = plan(*b_, kM, source_);
  const GemmPlan for_packed = plan(*b_, kM, packed_);
  const StreamHandle s = b_->default_stream();
  ASSERT_EQ(packed_.fold, 7);  // NVFP4's
  const Error e1 =
      expect_error([&] { run(for_source, s, a_, packed_, c_, scratch_workspace(for_source, s)); });
  EXPECT_EQ(e1.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e1.what(), HasSubstr("[run] weights are in the decode layout (fold 7); the plan is "
                                   "for the source layout (fold 0)"));
  const Error e2 =
      expect_error([&] { run(for_packed, s, a_, source_, c_, scratch_workspace(for_packed, s)); });
  EXPECT_EQ(e2.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e2.what(), HasSubstr("[run] weights are in the source layout (fold 0); the plan is "
                                   "for the decode layout (fold 7)"));
  QuantWeights refolded = packed_;
  refolded.fold = 6;
  const Error e3 =
      expect_error([&] { run(for_packed, s, a_, refolded, c_, scratch_workspace(for_packed, s)); });
  EXPECT_EQ(e3.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e3.what(), HasSubstr("[run] weights are in the decode layout (fold 6); the plan is "
                                   "for the decode layout (fold 7)"));
  // A plan whose own fold was edited is refused the same way.
  GemmPlan edited = for_packed;
  edited.fold = -3;
  const Error e4 =
      expect_error([&] { run(edited, s, a_, packed_, c_, scratch_workspace(edited, s)); });
  EXPECT_THAT(e4.what(), HasSubstr("the plan is for the decode layout (fold -3)"));
  // The matching pairs run.
  run(for_packed, s, a_, packed_, c_, scratch_workspace(for_packed, s));
  run(for_source, s, a_, source_, c_, scratch_workspace(for_source, s));
  b_->synchronize(s);
}

TEST_F(PackedErrors, PackedWeightsWithWrongSizesOrAFoldOutOfRangeAreRefused) {
  const std::string sizes = fmt::format("in the decode layout needs {} and {}", packed_.codes_bytes,
                                        packed_.scales_bytes);
  QuantWeights w = packed_;
  w.codes_bytes -= 16;
  expect_refused(w, {}, ErrorCode::kInvalidArgument,
                 fmt::format("packed weight codes and scales are {} and {} bytes; nvfp4 45x160 {}",
                             w.codes_bytes, w.scales_bytes, sizes));
  w = packed_;
  w.scales_bytes += 4;
  expect_refused(w, {}, ErrorCode::kInvalidArgument,
                 fmt::format("packed weight codes and scales are {} and {} bytes; nvfp4 45x160 {}",
                             w.codes_bytes, w.scales_bytes, sizes));
  // The source layout's sizes are not the decode layout's.
  w = packed_;
  w.codes_bytes = source_.codes_bytes;
  w.scales_bytes = source_.scales_bytes;
  expect_refused(w, {}, ErrorCode::kInvalidArgument,
                 fmt::format("packed weight codes and scales are {} and {} bytes",
                             source_.codes_bytes, source_.scales_bytes));
  for (const std::int32_t fold : {128, -129, 1 << 20}) {
    w = packed_;
    w.fold = fold;
    expect_refused(w, {}, ErrorCode::kInvalidArgument,
                   fmt::format("packed weights fold {}; it must lie in [-128, 127]", fold));
  }
  // The ends of the range are fine.
  for (const std::int32_t fold : {-128, 127}) {
    w = packed_;
    w.fold = fold;
    EXPECT_EQ(plan(*b_, kM, w).fold, fold);
  }
}

// Padded sizes that 64 bits cannot count: N = 2^32 rows of K = 2^32 - 16 pad to 2^32 x 2^32
// codes, 2^63 bytes, past what a signed 64-bit product holds (it wrapped to 0, so a description
// claiming an empty codes buffer passed). Planning only: the buffers are never read.
TEST_F(PackedErrors, PaddedSizesPast64BitsAreRefused) {
  QuantWeights w = packed_;
  w.n = std::int64_t{1} << 32;
  w.k = (std::int64_t{1} << 32) - 16;
  w.codes_bytes = 0;
  w.scales_bytes = static_cast<std::size_t>(decode_layout::scale_bytes(w.n, w.k, false));
  const Error e = expect_error([&] { (void)plan(*b_, 1, w); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[plan] the packed weights would be 4294967296 x 4294967296 x "
                                  "1 bytes, more than 64 bits can count"));
}

// The upload's device memory: what the ledger counted (allocations ever made) and holds.
struct Ledger {
  std::size_t made, live;
  explicit Ledger(const Backend& b)
      : made(b.alloc_stats().allocation_count), live(b.live_alloc_count()) {}
};

TEST(PackedUpload, HostWeightsThePackerRefusesAllocateNothing) {
  CpuBackend b(CpuBackendOptions{builtin_host_modules(), 1});
  std::mt19937_64 gen(ref::fresh_seed());
  const HostQuantWeights good =
      ref::quantize(WeightFormat::kNvfp4, ref::random_weight_values(gen, 8, 64), 8, 64);
  const auto expect_packer_refuses = [&](const HostQuantWeights& w, const std::string& what) {
    const Ledger before(b);
    const Error e = expect_error([&] { WeightsResource r(b, w, "bad", UploadLayout::kDecode); });
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(e.what(), HasSubstr("[pack_for_decode]"));
    EXPECT_THAT(e.what(), HasSubstr(what));
    EXPECT_EQ(b.alloc_stats().allocation_count, before.made);
    EXPECT_EQ(b.live_alloc_count(), before.live);
    const Error e2 = expect_error([&] { (void)upload_weights(b, w, UploadLayout::kDecode); });
    EXPECT_THAT(e2.what(), HasSubstr("[pack_for_decode]"));
    EXPECT_EQ(b.alloc_stats().allocation_count, before.made);
  };
  HostQuantWeights ragged_k = good;  // K not a multiple of NVFP4's 16
  ragged_k.k = 56;
  ragged_k.codes.resize(8 * 56 / 2);
  ragged_k.scales.resize(8 * 4);
  expect_packer_refuses(ragged_k, "56");
  HostQuantWeights short_codes = good;
  short_codes.codes.resize(short_codes.codes.size() - 1);
  expect_packer_refuses(short_codes, fmt::format("{}", short_codes.codes.size()));
  HostQuantWeights short_scales = good;
  short_scales.scales.resize(short_scales.scales.size() - 2);
  expect_packer_refuses(short_scales, fmt::format("{}", short_scales.scales.size()));
  EXPECT_EQ(b.live_bytes(), 0u);
}

// Every fallible backend call of a packed upload made to fail in turn: copies fail with a driver
// error; an allocation's failure is out of memory, which the weights policy answers with
// managed memory, so allocations are also swept with device memory full (the managed ones then
// fail). Each upload either succeeds in the decode layout or throws having freed what it
// allocated.
TEST(PackedUpload, AFailedCallDuringAPackedUploadFreesWhatWasAllocated) {
  std::mt19937_64 gen(ref::fresh_seed());
  const HostQuantWeights host =
      ref::quantize(WeightFormat::kMxfp4, ref::random_weight_values(gen, 40, 96), 40, 96);
  const PackedDecodeWeights packed = pack_for_decode(host);
  std::size_t calls = 0;
  {
    CpuBackend b(CpuBackendOptions{builtin_host_modules(), 1});
    CpuFaults f;
    f.record_calls = true;
    b.set_faults(f);
    WeightsResource r(b, host, "packed", UploadLayout::kDecode);
    calls = b.fault_calls().size();
    r.release(b);
  }
  ASSERT_GE(calls, 4u) << "two allocations and two copies at least";
  for (const bool device_full : {false, true}) {
    SCOPED_TRACE(device_full ? "allocations, device memory full" : "every call");
    std::size_t failures = 0;
    for (std::uint64_t at = 1; at <= calls; ++at) {
      SCOPED_TRACE(fmt::format("call #{} fails", at));
      CpuBackend b(CpuBackendOptions{builtin_host_modules(), 1});
      b.set_faults(failing_call(at, device_full));
      const metrale::testing::LogCapture quiet(log::Level::kError);  // the managed-memory warning
      try {
        WeightsResource r(b, host, "packed", UploadLayout::kDecode);
        const QuantWeights& w = r.weights();
        EXPECT_EQ(w.packing, WeightPacking::kDecode);
        std::vector<std::uint8_t> codes(w.codes_bytes), scales(w.scales_bytes);
        b.copy_d2h(codes.data(), w.codes, codes.size());
        b.copy_d2h(scales.data(), w.scales, scales.size());
        EXPECT_EQ(codes, packed.codes);
        EXPECT_EQ(scales, packed.scales);
        r.release(b);
      } catch (const Error& e) {
        ++failures;
        EXPECT_THAT(e.what(), HasSubstr("injected failure"));
      }
      EXPECT_EQ(b.live_alloc_count(), 0u) << b.alloc_report();
      EXPECT_EQ(b.live_bytes(), 0u);
    }
    // Every call: the two copies. Device memory full: the codes' managed fallback, and the
    // scales' after the codes' succeeded.
    EXPECT_GE(failures, 2u);
  }
}

}  // namespace
}  // namespace metrale::ops
