// NVTX ranges around ops: with libnvToolsExt.so.1 on the library path (ctest ops.nvtx supplies
// a fake that records them) each op pushes one named range and pops it; without it they are
// no-ops.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include "core/nvtx.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/ops/elementwise.h"

namespace metrale {
namespace {

TEST(Nvtx, EachOpPushesOneNamedRangeAndPopsIt) {
  if (!nvtx::available()) {
    GTEST_SKIP() << "libnvToolsExt.so.1 is not on the library path (ctest ops.nvtx puts a fake "
                    "there)";
  }
  void* lib = dlopen("libnvToolsExt.so.1", RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(lib, nullptr);
  const auto depth = reinterpret_cast<int (*)()>(dlsym(lib, "fake_nvtx_depth"));
  const auto pushes = reinterpret_cast<int (*)(const char*)>(dlsym(lib, "fake_nvtx_pushes"));
  ASSERT_TRUE(depth != nullptr && pushes != nullptr) << "not the test's fake library";
  CpuBackend b(CpuBackendOptions{.threads = 1});
  const DevicePtr x = b.alloc(1024), y = b.alloc(1024);
  ops::fill_u32(b, b.default_stream(), x, 256, 0);
  ops::fill_u32(b, b.default_stream(), y, 256, 0);
  ops::axpy_f32(b, b.default_stream(), y, x, 1.0f, 256);
  EXPECT_EQ(pushes("metrale::ops::fill_u32"), 2);
  EXPECT_EQ(pushes("metrale::ops::axpy_f32"), 1);
  EXPECT_EQ(depth(), 0);
  // A failing op pops its range too.
  EXPECT_THROW(ops::fill_u32(b, b.default_stream(), DevicePtr{}, 256, 0), Error);
  EXPECT_EQ(pushes("metrale::ops::fill_u32"), 3);
  EXPECT_EQ(depth(), 0);
  b.free(x);
  b.free(y);
  dlclose(lib);
}

TEST(Nvtx, WithoutTheLibraryARangeIsANoOp) {
  if (nvtx::available()) GTEST_SKIP() << "libnvToolsExt.so.1 is present";
  const nvtx::Range r("metrale::test");
  CpuBackend b(CpuBackendOptions{.threads = 1});
  const DevicePtr x = b.alloc(1024);
  ops::fill_u32(b, b.default_stream(), x, 256, 0);
  b.free(x);
  SUCCEED();
}

}  // namespace
}  // namespace metrale
