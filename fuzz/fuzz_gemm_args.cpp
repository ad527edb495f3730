// Fuzz target: the argument checks of the public ops (include/metrale/ops/gemm.h and
// elementwise.h) on the CPU backend. The input is decoded into one call (w4a16_gemm,
// choose_route, cast_bf16_to_e4m3, upload_weights, fill_u32 or axpy_f32) with its shapes (small
// enough that a valid call runs in microseconds, or any 64-bit value), format, layout, route,
// and a choice for every pointer: a buffer of exactly the size the call needs, one too short or
// too long, an offset (misaligned or interior) into a larger one, null, memory the backend never
// allocated, a freed buffer, or a pointer into another argument's buffer.
//
// The harness works out on its own whether the call is valid (the checks listed in the headers,
// plus: every range the call reads or writes lies inside one live allocation of the backend), and
// requires (any break is __builtin_trap(), so libFuzzer keeps the input):
//  - a valid call succeeds, writes its output range and nothing else;
//  - an invalid call throws metrale::Error (kInvalidArgument, or kOutOfMemory for an injected
//    allocation failure) whose message starts with "[<api>] ", and then nothing was written
//    anywhere (every buffer and the foreign memory still hold what they held) and nothing
//    leaked (live_bytes() and live_alloc_count() are what they were);
//  - no other exception type, and no sanitizer report (ASan + UBSan, no recovery).
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "core/log.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"
#include "metrale/ops/elementwise.h"
#include "metrale/ops/gemm.h"
#include "metrale/quant.h"

namespace {

using namespace metrale;
using u128 = unsigned __int128;

// The largest buffer a call gets: caps a valid GEMM near 2^17 multiply-adds, so a run makes
// thousands of calls a second.
constexpr std::size_t kMaxBuffer = 4096;
// A range that starts in the foreign memory and runs past it is an ASan report by itself.
constexpr std::size_t kForeignBytes = 512;

// Traps (so libFuzzer keeps the input) after saying which invariant broke.
void require(bool ok, const char* what = "an invariant") {
  if (ok) return;
  std::fprintf(stderr, "fuzz_gemm_args: %s broke\n", what);
  __builtin_trap();
}

// One CPU backend for the whole run (as a process would have), on one thread so a run is
// deterministic. Scratch of the E4M3 route is allocated here at the largest size a valid call
// can ask for: scratch is grow-only by design, so a later call allocates nothing and any change
// of live_bytes() is a leak.
struct Rig {
  CpuBackend backend{CpuBackendOptions{builtin_host_modules(), 1}};
  alignas(256) std::byte foreign[kForeignBytes] = {};  // never allocated by the backend

  Rig() {
    log::set_level(log::Level::kError);
    backend.op_cache().scratch(backend, "fp8_activation", 4 * kMaxBuffer);
    backend.op_cache().scratch(backend, "fp8_weights", 4 * kMaxBuffer);
  }
};

Rig& rig() {
  static Rig r;
  return r;
}

struct Buffer {
  DevicePtr base;
  std::size_t bytes = 0;
  bool live = true;
};

// The buffers of one call, the pointers into them, and what the backend held before.
class Call {
 public:
  explicit Call(FuzzedDataProvider& in) : in_(in), b_(rig().backend) {
    seed_ = in_.ConsumeIntegral<std::uint32_t>() | std::uint64_t{1} << 40;  // xorshift: not 0
  }
  ~Call() {
    for (Buffer& buf : buffers_) {
      if (buf.live) b_.free(buf.base);
    }
  }

  Backend& backend() { return b_; }

