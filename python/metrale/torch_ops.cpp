// metrale::linear as a C++ torch operator: the CPU kernel calls metrale's GEMM through the C entry
// the _metrale extension exports (python/src/native_gemm.cpp), so a call costs torch's C++
// dispatch and the GEMM, not a Python function (docs/PERF.md, metrale.torch's per-call cost).
// Built by metrale/torch_native.py against the installed torch's headers on first use; when it
// cannot be built, metrale.torch defines the same operator in Python instead.
//
// Only the well-formed call runs here. Anything else (an unknown handle, a dtype, a shape, a
// device, a closed model, a failed GEMM) goes to the Python implementation of the same call,
// metrale.torch._linear_python, whose error (a metrale.Error subclass) reaches the caller as
// raised, so both builds fail alike. Gradients: torch's not-implemented autograd fallback, as a
// Python custom op without a backward has (its backward raises).
#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <unordered_map>

namespace {

// native_gemm.cpp's host_gemm: 0, or an ErrorCode + 1 with its message in err.
using Body = void (*)(void* arg, std::size_t begin, std::size_t end);
using ParallelFor = void (*)(void* ctx, std::size_t n, Body body, void* arg);
using HostGemm = int (*)(void* model, const void* weights, int fp8, const std::uint16_t* a,
                         std::int64_t rows, std::uint16_t* c, const std::uint16_t* bias, void* ctx,
                         ParallelFor parallel_for, char* err, std::size_t err_len);

// metrale's kernel blocks on torch's intra-op threads (Note [one pool with torch]): the threads
// that would otherwise spin beside metrale's pool do its work. Each thread claims chunks of
// blocks as it gets to them (about sixteen a thread, as metrale's pool hands them out): blocks
// differ in cost (partial tiles), which a static split of the range would leave to one thread.
void on_torch_threads(void*, std::size_t n, Body body, void* arg) {
  const auto threads = static_cast<std::size_t>(std::max(1, at::get_num_threads()));
  const std::size_t chunk = std::max<std::size_t>(1, n / (threads * 16));
  std::atomic<std::size_t> next{0};
  at::parallel_for(0, static_cast<std::int64_t>(std::min(threads, n)), 1,
                   [&](std::int64_t begin, std::int64_t end) {
                     for (std::int64_t t = begin; t < end; ++t) {
                       for (std::size_t i = next.fetch_add(chunk); i < n;
                            i = next.fetch_add(chunk)) {
                         body(arg, i, std::min(n, i + chunk));
                       }
                     }
                   });
}

// Whether metrale's blocks run on torch's threads (metrale.torch.share_threads).
std::atomic<bool> share_threads{true};

// Weights registered by metrale.torch.register, which keeps their Python objects alive while
// they are bound here.
struct Bound {
  void* model = nullptr;
  const void* weights = nullptr;
  int fp8 = 0;
  std::int64_t n = 0, k = 0;
};

std::shared_mutex bound_mu;
std::unordered_map<std::int64_t, Bound> bound;
HostGemm host_gemm = nullptr;
PyObject* python_linear = nullptr;  // metrale.torch._linear_python(x, weights, bias)

// metrale.torch.timing: seconds and calls inside the GEMMs while a block is open.
std::atomic<bool> timing{false};
std::atomic<std::int64_t> timed_ns{0}, timed_calls{0};

// The same call made by the Python implementation: its result, or its exception re-raised.
at::Tensor linear_in_python(const at::Tensor& x, std::int64_t weights,
                            const std::optional<at::Tensor>& bias) {
  const PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* px = THPVariable_Wrap(x);
  PyObject* pb = bias ? THPVariable_Wrap(*bias) : (Py_INCREF(Py_None), Py_None);
  PyObject* result =
      PyObject_CallFunction(python_linear, "OLO", px, static_cast<long long>(weights), pb);
  Py_DECREF(px);
  Py_DECREF(pb);
  if (result == nullptr) {
    python_error error;
    error.persist();
    PyGILState_Release(gil);
    throw error;
  }
  at::Tensor out = THPVariable_Unpack(result);
  Py_DECREF(result);
  PyGILState_Release(gil);
  return out;
}

bool usable(const at::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.layout() == at::kStrided;
}

at::Tensor linear_cpu(const at::Tensor& x, std::int64_t weights,
                      const std::optional<at::Tensor>& bias) {
  // Held until the GEMM is done: unbinding (a Linear collected on another thread, the last
  // reference to its weights and model going with it) waits for the calls that use them.
  std::shared_lock lock(bound_mu);
  const auto it = bound.find(weights);
  if (it == bound.end()) {
    lock.unlock();
    return linear_in_python(x, weights, bias);
  }
  const Bound b = it->second;
  if (!usable(x) || x.dim() < 1 || x.size(-1) != b.k ||
      (bias &&
       (!usable(*bias) || bias->dim() != 1 || bias->size(0) != b.n || !bias->is_contiguous()))) {
    lock.unlock();
    return linear_in_python(x, weights, bias);
  }
  const std::int64_t rows = x.numel() / b.k;
  std::vector<std::int64_t> sizes = x.sizes().vec();
  sizes.back() = b.n;
  at::Tensor out = at::empty(sizes, x.options());
  if (rows == 0) return out;
  at::Tensor a = x.contiguous();
  if (reinterpret_cast<std::uintptr_t>(a.data_ptr()) % 16 != 0) a = a.clone();
  const bool timed = timing.load(std::memory_order_relaxed);
  const auto start =
      timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
  char err[512];
  const int rc =
      host_gemm(b.model, b.weights, b.fp8, static_cast<const std::uint16_t*>(a.data_ptr()), rows,
                static_cast<std::uint16_t*>(out.data_ptr()),
                bias ? static_cast<const std::uint16_t*>(bias->data_ptr()) : nullptr, nullptr,
                share_threads.load() ? &on_torch_threads : nullptr, err, sizeof err);
  lock.unlock();
  if (rc != 0) return linear_in_python(x, weights, bias);  // says why, as the Python op does
  if (timed) {
    timed_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                    std::chrono::steady_clock::now() - start)
                    .count();
    timed_calls += 1;
  }
  return out;
}

}  // namespace

