// Element-wise ops on any backend. Each follows the one op sequence: check arguments (nothing
// launched on error) → kernel handle from the OpCache → grid from the published N tile → launch.
#pragma once

#include <cstddef>
#include <cstdint>

#include "metrale/backend.h"

namespace metrale::ops {

// Sets n (>= 1) uint32 elements at out (4-byte aligned) to value, queued on stream.
void fill_u32(Backend& backend, StreamHandle stream, DevicePtr out, std::size_t n,
              std::uint32_t value);

// y[i] = a * x[i] + y[i] for n (>= 1) floats; x and y 4-byte aligned and not overlapping.
void axpy_f32(Backend& backend, StreamHandle stream, DevicePtr y, DevicePtr x, float a,
              std::size_t n);

// out[i] = in[i] rounded to BF16 (nearest even; NaN stays NaN) for n (>= 1) elements: in FP32
// and 4-byte aligned, out BF16 and 2-byte aligned, not overlapping; queued on stream.
void cast_f32_to_bf16(Backend& backend, StreamHandle stream, DevicePtr in, DevicePtr out,
                      std::size_t n);

}  // namespace metrale::ops