  // A pointer for an argument that spans `need` bytes (saturated for absurd shapes).
  DevicePtr pointer(u128 need) {
    const std::size_t want = static_cast<std::size_t>(std::min<u128>(need, kMaxBuffer));
    const std::size_t delta = 1 + in_.ConsumeIntegral<std::uint8_t>();
    switch (in_.ConsumeIntegralInRange(0, 9)) {
      case 0:
      case 1:
        return fresh(std::max<std::size_t>(want, 1));
      case 2:  // too short
        return fresh(want > delta ? want - delta : 1);
      case 3:  // too long
        return fresh(want + delta);
      case 4: {  // an offset into a buffer of the needed size plus the offset
        const std::size_t off = delta - 1;
        return fresh(std::max(want + off, off + 1)).offset(off);
      }
      case 5:
        return DevicePtr{};
      case 6:  // host memory the backend never allocated
        return DevicePtr{reinterpret_cast<std::uintptr_t>(rig().foreign) + delta - 1};
      case 7: {  // a buffer freed before the call
        const DevicePtr p = fresh(std::max<std::size_t>(want, 1));
        b_.free(p);
        buffers_.back().live = false;
        return p;
      }
      default: {  // into a buffer another argument uses (an alias or an interior pointer)
        if (buffers_.empty()) return fresh(std::max<std::size_t>(want, 1));
        const Buffer& other =
            buffers_[in_.ConsumeIntegralInRange<std::size_t>(0, buffers_.size() - 1)];
        return other.base.offset(delta - 1 < other.bytes ? delta - 1 : 0);
      }
    }
  }

  // Whether [p, p + bytes) lies inside one live buffer (the CPU backend's rule for access).
  bool inside(DevicePtr p, u128 bytes) const {
    for (const Buffer& buf : buffers_) {
      if (buf.live && p.address() >= buf.base.address() &&
          u128{p.address()} + bytes <= u128{buf.base.address()} + buf.bytes) {
        return true;
      }
    }
    return false;
  }

  // Everything the call could write: each live buffer and the foreign memory.
  std::vector<std::byte> snapshot() const {
    std::vector<std::byte> out;
    for (const Buffer& buf : buffers_) {
      if (!buf.live) continue;
      const auto* p = reinterpret_cast<const std::byte*>(buf.base.address());
      out.insert(out.end(), p, p + buf.bytes);
    }
    out.insert(out.end(), rig().foreign, rig().foreign + kForeignBytes);
    return out;
  }

  // The snapshot with [p, p + bytes) replaced by what is there now (the output a valid call
  // wrote), so the rest can be compared with the snapshot before.
  std::vector<std::byte> expected_after(const std::vector<std::byte>& before, DevicePtr p,
                                        std::size_t bytes) const {
    std::vector<std::byte> out = before;
    std::size_t at = 0;
    for (const Buffer& buf : buffers_) {
      if (!buf.live) continue;
      const std::uint64_t lo = std::max(buf.base.address(), p.address()),
                          hi = std::min(buf.base.address() + buf.bytes, p.address() + bytes);
      if (lo < hi) {
        std::memcpy(out.data() + at + (lo - buf.base.address()), reinterpret_cast<const void*>(lo),
                    hi - lo);
      }
      at += buf.bytes;
    }
    return out;
  }

  FuzzedDataProvider& in() { return in_; }

  // For a broken invariant's report.
  void print_buffers() const {
    for (const Buffer& buf : buffers_) {
      std::fprintf(stderr, "fuzz_gemm_args: buffer 0x%llx, %zu bytes%s\n",
                   static_cast<unsigned long long>(buf.base.address()), buf.bytes,
                   buf.live ? "" : " (freed)");
    }
    std::fprintf(stderr, "fuzz_gemm_args: foreign memory at %p\n",
                 static_cast<const void*>(rig().foreign));
  }

 private:
  DevicePtr fresh(std::size_t bytes) {
    const DevicePtr p = b_.alloc(bytes);
    buffers_.push_back(Buffer{p, bytes});
    // Contents from the input's seed: any bit pattern (NaN and infinite BF16 included).
    auto* bytes_at = reinterpret_cast<std::uint8_t*>(p.address());
    std::uint64_t x = seed_ += 0x9E3779B97F4A7C15u;
    for (std::size_t i = 0; i < bytes; i += 8) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      std::memcpy(bytes_at + i, &x, std::min<std::size_t>(8, bytes - i));
    }
    return p;
  }

  FuzzedDataProvider& in_;
  Backend& b_;
  std::uint64_t seed_ = 0;
  std::vector<Buffer> buffers_;
};

