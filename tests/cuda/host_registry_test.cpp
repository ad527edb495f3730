// The CUDA host (one device's primary context and stream) and the module registry (preflight,
// JIT notice, skipped modules, release while held, load failures) on the fake driver, and the
// process host on the real driver, written to hold with or without a GPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "cuda/rig.h"
#include "metrale/error.h"
#include "support/log_capture.h"

namespace metrale::cuda::testing {
namespace {

using metrale::testing::expect_error;
using metrale::testing::LogCapture;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// ---- the host ----

TEST(CudaHost, CreateReadsTheDeviceAndRetainsItsPrimaryContext) {
  FakeDevice dev;
  dev.name = "Fake L4";
  dev.cc_major = 8;
  dev.cc_minor = 9;
  dev.sm_count = 58;
  dev.total_memory = std::size_t{24} << 30;
  Rig rig({.devices = {dev}, .make_registry = false});
  const auto host = CudaHost::create(rig.table, 0, kDriverVersion);
  const DeviceInfo& info = host->info();
  EXPECT_EQ(info.ordinal, 0);
  EXPECT_EQ(info.name, "Fake L4");
  EXPECT_EQ(info.cc, (ComputeCapability{8, 9}));
  EXPECT_EQ(info.sm_count, 58);
  EXPECT_EQ(info.total_memory, std::size_t{24} << 30);
  EXPECT_FALSE(info.integrated);
  EXPECT_TRUE(info.managed_memory);
  EXPECT_EQ(info.max_shared_optin, 232448);
  EXPECT_EQ(info.driver_version, kDriverVersion);
  EXPECT_NE(host->context(), nullptr);
  EXPECT_NE(host->stream(), nullptr);
  EXPECT_FALSE(host->faulted());
  EXPECT_EQ(rig.fd.outstanding().contexts, 1u);
  EXPECT_EQ(rig.fd.outstanding().streams, 1u);
}

TEST(CudaHost, DestroyingTheHostReleasesItsStreamAndContext) {
  Rig rig({.make_registry = false});
  auto host = CudaHost::create(rig.table, 0, kDriverVersion);
  host.reset();
  EXPECT_TRUE(rig.fd.outstanding().none());
}

TEST(CudaHost, NoDeviceIsUnavailable) {
  Rig rig({.devices = {}, .make_registry = false});
  const Error e = expect_error([&] { CudaHost::create(rig.table, 0, kDriverVersion); });
  EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
  EXPECT_THAT(e.what(), HasSubstr("CUDA unavailable: no CUDA device"));
  EXPECT_TRUE(rig.fd.outstanding().none());
}

TEST(CudaHost, AMissingOrdinalIsUnavailable) {
  Rig rig({.make_registry = false});
  const Error e = expect_error([&] { CudaHost::create(rig.table, 1, kDriverVersion); });
  EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
  EXPECT_THAT(e.what(), HasSubstr("device ordinal 1 does not exist (1 device(s))"));
}

TEST(CudaHost, AFailingPrimaryContextRetainNamesTheCall) {
  Rig rig({.make_registry = false});
  rig.fd.fail_at("cuDevicePrimaryCtxRetain", 1, CUDA_ERROR_INVALID_DEVICE);
  const Error e = expect_error([&] { CudaHost::create(rig.table, 0, kDriverVersion); });
  EXPECT_EQ(e.code(), ErrorCode::kDriver);
  EXPECT_THAT(e.what(), HasSubstr("[cuda] cuDevicePrimaryCtxRetain failed: "
                                  "CUDA_ERROR_INVALID_DEVICE (101)"));
  EXPECT_TRUE(rig.fd.outstanding().none());
  EXPECT_EQ(rig.fd.calls("cuDevicePrimaryCtxRelease"), 0u);  // nothing retained, nothing released
}

TEST(CudaHost, AFailingStreamCreateReleasesTheContext) {
  Rig rig({.make_registry = false});
  rig.fd.fail_at("cuStreamCreate", 1, CUDA_ERROR_OUT_OF_MEMORY);
  const Error e = expect_error([&] { CudaHost::create(rig.table, 0, kDriverVersion); });
  EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory);
  EXPECT_THAT(e.what(), HasSubstr("cuStreamCreate failed"));
  EXPECT_TRUE(rig.fd.outstanding().none());
}

TEST(CudaHost, AFailingAttributeQueryNamesTheAttribute) {
  Rig rig({.make_registry = false});
  rig.fd.fail_at("cuDeviceGetAttribute", 3, CUDA_ERROR_INVALID_VALUE);
  const Error e = expect_error([&] { CudaHost::create(rig.table, 0, kDriverVersion); });
  EXPECT_THAT(e.what(), HasSubstr("cuDeviceGetAttribute(SM count) failed"));
}

// The real driver: absent on a build machine (both calls give the same remembered error),
// present on a GPU machine (both calls give the same host). Either way the process uses one
// ordinal.
TEST(CudaHost, TheProcessHostIsDecidedOnceAndKeepsItsOrdinal) {
  std::shared_ptr<CudaHost> first, second;
  std::optional<Error> first_error, second_error;
  try {
    first = CudaHost::process(0);
  } catch (const Error& e) {
    first_error = e;
  }
  try {
    second = CudaHost::process(0);
  } catch (const Error& e) {
    second_error = e;
  }
  ASSERT_EQ(first_error.has_value(), second_error.has_value());
  if (first_error) {
    EXPECT_EQ(std::string(first_error->what()), second_error->what());
    EXPECT_EQ(first_error->code(), second_error->code());
    EXPECT_THAT(first_error->what(), StartsWith("[cuda] "));
  } else {
    ASSERT_NE(first, nullptr);
    EXPECT_EQ(first, second);
  }
  const Error other = expect_error([] { CudaHost::process(1); });
  EXPECT_EQ(other.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(other.what(), HasSubstr("this process uses CUDA device 0; device 1 cannot be added"));
}

// ---- the module registry ----

TEST(CudaRegistry, ADeviceThatRunsNoModuleIsRefusedBeforeAnythingLoads) {
  FakeDevice turing;
  turing.name = "Fake T4";
  turing.cc_major = 7;
  turing.cc_minor = 5;
  ModuleSpec other = core_module();
  other.name = "w4a16";
  other.targets = {"sm_80", "compute_90"};
  Rig rig({.devices = {turing}, .modules = {core_module(), other}, .make_registry = false});
  auto host = CudaHost::create(rig.table, 0, kDriverVersion);
  const Error e = expect_error([&] { ModuleRegistry::load(host, rig.modules.span()); });
  EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
  EXPECT_THAT(e.what(),
              HasSubstr("CUDA unavailable: device 0 (Fake T4, sm_75) runs none of the embedded "
                        "modules (core: sm_90a; w4a16: sm_80 compute_90)"));
  EXPECT_EQ(rig.fd.calls("cuModuleLoadData"), 0u);
  EXPECT_EQ(rig.fd.outstanding().modules, 0u);
}

TEST(CudaRegistry, APtxOnlyModuleLoadsWithOneJitNotice) {
  ModuleSpec ptx = core_module();
  ptx.targets = {"compute_80"};
  Rig rig({.modules = {ptx}, .make_registry = false});
  auto host = CudaHost::create(rig.table, 0, kDriverVersion);
  LogCapture logs(log::Level::kInfo);
  const auto reg = ModuleRegistry::load(host, rig.modules.span());
  EXPECT_EQ(logs.count(log::Level::kInfo, "JIT"), 1u);
  EXPECT_EQ(logs.count(log::Level::kInfo, "cuda: module core has no machine code for sm_90"), 1u);
  ASSERT_EQ(reg->loaded().size(), 1u);
  EXPECT_TRUE(reg->loaded()[0].choice.via_ptx);
  EXPECT_EQ(reg->loaded()[0].choice.target, "compute_80");
  EXPECT_EQ(rig.fd.outstanding().modules, 1u);
}

TEST(CudaRegistry, MachineCodeLoadsWithoutAJitNotice) {
  ModuleSpec both = core_module();
  both.targets = {"compute_90", "sm_90a"};
  Rig rig({.modules = {both}, .make_registry = false});
  auto host = CudaHost::create(rig.table, 0, kDriverVersion);
  LogCapture logs(log::Level::kInfo);
  const auto reg = ModuleRegistry::load(host, rig.modules.span());
  EXPECT_EQ(logs.count(log::Level::kInfo, "JIT"), 0u);
  EXPECT_EQ(reg->loaded()[0].choice.target, "sm_90a");
}

TEST(CudaRegistry, AModuleThatDoesNotRunIsSkippedAndListed) {
  ModuleSpec ampere;
  ampere.name = "w4a16";
  ampere.fake.functions["gemm"] = FakeFunction{};
  ampere.targets = {"sm_80"};
  ampere.entries = {"gemm"};
  Rig rig({.modules = {core_module(), ampere}});
  EXPECT_TRUE(rig.registry->has("core"));
  EXPECT_FALSE(rig.registry->has("w4a16"));
  EXPECT_EQ(rig.registry->find("w4a16"), nullptr);
  ASSERT_EQ(rig.registry->skipped().size(), 1u);
  EXPECT_EQ(rig.registry->skipped()[0], "w4a16: carries sm_80, nothing for sm_90");
  EXPECT_EQ(rig.fd.calls("cuModuleLoadData"), 1u);
  EXPECT_EQ(rig.fd.outstanding().modules, 1u);
  // A skipped module is neither listed nor required at start-up.
  EXPECT_EQ(rig.b().modules().size(), 1u);
  EXPECT_NO_THROW(rig.b().require_kernels());
  const Error e = expect_error([&] { rig.b().kernel("w4a16", "gemm"); });
  EXPECT_EQ(e.code(), ErrorCode::kNotFound);
}

TEST(CudaRegistry, ReleaseRefusesWhileABackendHoldsTheRegistry) {
  Rig rig;
  const Error e = expect_error([&] { ModuleRegistry::release(rig.registry); });
  EXPECT_EQ(e.code(), ErrorCode::kState);
  EXPECT_THAT(e.what(), HasSubstr("[release_registry] 1 other holder(s)"));
  EXPECT_THAT(e.what(), HasSubstr("nothing was unloaded"));
  ASSERT_NE(rig.registry, nullptr);
  EXPECT_EQ(rig.fd.outstanding().modules, 1u);
  EXPECT_EQ(rig.fd.calls("cuModuleUnload"), 0u);
  // The backend still works.
  EXPECT_TRUE(rig.b().op_cache().kernel(rig.b(), "core", "fill_u32"));

  rig.backend.reset();
  EXPECT_NO_THROW(ModuleRegistry::release(rig.registry));
  EXPECT_EQ(rig.registry, nullptr);
  EXPECT_EQ(rig.fd.outstanding().modules, 0u);
  EXPECT_NO_THROW(ModuleRegistry::release(rig.registry));  // null: nothing to do
}

TEST(CudaRegistry, ReleaseTriesEveryModuleAndRethrowsTheFirstFailure) {
  ModuleSpec second = core_module();
  second.name = "w4a16";
  ModuleSpec third = core_module();
  third.name = "attention";
  Rig rig({.modules = {core_module(), second, third}, .make_backend = false});
  rig.fd.fail_at("cuModuleUnload", 2, CUDA_ERROR_INVALID_HANDLE);
  LogCapture logs;
  const Error e = expect_error([&] { ModuleRegistry::release(rig.registry); });
  EXPECT_EQ(e.code(), ErrorCode::kDriver);
  EXPECT_THAT(e.what(), HasSubstr("cuModuleUnload(w4a16) failed: CUDA_ERROR_INVALID_HANDLE"));
  EXPECT_EQ(rig.fd.calls("cuModuleUnload"), 3u);
  EXPECT_EQ(rig.fd.outstanding().modules, 1u);  // the one whose unload failed
  EXPECT_EQ(logs.count(log::Level::kWarn, "unloading module w4a16 failed"), 1u);
}

TEST(CudaRegistry, AFailedLoadLeavesNothingLoaded) {
  ModuleSpec unknown = core_module();
  unknown.name = "w4a16";
  unknown.register_with_fake = false;  // the driver refuses its image
  ModuleSpec after = core_module();
  after.name = "attention";
  Rig rig({.modules = {core_module(), unknown, after}, .make_registry = false});
  auto host = CudaHost::create(rig.table, 0, kDriverVersion);
  const Error e = expect_error([&] { ModuleRegistry::load(host, rig.modules.span()); });
  EXPECT_EQ(e.code(), ErrorCode::kDriver);
  EXPECT_THAT(e.what(), HasSubstr("cuModuleLoadData(w4a16, unknown image) failed: "
                                  "CUDA_ERROR_INVALID_IMAGE"));
  EXPECT_EQ(rig.fd.calls("cuModuleLoadData"), 2u);  // stopped at the failure
  EXPECT_EQ(rig.fd.outstanding().modules, 0u);      // core was unloaded again
}

TEST(CudaRegistry, AnInjectedLoadFailureOnTheFirstModuleLeavesNothingLoaded) {
  Rig rig({.make_registry = false});
  auto host = CudaHost::create(rig.table, 0, kDriverVersion);
  rig.fd.fail_at("cuModuleLoadData", 1, CUDA_ERROR_OUT_OF_MEMORY);
  const Error e = expect_error([&] { ModuleRegistry::load(host, rig.modules.span()); });
  EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory);
  EXPECT_THAT(e.what(), StartsWith("[cuda] cuModuleLoadData(core"));
  EXPECT_EQ(rig.fd.outstanding().modules, 0u);
}

TEST(CudaRegistry, DestroyingTheRegistryUnloadsItsModules) {
  Rig rig({.make_backend = false});
  EXPECT_EQ(rig.fd.outstanding().modules, 1u);
  rig.registry.reset();
  EXPECT_EQ(rig.fd.outstanding().modules, 0u);
}

}  // namespace
}  // namespace metrale::cuda::testing
