// Kernel lookup on the CUDA backend (docs/CONTRACT.md, kernel modules): published metadata read
// into the OpCache, missing and unreadable symbols, unknown modules and functions, lookups refused
// during a capture, the lookup audit, the start-up gate (require_kernels) and the module listing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "cuda/rig.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"
#include "support/log_capture.h"

namespace metrale::cuda::testing {
namespace {

using metrale::testing::expect_error;
using metrale::testing::LogCapture;
using ::testing::HasSubstr;

// core plus entries publishing metadata in different ways.
ModuleSpec metadata_module() {
  ModuleSpec m = core_module();
  m.fake.functions["gemm"] = FakeFunction{};
  m.fake.publish_u32("gemm_n_tile", 128);
  m.fake.publish_u32("gemm_a_e4m3", 1);
  m.fake.functions["plain"] = FakeFunction{};  // publishes nothing
  m.fake.functions["cast_off"] = FakeFunction{};
  m.fake.publish_u32("cast_off_n_tile", 64);
  m.fake.publish_u32("cast_off_a_e4m3", 0);
  m.fake.functions["locked"] = FakeFunction{};
  m.fake.globals["locked_n_tile"] =
      FakeGlobal{{std::byte{64}, {}, {}, {}}, CUDA_ERROR_INVALID_VALUE};
  m.fake.functions["locked_flag"] = FakeFunction{};
  m.fake.publish_u32("locked_flag_n_tile", 32);
  m.fake.globals["locked_flag_a_e4m3"] = FakeGlobal{{std::byte{1}}, CUDA_ERROR_ILLEGAL_STATE};
  m.fake.functions["short"] = FakeFunction{};
  m.fake.globals["short_n_tile"] = FakeGlobal{{std::byte{64}, std::byte{0}}, CUDA_SUCCESS};
  return m;
}

TEST(CudaKernels, LookupReadsThePublishedTileAndCastFlagIntoTheOpCache) {
  Rig rig({.modules = {metadata_module()}});
  CudaBackend& b = rig.b();
  const ResolvedKernel& gemm = b.op_cache().kernel(b, "core", "gemm");
  ASSERT_TRUE(gemm.handle);
  EXPECT_EQ(gemm.meta.n_tile, 128u);
  EXPECT_EQ(b.kernel_n_tile(gemm), 128u);
  EXPECT_TRUE(b.kernel_casts_a_to_e4m3(gemm));
  EXPECT_EQ(b.kernel_name(gemm), "core::gemm");

  const ResolvedKernel& off = b.op_cache().kernel(b, "core", "cast_off");
  EXPECT_EQ(b.kernel_n_tile(off), 64u);
  EXPECT_FALSE(b.kernel_casts_a_to_e4m3(off));  // published, but zero

  const ResolvedKernel& fill = b.op_cache().kernel(b, "core", "fill_u32");
  EXPECT_EQ(b.kernel_n_tile(fill), 256u);
  EXPECT_FALSE(b.kernel_casts_a_to_e4m3(fill));  // not published at all
}

TEST(CudaKernels, AnAbsentSymbolIsFineUntilATileIsAskedFor) {
  Rig rig({.modules = {metadata_module()}});
  CudaBackend& b = rig.b();
  const ResolvedKernel& plain = b.op_cache().kernel(b, "core", "plain");
  ASSERT_TRUE(plain.handle);
  EXPECT_EQ(plain.meta.n_tile, 0u);
  EXPECT_FALSE(b.kernel_casts_a_to_e4m3(plain));
  const Error e = expect_error([&] { b.kernel_n_tile(plain); });
  EXPECT_EQ(e.code(), ErrorCode::kNotFound);
  EXPECT_THAT(e.what(), HasSubstr("[kernel_n_tile] core::plain publishes no N tile"));
}

TEST(CudaKernels, AnUnreadableSymbolFailsTheLookupNamingIt) {
  Rig rig({.modules = {metadata_module()}});
  CudaBackend& b = rig.b();
  const Error e = expect_error([&] { b.op_cache().kernel(b, "core", "locked"); });
  EXPECT_EQ(e.code(), ErrorCode::kDriver);
  EXPECT_THAT(e.what(), HasSubstr("[kernel]"));
  EXPECT_THAT(e.what(), HasSubstr("locked_n_tile"));
  EXPECT_THAT(e.what(), HasSubstr("cuModuleGetGlobal"));
  EXPECT_THAT(e.what(), HasSubstr("CUDA_ERROR_INVALID_VALUE (1)"));
  EXPECT_EQ(b.op_cache().kernel_count(), 0u);  // not memoized

  const Error flag = expect_error([&] { b.op_cache().kernel(b, "core", "locked_flag"); });
  EXPECT_THAT(flag.what(), HasSubstr("locked_flag_a_e4m3"));
  EXPECT_THAT(flag.what(), HasSubstr("CUDA_ERROR_ILLEGAL_STATE"));
}

TEST(CudaKernels, ATileThatIsNotFourBytesFailsTheLookup) {
  Rig rig({.modules = {metadata_module()}});
  CudaBackend& b = rig.b();
  const Error e = expect_error([&] { b.op_cache().kernel(b, "core", "short"); });
  EXPECT_THAT(e.what(), HasSubstr("core::short publishes short_n_tile as 2 byte(s)"));
  EXPECT_THAT(e.what(), HasSubstr("4-byte"));
  EXPECT_EQ(b.op_cache().kernel_count(), 0u);
}

TEST(CudaKernels, UnknownModulesAndFunctionsAreNotFound) {
  Rig rig;
  CudaBackend& b = rig.b();
  const Error mod = expect_error([&] { b.op_cache().kernel(b, "w4a16", "gemm"); });
  EXPECT_EQ(mod.code(), ErrorCode::kNotFound);
  EXPECT_THAT(mod.what(), HasSubstr("module 'w4a16' is not loaded on Fake H200 (sm_90)"));
  EXPECT_THAT(mod.what(), HasSubstr("backend_kernels_test.cpp:"));
  const Error fn = expect_error([&] { b.op_cache().kernel(b, "core", "gemv"); });
  EXPECT_EQ(fn.code(), ErrorCode::kNotFound);
  EXPECT_THAT(fn.what(), HasSubstr("module 'core' has no kernel 'gemv'"));
  // Failures are not memoized: a second request asks the driver again.
  const auto gets = rig.fd.calls("cuModuleGetFunction");
  EXPECT_THROW(b.op_cache().kernel(b, "core", "gemv"), Error);
  EXPECT_EQ(rig.fd.calls("cuModuleGetFunction"), gets + 1);
}

TEST(CudaKernels, TheOpCacheMemoizesAndTheDriverIsAskedOnce) {
  Rig rig;
  CudaBackend& b = rig.b();
  const auto gets = rig.fd.calls("cuModuleGetFunction");
  const ResolvedKernel& a = b.op_cache().kernel(b, "core", "fill_u32");
  const ResolvedKernel& again = b.op_cache().kernel(b, "core", "fill_u32");
  EXPECT_EQ(a, again);
  EXPECT_EQ(rig.fd.calls("cuModuleGetFunction"), gets + 1);
  EXPECT_EQ(b.op_cache().kernel_count(), 1u);
}

TEST(CudaKernels, LookupDuringACaptureIsRefusedButAMemoizedHitWorks) {
  Rig rig;
  CudaBackend& b = rig.b();
  const ResolvedKernel& fill = b.op_cache().kernel(b, "core", "fill_u32");
  const StreamHandle s = b.create_stream();
  b.begin_capture(s);
  const auto gets = rig.fd.calls("cuModuleGetFunction");
  const auto globals = rig.fd.calls("cuModuleGetGlobal");
  const Error e = expect_error([&] { b.op_cache().kernel(b, "core", "axpy_f32"); });
  EXPECT_EQ(e.code(), ErrorCode::kCapture);
  EXPECT_THAT(e.what(), HasSubstr("[kernel] cannot resolve core::axpy_f32"));
  EXPECT_THAT(e.what(), HasSubstr("before the capture"));
  EXPECT_EQ(rig.fd.calls("cuModuleGetFunction"), gets);
  EXPECT_EQ(rig.fd.calls("cuModuleGetGlobal"), globals);
  // The memoized handle needs no lookup.
  EXPECT_EQ(b.op_cache().kernel(b, "core", "fill_u32"), fill);
  // The capture is intact.
  EXPECT_TRUE(b.is_capturing(s));
  const GraphHandle g = b.end_capture(s);
  b.destroy_graph(g);
  // After the capture the lookup works.
  EXPECT_TRUE(b.op_cache().kernel(b, "core", "axpy_f32"));
  b.destroy_stream(s);
}

TEST(CudaKernels, TheLookupAuditRecordsEveryLookupWithItsCaller) {
  Rig rig;
  CudaBackend& b = rig.b();
  const int ok_line = __LINE__ + 1;
  b.kernel("core", "fill_u32");
  const int bad_line = __LINE__ + 1;
  EXPECT_THROW(b.kernel("core", "missing"), Error);
  const int cached_line = __LINE__ + 1;
  b.op_cache().kernel(b, "core", "axpy_f32");
  const std::vector<KernelLookup> audit = b.lookup_audit();
  ASSERT_EQ(audit.size(), 3u);
  EXPECT_EQ(audit[0].module, "core");
  EXPECT_EQ(audit[0].function, "fill_u32");
  EXPECT_TRUE(audit[0].resolved);
  EXPECT_EQ(audit[0].site.file_name(), "backend_kernels_test.cpp");
  EXPECT_EQ(audit[0].site.line, static_cast<std::uint32_t>(ok_line));
  EXPECT_TRUE(audit[0].error.empty());
  EXPECT_EQ(audit[1].function, "missing");
  EXPECT_FALSE(audit[1].resolved);
  EXPECT_EQ(audit[1].site.line, static_cast<std::uint32_t>(bad_line));
  EXPECT_THAT(audit[1].error, HasSubstr("has no kernel 'missing'"));
  // Through the OpCache the caller is still the test, not the cache.
  EXPECT_EQ(audit[2].function, "axpy_f32");
  EXPECT_EQ(audit[2].site.file_name(), "backend_kernels_test.cpp");
  EXPECT_EQ(audit[2].site.line, static_cast<std::uint32_t>(cached_line));
}

// ---- the start-up gate ----

ModuleSpec core_lacking_an_entry() {
  ModuleSpec m = core_module();
  m.entries.push_back("rms_norm");  // the build says core has it; the fake module does not
  return m;
}

TEST(CudaKernels, RequireKernelsPassesWhenEveryEntryResolves) {
  Rig rig;
  EXPECT_NO_THROW(rig.b().require_kernels());
  EXPECT_EQ(rig.b().op_cache().kernel_count(), 2u);  // fill_u32, axpy_f32 memoized
  const std::vector<std::string> extra = {"core::nop"};
  EXPECT_NO_THROW(rig.b().require_kernels(extra));
  EXPECT_EQ(rig.b().op_cache().kernel_count(), 3u);
}

TEST(CudaKernels, RequireKernelsFailsListingEveryEntryThatDidNotResolve) {
  Rig rig({.modules = {core_lacking_an_entry()}});
  const std::vector<std::string> extra = {"core::fill_u32", "core::gelu", "w4a16::gemm"};
  const Error e = expect_error([&] { rig.b().require_kernels(extra); });
  EXPECT_EQ(e.code(), ErrorCode::kNotFound);
  EXPECT_THAT(e.what(), HasSubstr("[require_kernels] 3 kernel(s) this build should have did not "
                                  "resolve on Fake H200 (sm_90): core::rms_norm, core::gelu, "
                                  "w4a16::gemm"));
  const Error one = expect_error([&] { rig.b().require_kernels(); });
  EXPECT_THAT(one.what(), HasSubstr("1 kernel(s)"));
  EXPECT_THAT(one.what(), HasSubstr("core::rms_norm"));
}

TEST(CudaKernels, RequireKernelsWithAllowMissingOnlyWarns) {
  Rig rig({.modules = {core_lacking_an_entry()}});
  LogCapture logs;
  EXPECT_NO_THROW(rig.b().require_kernels({}, /*allow_missing=*/true));
  EXPECT_EQ(logs.count(log::Level::kWarn, "1 kernel(s) did not resolve (allowed): core::rms_norm"),
            1u);
  // What did resolve is memoized.
  EXPECT_EQ(rig.b().op_cache().kernel_count(), 2u);
}

TEST(CudaKernels, RequireKernelsRefusesAMalformedRequirement) {
  Rig rig;
  const std::vector<std::string> extra = {"fill_u32"};
  const Error e = expect_error([&] { rig.b().require_kernels(extra); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("'fill_u32' is not of the form module::function"));
}

TEST(CudaKernels, RequireKernelsPropagatesErrorsOtherThanNotFound) {
  ModuleSpec m = core_module();
  m.fake.globals["fill_u32_n_tile"].get_status = CUDA_ERROR_INVALID_VALUE;
  Rig rig({.modules = {m}});
  const Error e = expect_error([&] { rig.b().require_kernels({}, /*allow_missing=*/true); });
  EXPECT_EQ(e.code(), ErrorCode::kDriver);
  EXPECT_THAT(e.what(), HasSubstr("fill_u32_n_tile"));
}

// ---- listing ----

TEST(CudaKernels, HasModuleAndTheModuleListing) {
  ModuleSpec jit;
  jit.name = "w4a16";
  jit.fake.functions["gemm"] = FakeFunction{};
  jit.targets = {"compute_80"};
  jit.entries = {"gemm"};
  Rig rig({.modules = {core_module(), jit}});
  CudaBackend& b = rig.b();
  EXPECT_TRUE(b.has_module("core"));
  EXPECT_TRUE(b.has_module("w4a16"));
  EXPECT_FALSE(b.has_module("attention"));
  EXPECT_EQ(b.name(), "cuda");
  EXPECT_EQ(b.device_name(), "Fake H200");
  const std::vector<ModuleListing> listing = b.modules();
  ASSERT_EQ(listing.size(), 2u);
  EXPECT_EQ(listing[0].name, "core");
  EXPECT_EQ(listing[0].target, "sm_90a");
  EXPECT_EQ(listing[0].kernels, (std::vector<std::string>{"fill_u32", "axpy_f32"}));
  EXPECT_EQ(listing[1].name, "w4a16");
  EXPECT_EQ(listing[1].target, "compute_80 (JIT from PTX)");
  EXPECT_EQ(listing[1].kernels, (std::vector<std::string>{"gemm"}));
}

}  // namespace
}  // namespace metrale::cuda::testing