// A dimension: mostly 1..small, sometimes 0 or any 64-bit value.
std::int64_t dimension(FuzzedDataProvider& in, std::int64_t small, std::int64_t step = 1) {
  const auto mode = in.ConsumeIntegral<std::uint8_t>();
  if (mode < 240) return step * (1 + in.ConsumeIntegralInRange<std::int64_t>(0, small - 1));
  if (mode < 248) return in.ConsumeIntegralInRange<std::int64_t>(-2, 2);
  return in.ConsumeIntegral<std::int64_t>();
}

// An output size as size_t: exact for any range a buffer here can hold.
std::size_t clamp(u128 bytes) {
  return static_cast<std::size_t>(std::min<u128>(bytes, u128{1} << 32));
}

bool aligned(DevicePtr p, std::uint64_t to) {
  return p && p.address() % to == 0;
}

bool overlap(DevicePtr a, u128 a_bytes, DevicePtr b, u128 b_bytes) {
  return a_bytes > 0 && b_bytes > 0 && u128{a.address()} < u128{b.address()} + b_bytes &&
         u128{b.address()} < u128{a.address()} + a_bytes;
}

// Runs fn and checks the outcome against `valid`: a valid call returns and writes only
// [out, out + out_bytes); an invalid one throws an Error "[api] ..." and writes nothing. Live
// allocations are the same after either.
void run(Call& call, bool valid, std::string_view api, DevicePtr out, std::size_t out_bytes,
         const std::function<void()>& fn, const std::function<std::string()>& describe = {}) {
  Backend& b = call.backend();
  const std::vector<std::byte> before = call.snapshot();
  const std::size_t live = b.live_bytes(), count = b.live_alloc_count();
  bool ok = false;
  std::string error;
  try {
    fn();
    b.synchronize(b.default_stream());
    ok = true;
  } catch (const Error& e) {
    error = e.what();
    require(e.code() == ErrorCode::kInvalidArgument, "the error code");
    const std::string_view what = e.what();
    require(what.size() > api.size() + 3 && what[0] == '[' && what.substr(1).starts_with(api) &&
                what.substr(1 + api.size()).starts_with("] "),
            "the message's [api] prefix");
  } catch (...) {
    require(false, "the exception type");
  }
  // METRALE_FUZZ_TRACE=1: one line per call, to see what an input decodes to.
  static const bool trace = std::getenv("METRALE_FUZZ_TRACE") != nullptr;
  if (trace) {
    std::fprintf(stderr, "fuzz_gemm_args: %.*s (%s) %s %s\n", static_cast<int>(api.size()),
                 api.data(), valid ? "valid" : "invalid",
                 ok ? "succeeded" : "threw:", error.c_str());
    if (describe) std::fprintf(stderr, "fuzz_gemm_args:   %s\n", describe().c_str());
  }
  if (ok != valid) {
    std::fprintf(stderr, "fuzz_gemm_args: %.*s %s, but the call %s%s\n",
                 static_cast<int>(api.size()), api.data(), valid ? "is valid" : "is invalid",
                 ok ? "succeeded" : "threw: ", error.c_str());
    if (describe) std::fprintf(stderr, "fuzz_gemm_args: %s\n", describe().c_str());
    call.print_buffers();
    require(false, "the outcome");
  }
  require(b.live_bytes() == live && b.live_alloc_count() == count, "live allocations");
  if (ok) {
    require(call.snapshot() == call.expected_after(before, out, out_bytes),
            "nothing written outside the output");
  } else {
    require(call.snapshot() == before, "nothing written on error");
  }
}

ops::GemmRoute route_of(std::uint8_t v) {
  return static_cast<ops::GemmRoute>(v % 4);
}

