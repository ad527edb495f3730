#include "bench_models.h"

#include <fmt/format.h>

#include "metrale/error.h"

namespace metrale::cli {

// Llama-3: fused q/k/v (hidden + 2 × kv heads × 128), o, fused gate/up, down.
ModelShape model_shape(const std::string& name) {
  if (name == "llama3-8b") {
    return {
        {{"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gate_up", 28672, 4096}, {"down", 4096, 14336}},
        32};
  }
  if (name == "llama3-70b") {
    return {
        {{"qkv", 10240, 8192}, {"o", 8192, 8192}, {"gate_up", 57344, 8192}, {"down", 8192, 28672}},
        80};
  }
  throw Error(ErrorCode::kInvalidArgument, "bench",
              fmt::format("unknown model '{}' (llama3-8b or llama3-70b)", name));
}

}  // namespace metrale::cli
