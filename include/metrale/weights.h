// Allocation policy for model weights: device memory first, managed memory when the device is full
// (docs/CONTRACT.md, allocation fallback). Managed memory keeps a model running that would not fit,
// at a large cost in speed, so the fallback warns once and latches for the rest of this backend's
// life; the next model (a new backend) tries device memory again.
#pragma once

#include <cstddef>
#include <source_location>

#include "metrale/backend.h"

namespace metrale {

// bytes (> 0) for weights on backend: managed if the backend's OpCache latched the fallback;
// else device memory, and on out-of-memory one warning, the latch, then managed memory.
// Errors other than out-of-memory propagate unchanged.
DevicePtr alloc_weights(Backend& backend, std::size_t bytes,
                        std::source_location loc = std::source_location::current());

}  // namespace metrale