void fuzz_gemm(Call& call, bool route_only) {
  FuzzedDataProvider& in = call.in();
  ops::QuantWeights w;
  w.format = in.ConsumeBool() ? WeightFormat::kMxfp4 : WeightFormat::kNvfp4;
  w.layout = in.ConsumeBool() ? WeightLayout::kTransposed : WeightLayout::kRowMajor;
  const std::int64_t group = group_size(w.format);
  const std::int64_t m = dimension(in, 80);
  w.n = dimension(in, 64);
  w.k = dimension(in, 8, 32);
  if (in.ConsumeIntegral<std::uint8_t>() < 16 && w.k > 16) w.k -= 16;  // 16, 48, ...: NVFP4 only
  ops::GemmOptions options;
  options.activations =
      in.ConsumeBool() ? ops::Activations::kAllowE4m3 : ops::Activations::kExactBf16;
  options.route = route_of(in.ConsumeIntegral<std::uint8_t>());

  // What the shapes make each range (saturating far beyond any buffer).
  const bool shape_ok = m >= 1 && w.n >= 1 && w.k >= 1 && w.k % group == 0;
  const u128 um = m > 0 ? u128(m) : 0, un = w.n > 0 ? u128(w.n) : 0, uk = w.k > 0 ? u128(w.k) : 0;
  const u128 codes_need = un * uk / 2, scales_need = un * (uk / u128(group));

  if (route_only) {
    bool valid = true;
    ops::GemmRoute want = options.route;
    if (want == ops::GemmRoute::kAuto) {
      const std::uint32_t e4m3_from =
          call.backend().op_cache().kernel(call.backend(), "w4a16", "gemm_e4m3").meta.min_m;
      if (options.activations == ops::Activations::kAllowE4m3 && e4m3_from != 0 && m >= e4m3_from) {
        want = ops::GemmRoute::kE4m3;
      } else {
        want = m <= ops::decode_max_m(call.backend()) ? ops::GemmRoute::kDecode
                                                      : ops::GemmRoute::kTiled;
      }
    }
    valid = !(want == ops::GemmRoute::kE4m3 && options.activations == ops::Activations::kExactBf16);
    run(call, valid, "w4a16_gemm", DevicePtr{}, 0,
        [&] { require(ops::choose_route(call.backend(), m, w, options) == want); });
    return;
  }

  const DevicePtr a = call.pointer(um * uk * 2);
  w.codes = call.pointer(codes_need);
  w.scales = call.pointer(scales_need);
  if (in.ConsumeBool()) options.bias = call.pointer(un * 2);
  const bool with_bias = static_cast<bool>(options.bias);  // a null bias is no bias
  const DevicePtr c = call.pointer(um * un * 2);
  const auto sizes = in.ConsumeIntegralInRange(0, 3);
  w.codes_bytes = static_cast<std::size_t>(codes_need);
  w.scales_bytes = static_cast<std::size_t>(scales_need);
  if (sizes == 1) w.codes_bytes += in.ConsumeIntegralInRange<std::size_t>(1, 64);
  if (sizes == 2) w.scales_bytes -= in.ConsumeIntegralInRange<std::size_t>(1, 64);
  if (sizes == 3) w.codes_bytes = in.ConsumeIntegral<std::size_t>();
  switch (in.ConsumeIntegralInRange(0, 5)) {
    case 0:  // any bit pattern: NaN, infinite, negative, subnormal
      w.tensor_scale = std::bit_cast<float>(in.ConsumeIntegral<std::uint32_t>());
      break;
    case 1:
      w.tensor_scale = 0.0f;
      break;
    default:
      w.tensor_scale = 0.5f;
  }

  const u128 a_bytes = um * uk * 2, c_bytes = um * un * 2, bias_bytes = with_bias ? un * 2 : 0;
  bool valid = shape_ok && w.codes_bytes == codes_need && w.scales_bytes == scales_need &&
               w.tensor_scale > 0.0f && std::isfinite(w.tensor_scale);
  valid = valid && aligned(a, 16) && aligned(c, 16) && aligned(w.codes, 16) &&
          aligned(w.scales, 16) && (!with_bias || aligned(options.bias, 16));
  valid = valid && !overlap(c, c_bytes, a, a_bytes) && !overlap(c, c_bytes, w.codes, codes_need) &&
          !overlap(c, c_bytes, w.scales, scales_need) &&
          !overlap(c, c_bytes, options.bias, bias_bytes);
  valid = valid && call.inside(a, a_bytes) && call.inside(c, c_bytes) &&
          call.inside(w.codes, codes_need) && call.inside(w.scales, scales_need) &&
          (!with_bias || call.inside(options.bias, bias_bytes));
  const bool e4m3 = options.route == ops::GemmRoute::kE4m3;
  valid = valid && !(e4m3 && options.activations == ops::Activations::kExactBf16);
  run(
      call, valid, "w4a16_gemm", c, clamp(c_bytes),
      [&] {
        ops::w4a16_gemm(call.backend(), call.backend().default_stream(), a, m, w, c, options);
      },
      [&] {
        return fmt::format(
            "M={} N={} K={} {} {} route {} {} tensor scale {}; A 0x{:x} codes 0x{:x} ({} B) scales "
            "0x{:x} ({} B) bias 0x{:x} C 0x{:x}",
            m, w.n, w.k, to_string(w.format),
            w.layout == WeightLayout::kTransposed ? "transposed" : "row-major",
            ops::to_string(options.route),
            options.activations == ops::Activations::kAllowE4m3 ? "e4m3 allowed" : "exact",
            w.tensor_scale, a.address(), w.codes.address(), w.codes_bytes, w.scales.address(),
            w.scales_bytes, options.bias.address(), c.address());
      });
}

