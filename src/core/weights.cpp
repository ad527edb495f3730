#include "metrale/weights.h"

#include "core/log.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"

namespace metrale {

DevicePtr alloc_weights(Backend& backend, std::size_t bytes, std::source_location loc) {
  OpCache& cache = backend.op_cache();
  if (cache.alloc_fell_back()) return backend.alloc_managed(bytes, loc);
  try {
    return backend.alloc(bytes, loc);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kOutOfMemory) throw;
    if (cache.once("managed memory fallback")) {
      log::warn(
          "{}: device memory is full ({}); this model's weights go to managed memory from "
          "now on, which is much slower. Free memory or use a smaller model.",
          backend.name(), e.what());
    }
    cache.note_alloc_fallback();
  }
  return backend.alloc_managed(bytes, loc);
}

}  // namespace metrale
