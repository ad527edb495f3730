// The GEMM's C entry for metrale.torch's C++ operator (python/metrale/torch_ops.cpp): that
// library is built against torch's headers on first use and cannot link this extension, so it
// calls Model::gemm_host through a plain function pointer, on host pointers, with the GIL as torch
// leaves it around an operator: released. No Python object is touched on the way.
#include <nanobind/nanobind.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>

#include "bindings.h"
#include "model.h"

namespace nb = nanobind;

namespace metrale::py {
namespace {

// 0, or the failure's ErrorCode + 1 with "[api] message" in err (cut to err_len - 1 bytes).
// With `parallel_for` set, the CPU kernels' blocks run on it (CpuExecutor, ctx its context).
extern "C" int host_gemm(void* model, const void* weights, int fp8, const std::uint16_t* a,
                         std::int64_t rows, std::uint16_t* c, const std::uint16_t* bias, void* ctx,
                         decltype(CpuExecutor::parallel_for) parallel_for, char* err,
                         std::size_t err_len) noexcept {
  try {
    const CpuExecutor executor{ctx, parallel_for};
    static_cast<Model*>(model)->gemm_host(weights, fp8 != 0, a, rows, c, bias,
                                          parallel_for != nullptr ? &executor : nullptr);
    return 0;
  } catch (const Error& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return static_cast<int>(e.code()) + 1;
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "[metrale.torch.linear] %s", e.what());
    return static_cast<int>(ErrorCode::kInternal) + 1;
  }
}

}  // namespace

void bind_native_gemm(nb::module_& m) {
  m.def(
      "_native_gemm", [] { return reinterpret_cast<std::uintptr_t>(&host_gemm); },
      "The address of the C entry metrale.torch's C++ operator calls (native_gemm.cpp).");
  m.def(
      "_native_ptr",
      [](nb::handle obj) { return reinterpret_cast<std::uintptr_t>(nb::inst_ptr<void>(obj)); },
      nb::arg("obj"),
      "The address of the C++ object inside a Model's, Weights' or Fp8Weights' Python instance, "
      "valid while that instance lives.");
  m.def(
      "_error_code_names",
      [] {
        nb::list names;
        for (int c = 0; c <= static_cast<int>(ErrorCode::kInternal); ++c) {
          names.append(std::string(to_string(static_cast<ErrorCode>(c))));
        }
        return names;
      },
      "ErrorCode names by value: what host_gemm's codes (value + 1) mean.");
}

}  // namespace metrale::py
