// CPU backend launches and kernel lookups with a custom host module: every block runs once,
// shared memory, launch-shape checks, faults inside kernels, foreign handles, the lookup errors
// and audit, published metadata, typed-argument packing and the thread count.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/host_module.h"
#include "metrale/kernel_args.h"
#include "metrale/op_cache.h"
#include "metrale/ops/elementwise.h"
#include "support/read_back.h"

namespace metrale {
namespace {

using testing::expect_error;
using ::testing::HasSubstr;
using testing::read;

template <class T>
T* at(std::uint64_t address) {
  return reinterpret_cast<T*>(static_cast<std::uintptr_t>(address));
}

std::uint64_t linear(const HostBlock& b) {
  return b.block_idx.x +
         std::uint64_t{b.grid.x} * (b.block_idx.y + std::uint64_t{b.grid.y} * b.block_idx.z);
}

// count(counts): counts[linear block index] += 1; a block index outside the grid throws.
void count_kernel(const HostBlock& b) {
  if (b.block_idx.x >= b.grid.x || b.block_idx.y >= b.grid.y || b.block_idx.z >= b.grid.z) {
    throw std::out_of_range("block index outside the grid");
  }
  auto* counts = at<std::uint32_t>(read_param<std::uint64_t>(b.params, 0));
  std::atomic_ref<std::uint32_t>(counts[linear(b)]).fetch_add(1, std::memory_order_relaxed);
}

// shape(out): block (0,0,0) writes grid, block and shared bytes as 7 uint32.
void shape_kernel(const HostBlock& b) {
  if (linear(b) != 0) return;
  auto* out = at<std::uint32_t>(read_param<std::uint64_t>(b.params, 0));
  const std::array<std::uint32_t, 7> v{b.grid.x,  b.grid.y,  b.grid.z,      b.block.x,
                                       b.block.y, b.block.z, b.shared_bytes};
  std::memcpy(out, v.data(), sizeof v);
}

// shared(out): fills the block's whole shared buffer with a block-specific pattern, reads it
// back, and writes out[block] = 1 when every byte survived (2 otherwise).
void shared_kernel(const HostBlock& b) {
  auto* out = at<std::uint32_t>(read_param<std::uint64_t>(b.params, 0));
  const std::uint64_t id = linear(b);
  if (b.shared == nullptr) {
    out[id] = 3;
    return;
  }
  for (std::uint32_t i = 0; i < b.shared_bytes; ++i) {
    b.shared[i] = static_cast<std::byte>((id * 31 + i) & 0xFF);
  }
  bool ok = true;
  for (std::uint32_t i = 0; i < b.shared_bytes; ++i) {
    ok = ok && b.shared[i] == static_cast<std::byte>((id * 31 + i) & 0xFF);
  }
  out[id] = ok ? 1u : 2u;
}

void throw_kernel(const HostBlock& b) {
  if (b.block_idx.x == 1) throw std::runtime_error("boom in block 1");
}

struct Triple {
  std::uint32_t a, b, c;
};
struct Echo {
  std::uint32_t u;
  double d;
  Triple t;
  std::uint16_t h;
};

// echo(out, u32, f64, Triple, u16): writes its by-value arguments back as an Echo.
void echo_kernel(const HostBlock& b) {
  Echo e{};
  e.u = read_param<std::uint32_t>(b.params, 1);
  e.d = read_param<double>(b.params, 2);
  e.t = read_param<Triple>(b.params, 3);
  e.h = read_param<std::uint16_t>(b.params, 4);
  std::memcpy(at<Echo>(read_param<std::uint64_t>(b.params, 0)), &e, sizeof e);
}

// mix(out, seed): out[block] = a value that depends on the block and on its shared memory.
void mix_kernel(const HostBlock& b) {
  auto* out = at<std::uint64_t>(read_param<std::uint64_t>(b.params, 0));
  const auto seed = read_param<std::uint64_t>(b.params, 1);
  std::uint64_t h = seed ^ (linear(b) * 0x9E3779B97F4A7C15ull);
  for (std::uint32_t i = 0; i < b.shared_bytes; ++i)
    b.shared[i] = static_cast<std::byte>(h >> (i % 8));
  for (std::uint32_t i = 0; i < b.shared_bytes; ++i) {
    h = (h ^ static_cast<std::uint64_t>(b.shared[i])) * 1099511628211ull;
  }
  out[linear(b)] = h;
}

HostModule test_module() {
  HostModule m("test");
  m.add_kernel("count", count_kernel, {8})
      .add_kernel("shape", shape_kernel, {8})
      .add_kernel("shared", shared_kernel, {8})
      .add_kernel("throws", throw_kernel, {})
      .add_kernel("echo", echo_kernel, {8, 4, 8, 12, 2})
      .add_kernel("mix", mix_kernel, {8, 8})
      .publish_u32("count_n_tile", 16)
      .publish("count_a_e4m3", {std::byte{1}})
      .publish("shape_a_e4m3", {std::byte{0}, std::byte{0}});
  return m;
}

CpuBackendOptions options(unsigned threads, bool with_core = false) {
  CpuBackendOptions o;
  o.modules.clear();
  if (with_core) o.modules = builtin_host_modules();
  o.modules.push_back(test_module());
  o.threads = threads;
  return o;
}

// A zeroed device array of n uint32.
DevicePtr zeros(Backend& b, std::size_t n) {
  const DevicePtr p = b.alloc(n * 4);
  b.memset(p, 0, n * 4);
  return p;
}

void launch1(Backend& b, KernelHandle k, Dim3 grid, Dim3 block, std::uint32_t shared,
             DevicePtr out) {
  const std::array args{KernelArg::buffer(out)};
  b.launch_typed(k, grid, block, shared, b.default_stream(), args);
}

TEST(CpuLaunch, EveryBlockOfA3dGridRunsExactlyOnce) {
  for (unsigned threads : {1u, 4u}) {
    CpuBackend b(options(threads));
    const ResolvedKernel k = b.kernel("test", "count");
    const Dim3 grid{7, 5, 3};
    const DevicePtr counts = zeros(b, grid.volume());
    launch1(b, k, grid, Dim3{128}, 0, counts);
    EXPECT_EQ(read<std::uint32_t>(b, counts, grid.volume()),
              std::vector<std::uint32_t>(grid.volume(), 1u))
        << threads << " thread(s)";
    // A long 1-D grid as well, so the pool hands out many chunks.
    const DevicePtr many = zeros(b, 10007);
    launch1(b, k, Dim3{10007}, Dim3{1}, 0, many);
    EXPECT_EQ(read<std::uint32_t>(b, many, 10007), std::vector<std::uint32_t>(10007, 1u));
    b.free(counts);
    b.free(many);
  }
}

TEST(CpuLaunch, KernelsSeeTheLaunchShape) {
  CpuBackend b(options(2));
  const DevicePtr out = zeros(b, 7);
  launch1(b, b.kernel("test", "shape"), Dim3{3, 2, 4}, Dim3{32, 4, 2}, 1000, out);
  EXPECT_EQ(read<std::uint32_t>(b, out, 7), (std::vector<std::uint32_t>{3, 2, 4, 32, 4, 2, 1000}));
  b.free(out);
}

TEST(CpuLaunch, EachBlockHasUsableSharedMemoryUpToTheMaximum) {
  CpuBackend b(options(4));
  const ResolvedKernel k = b.kernel("test", "shared");
  for (std::uint32_t shared : {1u, 100000u, 232448u}) {
    const Dim3 grid{6, 2, 1};
    const DevicePtr out = zeros(b, grid.volume());
    launch1(b, k, grid, Dim3{256}, shared, out);
    EXPECT_EQ(read<std::uint32_t>(b, out, grid.volume()),
              std::vector<std::uint32_t>(grid.volume(), 1u))
        << shared << " bytes";
    b.free(out);
  }
}

TEST(CpuLaunch, BadLaunchShapesAreRejectedNamingTheKernelAndRunNothing) {
  CpuBackend b(options(2));
  const ResolvedKernel k = b.kernel("test", "count");
  const DevicePtr counts = zeros(b, 4096);
  std::uint64_t address = counts.address();
  std::array<void*, 2> two{&address, &address};
  struct Case {
    const char* what;
    std::function<void()> call;
    const char* expect;
  };
  const std::vector<Case> cases{
      {"two params", [&] { b.launch(k, Dim3{1}, Dim3{1}, 0, b.default_stream(), two); },
       "takes 1 parameter(s), got 2"},
      {"no params",
       [&] { b.launch(k, Dim3{1}, Dim3{1}, 0, b.default_stream(), std::span<void*>{}); },
       "takes 1 parameter(s), got 0"},
      {"null param",
       [&] {
         std::array<void*, 1> null{nullptr};
         b.launch(k, Dim3{1}, Dim3{1}, 0, b.default_stream(), null);
       },
       "parameter 0 is null"},
      {"zero grid x",
       [&] {
         launch1(b, k, Dim3{0, 1, 1}, Dim3{1}, 0, counts);
       },
       "grid (0, 1, 1) block (1, 1, 1) shared 0 B: grid out of range"},
      {"zero grid z",
       [&] {
         launch1(b, k, Dim3{2, 1, 0}, Dim3{1}, 0, counts);
       },
       "grid out of range"},
      {"grid y too big",
       [&] {
         launch1(b, k, Dim3{1, 65536, 1}, Dim3{1}, 0, counts);
       },
       "grid out of range"},
      {"1025 threads", [&] { launch1(b, k, Dim3{1}, Dim3{1025}, 0, counts); },
       "block (1025, 1, 1) shared 0 B: block must have 1..1024 threads"},
      {"2048 threads in 3-D",
       [&] {
         launch1(b, k, Dim3{1}, Dim3{32, 32, 2}, 0, counts);
       },
       "block must have 1..1024 threads"},
      {"zero block",
       [&] {
         launch1(b, k, Dim3{1}, Dim3{0, 1, 1}, 0, counts);
       },
       "block must have 1..1024 threads"},
      {"too much shared", [&] { launch1(b, k, Dim3{1}, Dim3{32}, 232449, counts); },
       "shared 232449 B: more dynamic shared memory than the 232448 B a block can have"},
  };
  for (const Case& c : cases) {
    const Error e = expect_error(c.call);
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << c.what;
    EXPECT_THAT(e.what(), HasSubstr("[launch] test::count grid")) << c.what;
    EXPECT_THAT(e.what(), HasSubstr(c.expect)) << c.what;
  }
  EXPECT_EQ(read<std::uint32_t>(b, counts, 4096), std::vector<std::uint32_t>(4096, 0u));
  // The limits themselves are allowed.
  launch1(b, k, Dim3{1, 1, 1}, Dim3{32, 32, 1}, 232448, counts);
  EXPECT_EQ(read<std::uint32_t>(b, counts, 1)[0], 1u);
  b.free(counts);
}

TEST(CpuLaunch, AnExceptionInsideAKernelIsADeviceFaultNamingTheLaunch) {
  CpuBackend b(options(4));
  const ResolvedKernel k = b.kernel("test", "throws");
  const Error e = expect_error([&] {
    b.launch(k, Dim3{3, 2, 1}, Dim3{64}, 128, b.default_stream(), std::span<void*>{});
  });
  EXPECT_EQ(e.code(), ErrorCode::kDeviceFault);
  EXPECT_THAT(e.what(), HasSubstr("[launch] test::throws grid (3, 2, 1) block (64, 1, 1) shared "
                                  "128 B failed: boom in block 1"));
  // The backend keeps working after the fault.
  const DevicePtr counts = zeros(b, 8);
  launch1(b, b.kernel("test", "count"), Dim3{8}, Dim3{1}, 0, counts);
  EXPECT_EQ(read<std::uint32_t>(b, counts, 8), std::vector<std::uint32_t>(8, 1u));

  // A fault in a captured launch surfaces when the graph is replayed.
  const StreamHandle s = b.create_stream();
  b.begin_capture(s);
  b.launch(k, Dim3{2}, Dim3{1}, 0, s, std::span<void*>{});
  const GraphHandle g = b.end_capture(s);
  const Error replay = expect_error([&] { b.launch_graph(g, s); });
  EXPECT_EQ(replay.code(), ErrorCode::kDeviceFault);
  EXPECT_THAT(replay.what(), HasSubstr("test::throws grid (2, 1, 1)"));
  b.destroy_graph(g);
  b.destroy_stream(s);
  b.free(counts);
}

TEST(CpuLaunch, HandlesNotResolvedByThisBackendAreRejected) {
  CpuBackend b(options(1));
  CpuBackend other(options(1));
  const ResolvedKernel foreign = other.kernel("test", "count");
  const DevicePtr counts = zeros(b, 4);
  for (const KernelHandle h : {foreign.handle, KernelHandle{}, KernelHandle{0x1234}}) {
    const Error e = expect_error([&] { launch1(b, h, Dim3{1}, Dim3{1}, 0, counts); });
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(e.what(), HasSubstr(fmt::format("[launch] kernel 0x{:x} was not resolved by this "
                                                "cpu backend",
                                                h.value())));
  }
  EXPECT_EQ(read<std::uint32_t>(b, counts, 4), std::vector<std::uint32_t>(4, 0u));
  EXPECT_EQ(b.kernel_name(foreign), fmt::format("kernel 0x{:x}", foreign.handle.value()));
  EXPECT_EQ(other.kernel_name(foreign), "test::count");
  b.free(counts);
}

TEST(CpuLookup, UnknownModulesAndFunctionsListWhatExists) {
  CpuBackend b(options(1, /*with_core=*/true));
  EXPECT_EQ(b.module_names(),
            (std::vector<std::string>{"core", "w4a16", "blas", "fp8", "moe", "test"}));
  EXPECT_TRUE(b.has_module("test"));
  EXPECT_FALSE(b.has_module("nope"));
  ASSERT_NE(b.module("test"), nullptr);
  EXPECT_EQ(b.module("test")->kernels().size(), 6u);
  EXPECT_EQ(b.module("nope"), nullptr);

  const Error mod = expect_error([&] { (void)b.kernel("nope", "count"); });
  EXPECT_EQ(mod.code(), ErrorCode::kNotFound);
  EXPECT_THAT(mod.what(),
              HasSubstr("[kernel] module 'nope' is not loaded on the cpu backend "
                        "(loaded: core, w4a16, blas, fp8, moe, test); asked for nope::count from "
                        "launch_test.cpp:"));
  const Error fn = expect_error([&] { (void)b.kernel("test", "zzz"); });
  EXPECT_EQ(fn.code(), ErrorCode::kNotFound);
  EXPECT_THAT(fn.what(), HasSubstr("[kernel] module 'test' has no kernel 'zzz' (it has: count, "
                                   "shape, shared, throws, echo, mix)"));
  // A failed lookup is not memoized by the OpCache.
  EXPECT_THROW((void)b.op_cache().kernel(b, "test", "zzz"), Error);
  EXPECT_EQ(b.op_cache().kernel_count(), 0u);
}

TEST(CpuLookup, DeniedLookupsFailAsNotFound) {
  CpuBackend b(options(1));
  CpuFaults faults;
  faults.deny_lookups = {"test::count"};
  b.set_faults(faults);
  const Error e = expect_error([&] { (void)b.kernel("test", "count"); });
  EXPECT_EQ(e.code(), ErrorCode::kNotFound);
  EXPECT_THAT(e.what(), HasSubstr("[kernel] test::count (from launch_test.cpp:"));
  EXPECT_THAT(e.what(), HasSubstr("denied by fault injection"));
  EXPECT_TRUE(b.kernel("test", "shape"));
  b.set_faults(CpuFaults{});
  EXPECT_TRUE(b.kernel("test", "count"));
}

TEST(CpuLookup, TheAuditRecordsEachLookupWithItsCaller) {
  CpuBackend b(options(1));
  EXPECT_TRUE(b.lookup_audit().empty());
  const std::uint32_t ok_line = __LINE__ + 1;
  (void)b.kernel("test", "count");
  const std::uint32_t bad_line = __LINE__ + 1;
  EXPECT_THROW((void)b.kernel("test", "missing"), Error);
  const std::uint32_t cache_line = __LINE__ + 1;
  (void)b.op_cache().kernel(b, "test", "shape");
  (void)b.op_cache().kernel(b, "test", "shape");  // a memoized hit does not look up again

  const std::vector<KernelLookup> audit = b.lookup_audit();
  ASSERT_EQ(audit.size(), 3u);
  EXPECT_EQ(audit[0].module, "test");
  EXPECT_EQ(audit[0].function, "count");
  EXPECT_TRUE(audit[0].resolved);
  EXPECT_TRUE(audit[0].error.empty());
  EXPECT_EQ(audit[0].site.file_name(), "launch_test.cpp");
  EXPECT_EQ(audit[0].site.line, ok_line);

  EXPECT_EQ(audit[1].function, "missing");
  EXPECT_FALSE(audit[1].resolved);
  EXPECT_THAT(audit[1].error, HasSubstr("has no kernel 'missing'"));
  EXPECT_EQ(audit[1].site.file_name(), "launch_test.cpp");
  EXPECT_EQ(audit[1].site.line, bad_line);

  EXPECT_EQ(audit[2].function, "shape");
  EXPECT_TRUE(audit[2].resolved);
  EXPECT_EQ(audit[2].site.str(), fmt::format("launch_test.cpp:{}", cache_line));
}

TEST(CpuLookup, PublishedMetadataIsRecordedAndAMalformedTileFailsTheLookup) {
  HostModule bad("bad");
  bad.add_kernel("k", count_kernel, {8}).publish("k_n_tile", {std::byte{64}, std::byte{0}});
  bad.add_kernel("zero", count_kernel, {8}).publish_u32("zero_n_tile", 0);
  CpuBackendOptions o = options(1);
  o.modules.push_back(bad);
  CpuBackend b(std::move(o));

  const ResolvedKernel count = b.kernel("test", "count");
  EXPECT_EQ(b.kernel_n_tile(count), 16u);
  EXPECT_TRUE(b.kernel_casts_a_to_e4m3(count));
  const ResolvedKernel shape = b.kernel("test", "shape");
  EXPECT_FALSE(b.kernel_casts_a_to_e4m3(shape));
  const Error none = expect_error([&] { (void)b.kernel_n_tile(shape); });
  EXPECT_EQ(none.code(), ErrorCode::kNotFound);
  EXPECT_THAT(none.what(), HasSubstr("[kernel_n_tile] test::shape publishes no N tile"));
  const Error zero = expect_error([&] { (void)b.kernel_n_tile(b.kernel("bad", "zero")); });
  EXPECT_EQ(zero.code(), ErrorCode::kNotFound);
  EXPECT_THAT(zero.what(), HasSubstr("[kernel_n_tile] bad::zero publishes no N tile"));

  const Error e = expect_error([&] { (void)b.kernel("bad", "k"); });
  EXPECT_EQ(e.code(), ErrorCode::kDriver);
  EXPECT_THAT(e.what(), HasSubstr("[kernel] bad::k publishes k_n_tile as 2 byte(s); it must be a "
                                  "4-byte unsigned"));
  const std::vector<KernelLookup> audit = b.lookup_audit();
  ASSERT_FALSE(audit.empty());
  EXPECT_EQ(audit.back().function, "k");
  EXPECT_FALSE(audit.back().resolved);
  EXPECT_THROW((void)b.op_cache().kernel(b, "bad", "k"), Error);
  EXPECT_EQ(b.op_cache().kernel_count(), 0u);
}

TEST(CpuLaunch, LaunchTypedPacksArgumentsTheKernelReadsBack) {
  CpuBackend b(options(1));
  const ResolvedKernel k = b.kernel("test", "echo");
  const DevicePtr out = b.alloc(sizeof(Echo));
  b.memset(out, 0xAB, sizeof(Echo));
  const std::array args{KernelArg::buffer(out), KernelArg::value(std::uint32_t{0xDEADBEEF}),
                        KernelArg::value(-2.75), KernelArg::value(Triple{1, 0x80000000u, 3}),
                        KernelArg::value(std::uint16_t{0xBEEF})};
  b.launch_typed(k, Dim3{1}, Dim3{1}, 0, b.default_stream(), args);
  Echo got{};
  b.copy_d2h(&got, out, sizeof got);
  EXPECT_EQ(got.u, 0xDEADBEEFu);
  EXPECT_EQ(got.d, -2.75);
  EXPECT_EQ(got.t.a, 1u);
  EXPECT_EQ(got.t.b, 0x80000000u);
  EXPECT_EQ(got.t.c, 3u);
  EXPECT_EQ(got.h, 0xBEEF);
  // A typed launch with the wrong number of arguments is rejected like an untyped one.
  const Error e = expect_error([&] {
    b.launch_typed(k, Dim3{1}, Dim3{1}, 0, b.default_stream(), std::span(args).first(4));
  });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("test::echo"));
  EXPECT_THAT(e.what(), HasSubstr("takes 5 parameter(s), got 4"));
  // An argument of the wrong size is caught before anything reads past it.
  std::array wrong = args;
  wrong[1] = KernelArg::value(std::uint64_t{1});
  const Error size =
      expect_error([&] { b.launch_typed(k, Dim3{1}, Dim3{1}, 0, b.default_stream(), wrong); });
  EXPECT_EQ(size.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(size.what(),
              HasSubstr("test::echo parameter 1 is 4 byte(s), the argument given is 8"));
  b.free(out);
}

TEST(CpuLaunch, OneThreadAndFourThreadsGiveIdenticalResults) {
  std::random_device rd;
  const std::uint64_t seed = (std::uint64_t{rd()} << 32) | rd();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  constexpr std::size_t n = 300001;
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  std::vector<float> x(n), y(n);
  for (std::size_t i = 0; i < n; ++i) {
    x[i] = dist(gen);
    y[i] = dist(gen);
  }
  struct Result {
    std::vector<float> axpy;
    std::vector<std::uint64_t> mix;
    std::vector<std::uint32_t> counts;
  };
  auto run = [&](unsigned threads) {
    CpuBackend b(options(threads, /*with_core=*/true));
    EXPECT_EQ(b.sm_count(), threads);
    Result r;
    const DevicePtr xd = b.alloc(n * 4), yd = b.alloc(n * 4);
    b.copy_h2d(xd, x.data(), n * 4);
    b.copy_h2d(yd, y.data(), n * 4);
    ops::axpy_f32(b, b.default_stream(), yd, xd, 1.25f, n);
    r.axpy = read<float>(b, yd, n);
    const Dim3 grid{9, 4, 3};
    const DevicePtr mix = b.alloc(grid.volume() * 8);
    const std::array args{KernelArg::buffer(mix), KernelArg::value(seed)};
    b.launch_typed(b.kernel("test", "mix"), grid, Dim3{64}, 4096, b.default_stream(), args);
    r.mix = read<std::uint64_t>(b, mix, grid.volume());
    const DevicePtr counts = zeros(b, grid.volume());
    launch1(b, b.kernel("test", "count"), grid, Dim3{64}, 0, counts);
    r.counts = read<std::uint32_t>(b, counts, grid.volume());
    for (DevicePtr p : {xd, yd, mix, counts}) b.free(p);
    return r;
  };
  const Result one = run(1);
  const Result four = run(4);
  ASSERT_EQ(one.axpy.size(), n);
  EXPECT_EQ(std::memcmp(one.axpy.data(), four.axpy.data(), n * 4), 0);
  EXPECT_EQ(one.mix, four.mix);
  EXPECT_EQ(one.counts, four.counts);
  EXPECT_EQ(one.counts, std::vector<std::uint32_t>(one.counts.size(), 1u));
  // The results are real: every y changed, and the mixes differ per block.
  for (std::size_t i = 0; i < n; i += 997) {
    const double ref = 1.25 * double{x[i]} + double{y[i]};
    EXPECT_NEAR(one.axpy[i], ref, 1e-5 * (std::abs(ref) + 1.0)) << i;
  }
  EXPECT_NE(one.mix[0], one.mix[1]);
}

TEST(CpuLaunch, AModuleGivenTwiceIsRejected) {
  CpuBackendOptions o = options(1);
  o.modules.push_back(test_module());
  const Error e = expect_error([&] { CpuBackend b(std::move(o)); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[CpuBackend] module 'test' is given twice"));
}

}  // namespace
}  // namespace metrale
