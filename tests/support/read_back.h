// Reads n elements of type T back from device memory into a host vector.
#pragma once

#include <cstddef>
#include <vector>

#include "metrale/backend.h"

namespace metrale::testing {

template <class T>
std::vector<T> read(Backend& b, DevicePtr p, std::size_t n) {
  std::vector<T> out(n);
  b.copy_d2h(out.data(), p, n * sizeof(T));
  return out;
}

}  // namespace metrale::testing