void fuzz_cast(Call& call) {
  FuzzedDataProvider& in = call.in();
  const std::int64_t count = dimension(in, 2048);
  const u128 n = count > 0 ? u128(count) : 0;
  const DevicePtr src = call.pointer(n * 2);
  const DevicePtr dst = call.pointer(n);
  const bool valid = count >= 1 && aligned(src, 16) && aligned(dst, 16) &&
                     !overlap(dst, n, src, n * 2) && call.inside(src, n * 2) && call.inside(dst, n);
  run(call, valid, "cast_bf16_to_e4m3", dst, clamp(n), [&] {
    ops::cast_bf16_to_e4m3(call.backend(), call.backend().default_stream(), src, dst, count);
  });
}

void fuzz_fill(Call& call) {
  FuzzedDataProvider& in = call.in();
  const std::int64_t raw = dimension(in, 2048);
  const auto n = static_cast<std::size_t>(raw);
  const DevicePtr out = call.pointer(u128(n) * 4);
  const std::uint32_t value = in.ConsumeIntegral<std::uint32_t>();
  const bool valid = n >= 1 && n <= std::numeric_limits<std::uint32_t>::max() && aligned(out, 4) &&
                     call.inside(out, u128(n) * 4);
  run(call, valid, "fill_u32", out, valid ? n * 4 : 0,
      [&] { ops::fill_u32(call.backend(), call.backend().default_stream(), out, n, value); });
}

void fuzz_axpy(Call& call) {
  FuzzedDataProvider& in = call.in();
  const std::int64_t raw = dimension(in, 2048);
  const auto n = static_cast<std::size_t>(raw);
  const DevicePtr y = call.pointer(u128(n) * 4);
  const DevicePtr x = call.pointer(u128(n) * 4);
  const float a = in.ConsumeFloatingPoint<float>();
  const bool valid = n >= 1 && n <= std::numeric_limits<std::uint32_t>::max() && aligned(x, 4) &&
                     aligned(y, 4) && !overlap(x, u128(n) * 4, y, u128(n) * 4) &&
                     call.inside(x, u128(n) * 4) && call.inside(y, u128(n) * 4);
  run(call, valid, "axpy_f32", y, valid ? n * 4 : 0,
      [&] { ops::axpy_f32(call.backend(), call.backend().default_stream(), y, x, a, n); });
}

