// Model's lifetime: the backend, uploads, the ledger's figures and teardown.
#include "model.h"

#include <fmt/format.h>
#include <nanobind/stl/string.h>

#include <span>
#include <utility>

#include "bindings.h"
#include "metrale/backend.h"
#include "metrale/e4m3_block.h"
#include "metrale/ops/quant_weights.h"
#include "metrale/runtime.h"

namespace nb = nanobind;

namespace metrale::py {

ops::UploadLayout parse_upload_layout(std::string_view api, std::string_view text) {
  if (text == "auto") return ops::UploadLayout::kBackendPreferred;
  if (text == "source") return ops::UploadLayout::kSource;
  if (text == "decode") return ops::UploadLayout::kDecode;
  if (text == "panels") return ops::UploadLayout::kPanels;
  throw Error(ErrorCode::kInvalidArgument, api,
              fmt::format("layout: '{}', expected auto, source, decode or panels", text));
}

Model::Model(std::string_view which) {
  std::string why;
  std::unique_ptr<Backend> backend;
  {
    nb::gil_scoped_release unlocked;  // a CUDA context takes a while
    backend = create_backend(which, &why);
  }
  name_ = std::string(backend->name());
  device_ = backend->device_name();
  chosen_ = why;
  probe_.emplace(backend->ledger_probe());
  scope_ = std::make_unique<ModelScope>(std::move(backend));
}

int Model::device_type() const {
  return name_ == "cuda" ? nb::device::cuda::value : nb::device::cpu::value;
}

std::uint64_t Model::stream() {
  return open("stream").default_stream().value();
}

Backend& Model::open(std::string_view api) {
  if (closed()) {
    throw Error(ErrorCode::kState, api, "the model is torn down (closed); make a new Model");
  }
  return scope_->backend();
}

std::unique_lock<std::mutex> Model::lock_open(std::string_view api) {
  std::unique_lock lock(call_mu_);
  // A teardown that took the lock first has destroyed the backend this call holds: a call that
  // passed open() and then waited here must not touch it.
  if (scope_->torn_down()) {
    throw Error(ErrorCode::kState, api,
                "the model was torn down (closed) while this call waited; make a new Model");
  }
  return lock;
}

void Model::check_owner(std::string_view api, const Model* owner, const std::string& label,
                        std::string_view name) const {
  if (owner != this) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("{}: weights '{}' were uploaded to another model", name, label));
  }
}

Weights Model::upload(const HostQuantWeights& host, std::string_view layout, std::string label) {
  Backend& b = open("upload_weights");
  const ops::UploadLayout upload = parse_upload_layout("upload_weights", layout);
  nb::gil_scoped_release unlocked;
  const auto lock = lock_open("upload_weights");
  auto& r = scope_->add(ops::make_weights_resource(b, host, label, upload));
  return Weights{this, r.weights(), std::move(label), r.pack_seconds()};
}

Fp8Weights Model::upload_fp8(nb::handle codes, nb::handle scales, std::int64_t n, std::int64_t k,
                             std::string label) {
  constexpr std::string_view api = "upload_fp8_weights";
  Backend& b = open(api);
  const ops::Fp8Weights shape = ops::describe_fp8_weights(api, n, k);
  ArraySpec spec{Element::kU8, 2, n, k};
  spec.alignment = 1;
  const ArrayArg c = check_array(api, "codes", as_array(api, "codes", codes, false), false, spec);
  spec = ArraySpec{Element::kF32, 2, e4m3_blocks(n), e4m3_blocks(k)};
  spec.alignment = 4;
  const ArrayArg s =
      check_array(api, "scales", as_array(api, "scales", scales, false), false, spec);
  const auto* code_bytes = reinterpret_cast<const std::uint8_t*>(c.ptr.address());
  const auto* scale_bytes = reinterpret_cast<const std::uint8_t*>(s.ptr.address());
  nb::gil_scoped_release unlocked;
  const auto lock = lock_open(api);
  auto& r = scope_->add(std::make_unique<ops::Fp8WeightsResource>(
      b, std::span(code_bytes, shape.codes_bytes), std::span(scale_bytes, s.bytes), n, k, label));
  return Fp8Weights{this, r.weights(), std::move(label)};
}

DenseWeights Model::upload_dense(nb::handle weights, bool bits, std::string label) {
  constexpr std::string_view api = "upload_dense_weights";
  Backend& b = open(api);
  const ArrayArg w =
      check_array(api, "w", as_array(api, "w", weights, false), bits, ArraySpec{Element::kBf16});
  nb::gil_scoped_release unlocked;
  const auto lock = lock_open(api);
  const DevicePtr d = scope_->alloc_buffer(label, w.bytes);
  b.copy_h2d(d, reinterpret_cast<const void*>(w.ptr.address()), w.bytes);
  return DenseWeights{this, d, w.rows, w.cols, std::move(label)};
}

nb::dict Model::stats() const {
  const AllocStats s = probe_->stats();
  nb::dict d;
  d["owned_bytes"] = s.current_bytes;
  d["owned_count"] = s.current_count;
  d["peak_bytes"] = s.peak_bytes;
  d["allocated_bytes"] = s.allocated_bytes;
  d["freed_bytes"] = s.freed_bytes;
  d["allocation_count"] = s.allocation_count;
  d["free_count"] = s.free_count;
  d["failed_allocations"] = s.failed_allocations;
  d["borrowed_bytes"] = s.borrowed_bytes;
  d["borrowed_count"] = s.borrowed_count;
  d["borrow_count"] = s.borrow_count;
  return d;
}

nb::dict Model::teardown() {
  if (closing_.exchange(true)) {
    throw Error(ErrorCode::kState, "teardown", "the model is already torn down");
  }
  TeardownReport r;
  {
    nb::gil_scoped_release unlocked;
    const std::lock_guard lock(call_mu_);
    r = scope_->teardown();
  }
  nb::dict d;
  d["clean"] = r.clean();
  d["released"] = r.released;
  d["swept"] = r.swept;
  d["swept_bytes"] = r.swept_bytes;
  d["live_bytes_after"] = r.live_bytes_after;
  d["summary"] = r.leak_summary();
  nb::list failures, leaks;
  for (const auto& f : r.failures) {
    nb::dict fd;
    fd["label"] = f.label;
    fd["message"] = f.message;
    failures.append(fd);
  }
  for (const LedgerEntry& e : r.leaks) {
    nb::dict ld;
    ld["bytes"] = e.bytes;
    ld["kind"] = to_string(e.kind);
    ld["site"] = e.site.str();
    leaks.append(ld);
  }
  d["failures"] = failures;
  d["leaks"] = leaks;
  return d;
}

}  // namespace metrale::py
