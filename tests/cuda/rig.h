// Shared set-up of the CUDA backend tests: a fake driver (tests/cuda/fake_driver.h), the
// embedded-module descriptions handed to the registry, and a "rig" that builds host, registry
// and backend on the fake in the order production code does. Also the fake kernels whose host
// bodies emulate the real core kernels over the whole grid, so the same ops code can run.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "cuda/backend.h"
#include "cuda/embedded_modules.h"
#include "cuda/fake_driver.h"
#include "cuda/host.h"
#include "cuda/module_registry.h"
#include "metrale/kernel_args.h"
#include "metrale/numerics.h"

namespace metrale::cuda::testing {

inline constexpr int kDriverVersion = 13000;

// Device memory of the fake is host memory at the same address: kernels' view of a buffer.
template <class T>
T* host_view(DevicePtr p) {
  return reinterpret_cast<T*>(static_cast<std::uintptr_t>(p.address()));
}

// Calls at(i) for each element the real core kernels (src/cuda/kernels/core.cu) touch in a
// launch: block bx's thread t covers bx * tile + t + j * threads for j < tile / threads, the
// stride being the block size the kernel is written for (`threads`), not the launch's. So a
// launch with fewer threads leaves elements unwritten and one with more touches some twice, as
// on the device.
template <class F>
void for_core_elements(const FakeLaunch& l, std::uint32_t tile, std::uint32_t threads,
                       std::uint32_t n, F&& at) {
  for (std::uint64_t bx = 0; bx < l.grid[0]; ++bx) {
    for (std::uint64_t t = 0; t < l.block[0]; ++t) {
      for (std::uint64_t j = 0; j < tile / threads; ++j) {
        const std::uint64_t i = bx * tile + t + j * threads;
        if (i < n) at(i);
      }
    }
  }
}

// fill_u32(out, value, n): out[i] = value. A grid sized from a wrong tile, or a block of other
// than `threads`, leaves elements unwritten.
inline FakeFunction fill_u32_kernel(std::uint32_t tile, std::uint32_t threads = 0) {
  if (threads == 0) threads = tile;
  FakeFunction f;
  f.param_sizes = {sizeof(std::uint64_t), sizeof(std::uint32_t), sizeof(std::uint32_t)};
  f.body = [tile, threads](const FakeLaunch& l) {
    auto* out = reinterpret_cast<std::uint32_t*>(
        static_cast<std::uintptr_t>(read_param<std::uint64_t>(l.params, 0)));
    const auto value = read_param<std::uint32_t>(l.params, 1);
    const auto n = read_param<std::uint32_t>(l.params, 2);
    for_core_elements(l, tile, threads, n, [&](std::uint64_t i) { out[i] = value; });
  };
  return f;
}

// axpy_f32(y, x, a, n): y[i] = a * x[i] + y[i], covered like fill_u32_kernel.
inline FakeFunction axpy_f32_kernel(std::uint32_t tile, std::uint32_t threads = 0) {
  if (threads == 0) threads = tile;
  FakeFunction f;
  f.param_sizes = {sizeof(std::uint64_t), sizeof(std::uint64_t), sizeof(float),
                   sizeof(std::uint32_t)};
  f.body = [tile, threads](const FakeLaunch& l) {
    auto* y = reinterpret_cast<float*>(
        static_cast<std::uintptr_t>(read_param<std::uint64_t>(l.params, 0)));
    const auto* x = reinterpret_cast<const float*>(
        static_cast<std::uintptr_t>(read_param<std::uint64_t>(l.params, 1)));
    const auto a = read_param<float>(l.params, 2);
    const auto n = read_param<std::uint32_t>(l.params, 3);
    for_core_elements(l, tile, threads, n, [&](std::uint64_t i) { y[i] = a * x[i] + y[i]; });
  };
  return f;
}

// cast_f32_bf16(out, in, n): out[i] = in[i] rounded to BF16 (nearest even), covered like
// fill_u32_kernel: the row-parallel GEMM's one rounding of its FP32 sum.
inline FakeFunction cast_f32_bf16_kernel(std::uint32_t tile, std::uint32_t threads = 0) {
  if (threads == 0) threads = tile;
  FakeFunction f;
  f.param_sizes = {sizeof(std::uint64_t), sizeof(std::uint64_t), sizeof(std::uint32_t)};
  f.body = [tile, threads](const FakeLaunch& l) {
    auto* out = reinterpret_cast<std::uint16_t*>(
        static_cast<std::uintptr_t>(read_param<std::uint64_t>(l.params, 0)));
    const auto* in = reinterpret_cast<const float*>(
        static_cast<std::uintptr_t>(read_param<std::uint64_t>(l.params, 1)));
    const auto n = read_param<std::uint32_t>(l.params, 2);
    for_core_elements(l, tile, threads, n,
                      [&](std::uint64_t i) { out[i] = num::f32_to_bf16(in[i]); });
  };
  return f;
}

// Runs f on a new thread (one that never bound a context) and waits for it. An exception
// there fails the test instead of terminating the program.
template <class F>
void on_new_thread(F&& f) {
  std::thread([&] {
    try {
      f();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "the thread threw: " << e.what();
    }
  }).join();
}

// One embedded module: what the fake registers under `name` and what the registry is told.
struct ModuleSpec {
  std::string name = "core";
  FakeModule fake;
  std::vector<std::string> targets = {"sm_90a"};
  std::vector<std::string> entries;
  bool register_with_fake = true;  // false: cuModuleLoadData refuses its image
};

// The "core" module: fill_u32, axpy_f32 and cast_f32_bf16 with bodies, each publishing
// `tile` and `threads` (0: as many threads as the tile, one element each), and "nop" (no body,
// no parameters) for launches that only exercise the host rules.
inline ModuleSpec core_module(std::uint32_t tile = 256, std::uint32_t threads = 0) {
  if (threads == 0) threads = tile;
  ModuleSpec m;
  m.fake.functions["fill_u32"] = fill_u32_kernel(tile, threads);
  m.fake.functions["axpy_f32"] = axpy_f32_kernel(tile, threads);
  m.fake.functions["cast_f32_bf16"] = cast_f32_bf16_kernel(tile, threads);
  m.fake.functions["nop"] = FakeFunction{};
  for (const char* e : {"fill_u32", "axpy_f32", "cast_f32_bf16"}) {
    m.fake.publish_u32(std::string(e) + "_n_tile", tile);
    m.fake.publish_u32(std::string(e) + "_block_threads", threads);
  }
  // The manifest the backend tests count (backend_kernels_test.cpp); cast_f32_bf16 resolves by
  // name all the same.
  m.entries = {"fill_u32", "axpy_f32"};
  return m;
}

// Owns the bytes the EmbeddedModule descriptions point at.
class ModuleSet {
 public:
  void add(const ModuleSpec& spec) {
    auto owned = std::make_unique<Owned>();
    owned->name = spec.name;
    owned->image = FakeDriver::fake_image(spec.name);
    owned->targets = spec.targets;
    owned->entries = spec.entries;
    owned->module.name = owned->name;
    owned->module.image = owned->image;
    for (const std::string& t : owned->targets) owned->module.targets.emplace_back(t);
    for (const std::string& e : owned->entries) owned->module.entries.emplace_back(e);
    ptrs_.push_back(&owned->module);
    owned_.push_back(std::move(owned));
  }
  std::span<const EmbeddedModule* const> span() const { return ptrs_; }

