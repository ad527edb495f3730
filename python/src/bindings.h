// The pieces of the metrale._metrale extension, each bound by its own file (module.cpp calls them
// in order: errors first, since every other binding's failures go through their translator).
#pragma once

#include <nanobind/nanobind.h>

#include "metrale/error.h"

namespace metrale::py {

// An argument of the wrong element type: an invalid argument that Python also sees as a
// TypeError (metrale.DtypeError subclasses both InvalidArgumentError and TypeError).
class DtypeError final : public Error {
 public:
  DtypeError(std::string_view api, std::string_view message)
      : Error(ErrorCode::kInvalidArgument, api, message) {}
};

// metrale::Error → the Python class errors.py defines for its code (set by _set_error_classes).
void bind_errors(nanobind::module_& m);
// HostWeights, quantize_nvfp4/mxfp4 and the safetensors Checkpoint.
void bind_host_weights(nanobind::module_& m);
// backends(): discovery with each unavailable backend's reason.
void bind_discovery(nanobind::module_& m);
// Model, Weights, Plan and bf16_view: the model-scoped API.
void bind_model(nanobind::module_& m);
// _native_gemm, _native_ptr: the C entry metrale.torch's C++ operator calls.
void bind_native_gemm(nanobind::module_& m);

}  // namespace metrale::py