// upload_weights with an injected allocation failure or none: weights whose code and scale sizes
// fit the format, N and K upload, copying both arrays to exactly two new allocations that
// free_weights frees; any other sizes are refused; a failure leaves nothing allocated. The
// weights policy (metrale/weights.h) answers a device out-of-memory with managed memory, so a
// capped or failed device allocation still uploads; once the backend has latched that fallback,
// the managed allocation is the one an injected failure hits, and the upload fails.
void fuzz_upload(Call& call) {
  FuzzedDataProvider& in = call.in();
  CpuBackend& b = rig().backend;
  HostQuantWeights h;
  h.format = in.ConsumeBool() ? WeightFormat::kMxfp4 : WeightFormat::kNvfp4;
  h.layout = in.ConsumeBool() ? WeightLayout::kTransposed : WeightLayout::kRowMajor;
  h.n = dimension(in, 64);
  h.k = dimension(in, 8, 32);
  // Sizes that fit the shape, or any (refused unless they happen to fit).
  const int group = h.format == WeightFormat::kMxfp4 ? 32 : 16;
  const bool shape_ok = h.n >= 1 && h.k >= 1 && h.k % group == 0;
  if (shape_ok && h.n <= 64 && h.k <= 256 && in.ConsumeBool()) {
    h.codes.resize(static_cast<std::size_t>(h.n * (h.k / 2)));
    h.scales.resize(static_cast<std::size_t>(h.n * (h.k / group)));
  } else {
    h.codes.resize(in.ConsumeIntegralInRange<std::size_t>(0, kMaxBuffer));
    h.scales.resize(in.ConsumeIntegralInRange<std::size_t>(0, kMaxBuffer / 16));
  }
  for (std::size_t i = 0; i < h.codes.size(); ++i) h.codes[i] = static_cast<std::uint8_t>(i * 7);
  for (std::size_t i = 0; i < h.scales.size(); ++i) h.scales[i] = static_cast<std::uint8_t>(i);
  h.tensor_scale = in.ConsumeFloatingPoint<float>();
  CpuFaults faults;
  const auto fault = in.ConsumeIntegralInRange(0, 3);
  if (fault == 1 || fault == 2) {
    faults.fail_call_at = static_cast<std::uint64_t>(fault);
    faults.fail_call_of = "alloc";
  }
  if (fault == 3) faults.max_device_alloc = in.ConsumeIntegralInRange<std::size_t>(0, kMaxBuffer);
  const bool latched = b.op_cache().alloc_fell_back();
  const bool sizes_fit = shape_ok && u128(h.n) * u128(h.k / 2) == h.codes.size() &&
                         u128(h.n) * u128(h.k / group) == h.scales.size();
  const bool valid = sizes_fit && !(latched && (fault == 1 || fault == 2));

  const std::size_t live = b.live_bytes(), count = b.live_alloc_count();
  bool ok = false;
  ops::QuantWeights d;
  b.set_faults(faults);
  try {
    d = ops::upload_weights(b, h);
    ok = true;
  } catch (const Error& e) {
    require(e.code() == ErrorCode::kInvalidArgument || e.code() == ErrorCode::kOutOfMemory);
    require(std::string_view(e.what()).starts_with("["));
  } catch (...) {
    __builtin_trap();
  }
  b.set_faults(CpuFaults{});
  require(ok == valid);
  if (!ok) {
    require(b.live_bytes() == live && b.live_alloc_count() == count);
    return;
  }
  require(d.format == h.format && d.layout == h.layout && d.n == h.n && d.k == h.k);
  require(d.codes_bytes == h.codes.size() && d.scales_bytes == h.scales.size());
  require(std::bit_cast<std::uint32_t>(d.tensor_scale) ==
          std::bit_cast<std::uint32_t>(h.tensor_scale));
  require(b.live_bytes() == live + h.codes.size() + h.scales.size());
  require(b.live_alloc_count() == count + 2);
  require(std::memcmp(reinterpret_cast<const void*>(d.codes.address()), h.codes.data(),
                      h.codes.size()) == 0);
  require(std::memcmp(reinterpret_cast<const void*>(d.scales.address()), h.scales.data(),
                      h.scales.size()) == 0);
  ops::free_weights(b, d);
  require(!d.codes && !d.scales);
  require(b.live_bytes() == live && b.live_alloc_count() == count);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const std::size_t live = rig().backend.live_bytes(), count = rig().backend.live_alloc_count();
  {
    Call call(in);
    switch (in.ConsumeIntegralInRange(0, 5)) {
      case 0:
        fuzz_gemm(call, false);
        break;
      case 1:
        fuzz_gemm(call, true);
        break;
      case 2:
        fuzz_cast(call);
        break;
      case 3:
        fuzz_upload(call);
        break;
      case 4:
        fuzz_fill(call);
        break;
      default:
        fuzz_axpy(call);
    }
  }
  require(rig().backend.live_bytes() == live && rig().backend.live_alloc_count() == count);
  return 0;
}
