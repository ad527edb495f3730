// Shared pieces of the w4a16 GEMM contract suite (gemm_test.cpp, gemm_contract_test.cpp,
// gemm_modules_test.cpp, cast_e4m3_test.cpp): fresh random data, the float64 reference and the
// tolerances, and a fixture parameterized over every backend that exists.
//
// The reference, the comparison and the tolerances with their derivation live in the toolkit
// (tools/toolkit: toolkit/gemm_reference.h and toolkit/gemm_tolerance.h), so that `metrale
// check`, `metrale bench` and the benchmarks hold a result to the same bounds as this suite.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/published.h"
#include "metrale/backend.h"
#include "metrale/dense_gemm.h"
#include "metrale/error.h"
#include "metrale/numerics.h"
#include "metrale/op_cache.h"
#include "metrale/ops/gemm.h"
#include "metrale/quant.h"
#include "metrale/runtime.h"
#include "support/log_capture.h"
#include "toolkit/gemm_reference.h"
#include "toolkit/gemm_tolerance.h"

namespace metrale::testing::gemm {

// ---- tolerances and the reference (tools/toolkit) ----

using toolkit::activation;
using toolkit::AMode;
using toolkit::compare;
using toolkit::Comparison;
using toolkit::element_bound;
using toolkit::kAccumUnit;
using toolkit::kBf16Unit;
using toolkit::kE4m3StatMinActs;
using toolkit::kE4m3StatMinOutputs;
using toolkit::kE4m3VsExactTol;
using toolkit::kFp8MmaTerm;
using toolkit::kNormTol;
using toolkit::kPoisonBf16;
using toolkit::kPoisonByte;
using toolkit::Reference;
using toolkit::reference;

// BF16 elements after C that no GEMM may touch.
inline constexpr std::size_t kTailElems = 24;

inline std::uint64_t fresh_seed() {
  std::random_device rd;
  return (std::uint64_t{rd()} << 32) | rd();
}

// ---- random data ----

// BF16 activations: random sign, magnitude 2^U(lo, hi) rounded to BF16. With the default
// [-10, 3] about 30% fall in E4M3's subnormal range (below 2^-6) and none saturates (≤ 448).
inline std::vector<std::uint16_t> random_activations(std::mt19937_64& gen, std::size_t count,
                                                     double log2_lo = -10.0, double log2_hi = 3.0) {
  std::uniform_real_distribution<double> e(log2_lo, log2_hi);
  std::bernoulli_distribution neg(0.5);
  std::vector<std::uint16_t> a(count);
  for (std::uint16_t& x : a) {
    const auto mag = static_cast<float>(std::exp2(e(gen)));
    x = num::f32_to_bf16(neg(gen) ? -mag : mag);
  }
  return a;
}

// FP32 weights [n, k]: normal values times 2^j per block of 16 k (j uniform in [-4, 4]), so
// neighbouring block scales differ by up to 2^8 and a kernel that reads the wrong scale, or the
// wrong nibble, is far off.
inline std::vector<float> random_weight_values(std::mt19937_64& gen, std::int64_t n,
                                               std::int64_t k) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> octave(-4, 4);
  std::vector<float> w(static_cast<std::size_t>(n * k));
  for (std::int64_t i = 0; i < n * k; i += 16) {
    const float block = std::ldexp(1.0f, octave(gen));
    for (std::int64_t j = i; j < i + 16 && j < n * k; ++j) {
      w[static_cast<std::size_t>(j)] = normal(gen) * block;
    }
  }
  return w;
}

inline HostQuantWeights quantize(WeightFormat format, std::span<const float> w, std::int64_t n,
                                 std::int64_t k) {
  return format == WeightFormat::kNvfp4 ? quantize_nvfp4(w, n, k) : quantize_mxfp4(w, n, k);
}

// BF16 bias [n]: uniform in [-64, 64], on the scale of the outputs of random_activations times
// random_weight_values over the K of the tests (tens to a thousand), so that a bias dropped, or
// added once per K slice, is far outside the per-element bound. A bias in [-2, 2] hid under it: a
// reference without the bias passed the grouped split-K test for 15 of 20 seeds.
inline std::vector<std::uint16_t> random_bias(std::mt19937_64& gen, std::int64_t n) {
  std::uniform_real_distribution<float> u(-64.0f, 64.0f);
  std::vector<std::uint16_t> b(static_cast<std::size_t>(n));
  for (std::uint16_t& x : b) x = num::f32_to_bf16(u(gen));
  return b;
}

// Every element written, not all zero, the normalized error within tol and every element within
// its bound.
inline void expect_close(const Comparison& c, double tol, const std::string& what) {
  EXPECT_GT(c.ref_norm, 0.0) << what << ": the reference is all zero";
  EXPECT_GT(c.nonzero, 0) << what << ": the output is all zero";
  EXPECT_EQ(c.unwritten, 0) << what << ": " << c.str();
  EXPECT_LE(c.normalized, tol) << what << ": " << c.str();
  EXPECT_LE(c.worst, 1.0) << what << ": " << c.str();
}

// ---- backends ----

// The backend called `name`, or why the suite cannot run on it (no such backend on this
// machine, or no w4a16 module).
struct BackendOrReason {
  std::unique_ptr<Backend> backend;
  std::string reason;
};

