// The fake driver's modules (the images fake_image() makes), their functions and globals, and
// kernel launches with optional host bodies.
#include "cuda/fake_state.h"

#include <cstring>
#include <utility>

namespace metrale::cuda::testing::fake {

// Records the launch and runs its body with the lock released.
void run_launch(Gate& g, FakeLaunch launch, const std::function<void(const FakeLaunch&)>& body,
                void** params) {
  g.s->launches.push_back(launch);
  g.s->clock_ms += g.s->launch_ms;
  if (!body) return;
  launch.params = params;
  const auto run = body;  // the body may unload the module that holds it
  g.lock.unlock();
  run(launch);
  g.lock.lock();
}

CUresult check_launch(const Function& f, const FakeLaunch& l, void** params, void** extra) {
  if (extra != nullptr) return CUDA_ERROR_INVALID_VALUE;  // the fake takes kernelParams only
  if (!f.fn.param_sizes.empty() && params == nullptr) return CUDA_ERROR_INVALID_VALUE;
  for (int i = 0; i < 3; ++i) {
    if (l.grid[i] == 0 || l.block[i] == 0) return CUDA_ERROR_INVALID_VALUE;
  }
  if (l.grid[1] > 65535 || l.grid[2] > 65535 || l.block[0] > 1024 || l.block[1] > 1024 ||
      l.block[2] > 64) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  const std::uint64_t threads = std::uint64_t{l.block[0]} * l.block[1] * l.block[2];
  if (threads > 1024) return CUDA_ERROR_INVALID_VALUE;
  const int limit = f.max_dynamic >= 0 ? f.max_dynamic : kDefaultDynamicShared;
  if (l.shared_bytes > static_cast<unsigned>(limit)) return CUDA_ERROR_INVALID_VALUE;
  return CUDA_SUCCESS;
}

// A captured launch, with its arguments copied when their sizes are known.
LaunchOp capture_launch(const Function& f, const FakeLaunch& l, void** params) {
  LaunchOp op{l, f.fn.body, params, {}, {}};
  for (std::size_t i = 0; i < f.fn.param_sizes.size(); ++i) {
    const std::size_t size = f.fn.param_sizes[i];
    op.arg_chunk.push_back(op.args.size());
    op.args.resize(op.args.size() + (size + sizeof(ArgChunk) - 1) / sizeof(ArgChunk));
    if (size != 0) std::memcpy(&op.args[op.arg_chunk.back()], params[i], size);
  }
  if (!f.fn.param_sizes.empty()) op.caller_params = nullptr;
  return op;
}

CUresult fake_cuModuleLoadData(CUmodule* module, const void* image) {
  FAKE_ENTER(Need::kContext);
  if (module == nullptr || image == nullptr) return CUDA_ERROR_INVALID_VALUE;
  // Compare the prefix first so a real (binary) image is not read past its first bytes.
  const char* text = static_cast<const char*>(image);
  if (std::strncmp(text, kImagePrefix.data(), kImagePrefix.size()) != 0) {
    return CUDA_ERROR_INVALID_IMAGE;
  }
  auto reg = s.registered.find(text + kImagePrefix.size());
  if (reg == s.registered.end()) return CUDA_ERROR_INVALID_IMAGE;
  LoadedModule loaded{reg->second, {}, {}};
  for (const auto& [name, global] : reg->second.globals) {
    const CUdeviceptr p = allocate(s, global.bytes.size(), Kind::kGlobal, current_device(s));
    if (!global.bytes.empty()) std::memcpy(to_host(p), global.bytes.data(), global.bytes.size());
    loaded.globals[name] = p;
  }
  *module = new_handle<CUmodule>(s);
  s.modules[*module] = std::move(loaded);
  return CUDA_SUCCESS;
}

// Its functions and globals go with it.
CUresult fake_cuModuleUnload(CUmodule module) {
  FAKE_ENTER(Need::kContext);
  auto it = s.modules.find(module);
  if (it == s.modules.end()) return CUDA_ERROR_INVALID_HANDLE;
  for (const auto& [name, f] : it->second.functions) s.functions.erase(f);
  for (const auto& [name, p] : it->second.globals) release(s, p, {Kind::kGlobal});
  s.modules.erase(it);
  return CUDA_SUCCESS;
}

// The same entry of the same module gives the same handle every time.
CUresult fake_cuModuleGetFunction(CUfunction* func, CUmodule module, const char* name) {
  FAKE_ENTER(Need::kContext);
  if (func == nullptr || name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  auto mod = s.modules.find(module);
  if (mod == s.modules.end()) return CUDA_ERROR_INVALID_HANDLE;
  LoadedModule& loaded = mod->second;
  if (auto known = loaded.functions.find(name); known != loaded.functions.end()) {
    *func = known->second;
    return CUDA_SUCCESS;
  }
  auto entry = loaded.desc.functions.find(name);
  if (entry == loaded.desc.functions.end()) return CUDA_ERROR_NOT_FOUND;
  *func = new_handle<CUfunction>(s);
  loaded.functions[name] = *func;
  s.functions[*func] = Function{name, entry->second, -1};
  return CUDA_SUCCESS;
}

CUresult fake_cuModuleGetGlobal(CUdeviceptr* dptr, std::size_t* bytes, CUmodule module,
                                const char* name) {
  FAKE_ENTER(Need::kContext);
  if (name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  auto mod = s.modules.find(module);
  if (mod == s.modules.end()) return CUDA_ERROR_INVALID_HANDLE;
  auto p = mod->second.globals.find(name);
  if (p == mod->second.globals.end()) return CUDA_ERROR_NOT_FOUND;
  const FakeGlobal& desc = mod->second.desc.globals.at(name);
  if (desc.get_status != CUDA_SUCCESS) return desc.get_status;
  if (dptr != nullptr) *dptr = p->second;
  if (bytes != nullptr) *bytes = desc.bytes.size();
  return CUDA_SUCCESS;
}

CUresult fake_cuFuncSetAttribute(CUfunction func, CUfunction_attribute attrib, int value) {
  FAKE_ENTER(Need::kContext);
  auto f = s.functions.find(func);
  if (f == s.functions.end()) return CUDA_ERROR_INVALID_HANDLE;
  if (attrib == CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT) {
    return value >= -1 && value <= 100 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
  }
  if (attrib != CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) return CUDA_ERROR_INVALID_VALUE;
  if (value < 0 || value > kSharedOptin) return CUDA_ERROR_INVALID_VALUE;
  f->second.max_dynamic = value;
  s.last_max_dynamic[f->second.name] = value;
  return CUDA_SUCCESS;
}

CUresult fake_cuLaunchKernel(CUfunction func, unsigned int gx, unsigned int gy, unsigned int gz,
                             unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared,
                             CUstream stream, void** params, void** extra) {
  FAKE_ENTER(Need::kContext);
  FAKE_STICKY();
  auto f = s.functions.find(func);
  Stream* st = find_stream(s, stream);
  if (f == s.functions.end() || st == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  const FakeLaunch launch{f->second.name, {gx, gy, gz}, {bx, by, bz}, shared, stream, nullptr};
  if (CUresult bad = check_launch(f->second, launch, params, extra); bad != CUDA_SUCCESS) {
    return bad;
  }
  if (breaks_blocking_capture(s, stream)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  if (st->capture != CU_STREAM_CAPTURE_STATUS_NONE) {
    return record(*st, capture_launch(f->second, launch, params));
  }
  run_launch(g, launch, f->second.fn.body, params);
  return CUDA_SUCCESS;
}

}  // namespace metrale::cuda::testing::fake
