// metrale._metrale: the compiled half of the Python package (python/metrale/ is the other).
#include <nanobind/nanobind.h>

#include "bindings.h"

NB_MODULE(_metrale, m) {
  m.doc() = "metrale's C++ runtime: backends, models, quantized weights and GEMMs";
  metrale::py::bind_errors(m);
  metrale::py::bind_host_weights(m);
  metrale::py::bind_discovery(m);
  metrale::py::bind_model(m);
  metrale::py::bind_native_gemm(m);
}