inline BackendOrReason make_backend(std::string_view name) {
  BackendOrReason r;
  try {
    r.backend = create_backend(name);
  } catch (const Error& e) {
    r.reason = fmt::format("backend '{}' is unavailable: {}", name, e.what());
    return r;
  }
  if (!r.backend->has_module("w4a16")) {
    std::vector<std::string> names;
    for (const ModuleListing& m : r.backend->modules()) names.push_back(m.name);
    r.reason =
        fmt::format("backend '{}' has no w4a16 module (loaded: {})", name, fmt::join(names, ", "));
    r.backend.reset();
  }
  return r;
}

// Whether backend's w4a16 module provides entry.
inline bool module_provides(Backend& backend, std::string_view entry) {
  for (const ModuleListing& m : backend.modules()) {
    if (m.name != "w4a16") continue;
    return std::find(m.kernels.begin(), m.kernels.end(), entry) != m.kernels.end();
  }
  return false;
}

// Whether the automatic route and layout may choose backend's w4a16 entry: the module provides
// it and a device run verified it (core/published.h; a host module's entries are the reference).
inline bool auto_may_choose(Backend& backend, std::string_view entry) {
  return module_provides(backend, entry) &&
         automatic_choice_allowed(backend.op_cache().kernel(backend, "w4a16", entry).meta);
}

inline std::string backend_name(const ::testing::TestParamInfo<std::string>& info) {
  return info.param;
}

// Parameterized over the backends: every test runs on "cpu" and on "cuda" (which skips, saying
// why, where CUDA or its w4a16 module is missing). Owns the backend, a stream and the buffers a
// test allocates; at the end frees them and releases the OpCache scratch.
class GemmBackendTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    BackendOrReason r = make_backend(GetParam());
    if (!r.backend) GTEST_SKIP() << r.reason;
    backend_ = std::move(r.backend);
    stream_ = backend_->create_stream();
    seed_ = fresh_seed();
    gen_.seed(seed_);
    // Every test's data comes from this seed (numerics tests also SCOPED_TRACE it).
    std::cout << "[ SEED     ] " << seed_ << "\n";
  }

  void TearDown() override {
    if (!backend_) return;
    free_all();
    backend_->destroy_stream(stream_);
    backend_->op_cache().release(*backend_);
    // Scratch that grew left its smaller buffers on the ledger (OpCache::scratch is grow-only
    // and never frees a buffer queued work may still read): sweep them without the warning.
    const LogCapture quiet(log::Level::kError);
    backend_->sweep_unreleased();
  }

  Backend& b() { return *backend_; }
  // Frees every buffer the test allocated so far (after the work queued on its stream).
  void free_all() {
    backend_->synchronize(stream_);
    for (const DevicePtr p : owned_) backend_->free(p);
    owned_.clear();
  }
  StreamHandle stream() const { return stream_; }
  std::uint64_t seed() const { return seed_; }
  std::mt19937_64& gen() { return gen_; }

  // A device buffer of bytes, freed at the end of the test.
  DevicePtr alloc(std::size_t bytes) {
    const DevicePtr p = backend_->alloc(bytes);
    owned_.push_back(p);
    return p;
  }
  template <class T>
  DevicePtr upload(std::span<const T> host) {
    const DevicePtr p = alloc(std::max<std::size_t>(host.size_bytes(), 1));
    backend_->copy_h2d(p, host.data(), host.size_bytes());
    return p;
  }
  template <class T>
  DevicePtr upload(const std::vector<T>& host) {
    return upload(std::span<const T>(host));
  }
  // bytes filled with the poison.
  DevicePtr poisoned(std::size_t bytes) {
    const DevicePtr p = alloc(bytes);
    backend_->memset(p, kPoisonByte, bytes);
    return p;
  }
  // count elements read back after the work queued on the test's stream.
  template <class T>
  std::vector<T> read(DevicePtr p, std::size_t count) {
    std::vector<T> out(count);
    backend_->copy_d2h_after(out.data(), p, count * sizeof(T), stream_);
    return out;
  }
  // Weights uploaded for the test (freed with its buffers).
  ops::QuantWeights upload_weights(const HostQuantWeights& w,
                                   ops::UploadLayout layout = ops::UploadLayout::kSource) {
    ops::QuantWeights d = ops::upload_weights(*backend_, w, layout);
    owned_.push_back(d.codes);
    owned_.push_back(d.scales);
    return d;
  }

 private:
  std::unique_ptr<Backend> backend_;
  StreamHandle stream_;
  std::vector<DevicePtr> owned_;
  std::uint64_t seed_ = 0;
  std::mt19937_64 gen_;
};

// The W8A8 op's numerics instances: as GemmBackendTest, and a backend without the kE4m3Block128
// dense GEMM skips, saying why.
class W8a8BackendTest : public GemmBackendTest {
 protected:
  void SetUp() override {
    GemmBackendTest::SetUp();
    if (IsSkipped()) return;
    if (std::string why = b().dense_gemm_unavailable(DenseKind::kE4m3Block128); !why.empty())
      GTEST_SKIP() << why;
  }
};

}  // namespace metrale::testing::gemm