 private:
  struct Owned {
    std::string name;
    std::vector<unsigned char> image;
    std::vector<std::string> targets, entries;
    EmbeddedModule module;
  };
  std::vector<std::unique_ptr<Owned>> owned_;
  std::vector<const EmbeddedModule*> ptrs_;
};

struct RigOptions {
  std::vector<FakeDevice> devices = {FakeDevice{}};
  std::vector<ModuleSpec> modules = {core_module()};
  // Edits the copy of the fake's table that the host is built on (to observe calls).
  std::function<void(DriverApi&)> tweak_api = nullptr;
  bool make_registry = true;
  bool make_backend = true;
  // The host's cuBLASLt (tests/cuda/fake_blas.h); empty: none, dense GEMMs unavailable.
  BlasSource blas = {};
};

// A fake driver with cuInit done, then (as asked) host, registry and backend on device 0.
// Members are destroyed backend first, fake last, as a process would tear them down.
class Rig {
 public:
  explicit Rig(RigOptions options = {}) : fd(std::move(options.devices)), table(fd.api()) {
    for (const ModuleSpec& m : options.modules) {
      if (m.register_with_fake) fd.add_module(m.name, m.fake);
      modules.add(m);
    }
    if (options.tweak_api) options.tweak_api(table);
    EXPECT_EQ(table.cuInit(0), CUDA_SUCCESS);
    if (!options.make_registry) return;
    host = CudaHost::create(table, 0, kDriverVersion, std::move(options.blas));
    registry = ModuleRegistry::load(host, modules.span());
    if (options.make_backend) make_backend();
  }
  Rig(const Rig&) = delete;
  Rig& operator=(const Rig&) = delete;

  // A fresh backend on the rig's host and registry, with guard bands and debug sync off
  // whatever the environment says.
  CudaBackend& make_backend() {
    backend = std::make_unique<CudaBackend>(host, registry);
    backend->set_guard_bands(GuardBandConfig{});
    backend->set_debug_sync(false);
    return *backend;
  }
  CudaBackend& b() { return *backend; }
  // Drops backend, registry and host, in that order.
  void drop_all() {
    backend.reset();
    registry.reset();
    host.reset();
  }

  FakeDriver fd;
  DriverApi table;  // the table the host uses (fd.api() unless tweaked)
  ModuleSet modules;
  std::shared_ptr<CudaHost> host;
  std::shared_ptr<ModuleRegistry> registry;
  std::unique_ptr<CudaBackend> backend;
};

}  // namespace metrale::cuda::testing
