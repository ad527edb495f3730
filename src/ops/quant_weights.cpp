#include "metrale/ops/quant_weights.h"

#include <exception>
#include <utility>

#include "core/log.h"
#include "metrale/weights.h"

namespace metrale::ops {

namespace {
// Frees p on an error path: a failure is logged, never thrown, so the error being handled is the
// one the caller sees.
void free_quietly(Backend& backend, DevicePtr p) noexcept {
  if (!p) return;
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

WeightsResource::WeightsResource(Backend& backend, const HostQuantWeights& host, std::string label,
                                 std::source_location loc)
    : label_(std::move(label)) {
  // The buffers live in locals until everything succeeded. The catch block must not read them
  // from a half-built object: GCC 12 at -O2 dropped such an object's member initializers on the
  // path that throws, and the fault sweep (tests/reliability) caught a catch block freeing stack
  // garbage.
  const DevicePtr codes = alloc_weights(backend, host.codes.size(), loc);
  DevicePtr scales;
  try {
    scales = alloc_weights(backend, host.scales.size(), loc);
    backend.copy_h2d(codes, host.codes.data(), host.codes.size());
    backend.copy_h2d(scales, host.scales.data(), host.scales.size());
  } catch (...) {
    free_quietly(backend, codes);
    free_quietly(backend, scales);
    throw;
  }
  w_ = describe_weights(host);
  w_.codes = codes;
  w_.scales = scales;
}

void WeightsResource::release(Backend& backend) {
  free_weights(backend, w_);
}

QuantWeights WeightsResource::take() noexcept {
  QuantWeights out = w_;
  w_.codes = w_.scales = DevicePtr{};
  return out;
}

std::unique_ptr<WeightsResource> make_weights_resource(Backend& backend,
                                                       const HostQuantWeights& host,
                                                       std::string label,
                                                       std::source_location loc) {
  return std::make_unique<WeightsResource>(backend, host, std::move(label), loc);
}

QuantWeights upload_weights(Backend& backend, const HostQuantWeights& w, std::source_location loc) {
  return WeightsResource(backend, w, "weights", loc).take();
}

// Frees both buffers even when the first free fails (a refused free must not leave the other
// buffer to the ledger sweep), then throws the first failure.
void free_weights(Backend& backend, QuantWeights& w) {
  const DevicePtr codes = std::exchange(w.codes, DevicePtr{});
  const DevicePtr scales = std::exchange(w.scales, DevicePtr{});
  if (!codes && !scales) return;  // released already
  try {
    if (codes) backend.free(codes);
  } catch (...) {
    free_quietly(backend, scales);
    throw;
  }
  if (scales) backend.free(scales);
}

}  // namespace metrale::ops
