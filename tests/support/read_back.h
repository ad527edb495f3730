// Host vectors to and from device memory, for tests.
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

// A new allocation of backend holding v.
template <class T>
DevicePtr upload(Backend& b, const std::vector<T>& v) {
  const DevicePtr p = b.alloc(v.size() * sizeof(T));
  b.copy_h2d(p, v.data(), v.size() * sizeof(T));
  return p;
}

}  // namespace metrale::testing
