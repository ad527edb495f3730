// The built-in model shapes `metrale bench` runs: one transformer block's linear layers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace metrale::cli {

// One linear layer: C[M, n] = A[M, k] · Wᵀ.
struct Layer {
  std::string name;
  std::int64_t n = 0, k = 0;
};

struct ModelShape {
  std::vector<Layer> layers;  // one block's linear layers
  int blocks = 1;             // blocks in the whole model
};

// "llama3-8b" or "llama3-70b"; Error(kInvalidArgument) naming any other.
ModelShape model_shape(const std::string& name);

}  // namespace metrale::cli