// The entries metrale/torch_native.py calls through ctypes.
extern "C" {

// Sets the GEMM entry and the Python fallback (borrowed for the process's life).
void metrale_torch_init(void* gemm, PyObject* fallback) {
  host_gemm = reinterpret_cast<HostGemm>(gemm);
  Py_XINCREF(fallback);
  python_linear = fallback;
}

// 0, or 1 when the handle is bound already (it stays bound to what it was).
int metrale_torch_bind(std::int64_t handle, void* model, const void* weights, int fp8,
                       std::int64_t n, std::int64_t k) {
  std::unique_lock lock(bound_mu);
  return bound.try_emplace(handle, Bound{model, weights, fp8, n, k}).second ? 0 : 1;
}

void metrale_torch_unbind(std::int64_t handle) {
  std::unique_lock lock(bound_mu);
  bound.erase(handle);
}

// Whether metrale's kernel blocks run on torch's intra-op threads (1) or metrale's pool (0).
void metrale_torch_share_threads(int on) {
  share_threads.store(on != 0);
}

void metrale_torch_timing(int on) {
  timing.store(on != 0);
}

// Nanoseconds and calls timed so far.
void metrale_torch_timed(std::int64_t* ns, std::int64_t* calls) {
  *ns = timed_ns.load();
  *calls = timed_calls.load();
}

}  // extern "C"

TORCH_LIBRARY(metrale, m) {
  m.def("linear(Tensor x, int weights, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(metrale, CPU, m) {
  m.impl("linear", linear_cpu);
}

TORCH_LIBRARY_IMPL(metrale, Autograd, m) {
  m.impl("linear", torch::autograd::autogradNotImplementedFallback());
}
