#include "metrale/ops/quant_weights.h"

#include <exception>

#include "core/log.h"

namespace metrale::ops {

namespace {
// Frees p on an error path: a failure is logged, never thrown, so the error being handled is the
// one the caller sees.
void free_quietly(Backend& backend, DevicePtr p) noexcept {
  try {
    backend.free(p);
  } catch (const std::exception& e) {
    log::warn("{}: freeing 0x{:x} after an error failed too: {}", backend.name(), p.address(),
              e.what());
  }
}
}  // namespace

QuantWeights describe_weights(const HostQuantWeights& w) {
  QuantWeights d;
  d.format = w.format;
  d.layout = w.layout;
  d.n = w.n;
  d.k = w.k;
  d.tensor_scale = w.tensor_scale;
  d.codes_bytes = w.codes.size();
  d.scales_bytes = w.scales.size();
  return d;
}

QuantWeights upload_weights(Backend& backend, const HostQuantWeights& w) {
  // The buffers live in locals until everything succeeded. The catch block must not read them
  // from the returned object: GCC 12 at -O2 drops that object's member initializers on the path
  // that throws, and the fault sweep (tests/reliability) caught this block freeing stack garbage.
  const DevicePtr codes = backend.alloc(w.codes.size());
  DevicePtr scales;
  try {
    scales = backend.alloc(w.scales.size());
    backend.copy_h2d(codes, w.codes.data(), w.codes.size());
    backend.copy_h2d(scales, w.scales.data(), w.scales.size());
  } catch (...) {
    free_quietly(backend, codes);
    free_quietly(backend, scales);
    throw;
  }
  QuantWeights d = describe_weights(w);
  d.codes = codes;
  d.scales = scales;
  return d;
}

// Frees both buffers even when the first free fails (a refused free must not leave the other
// buffer to the ledger sweep), then throws the first failure.
void free_weights(Backend& backend, QuantWeights& w) {
  const DevicePtr codes = w.codes, scales = w.scales;
  w.codes = w.scales = DevicePtr{};
  try {
    backend.free(codes);
  } catch (...) {
    free_quietly(backend, scales);
    throw;
  }
  backend.free(scales);
}

}  // namespace metrale::ops
