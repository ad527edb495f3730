#include "metrale/model_scope.h"

#include <fmt/format.h>

#include "core/log.h"
#include "metrale/backend.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"

namespace metrale {
namespace {

// Lets the scope hold the backend's OpCache in its resource list without owning it.
class OpCacheResource final : public ModelResource {
 public:
  explicit OpCacheResource(OpCache& cache) : cache_(cache) {}
  std::string label() const override { return cache_.label(); }
  void release(Backend& backend) override { cache_.release(backend); }

 private:
  OpCache& cache_;
};

}  // namespace

void DeviceBufferResource::release(Backend& backend) {
  const DevicePtr p = ptr_;
  ptr_ = DevicePtr{};  // cleared first: a failed free must not be retried as a double free
  backend.free(p);
}

ModelScope::ModelScope(std::unique_ptr<Backend> backend) : backend_(std::move(backend)) {
  if (!backend_) throw Error(ErrorCode::kInvalidArgument, "ModelScope", "backend is null");
  resources_.push_back(std::make_unique<OpCacheResource>(backend_->op_cache()));
}

ModelScope::~ModelScope() {
  if (torn_down()) return;
  try {
    const TeardownReport r = teardown();
    for (const auto& f : r.failures) log::error("teardown: {}: {}", f.label, f.message);
  } catch (...) {
    log::error("teardown: an unexpected exception escaped; memory may be left behind");
  }
}

Backend& ModelScope::backend() {
  if (!backend_) throw Error(ErrorCode::kState, "ModelScope", "the model was torn down");
  return *backend_;
}

void ModelScope::add_resource(std::unique_ptr<ModelResource> resource) {
  if (!backend_) throw Error(ErrorCode::kState, "ModelScope", "the model was torn down");
  if (!resource) throw Error(ErrorCode::kInvalidArgument, "ModelScope", "resource is null");
  resources_.push_back(std::move(resource));
}

DevicePtr ModelScope::alloc_buffer(std::string label, std::size_t bytes, std::source_location loc) {
  const DevicePtr p = backend().alloc(bytes, loc);
  try {
    add(std::make_unique<DeviceBufferResource>(std::move(label), p));
  } catch (...) {
    backend_->free(p);
    throw;
  }
  return p;
}

TeardownReport ModelScope::teardown() {
  TeardownReport report;
  if (!backend_) return report;
  // Newest first: later resources may depend on earlier ones (scratch outlives the ops).
  while (!resources_.empty()) {
    std::unique_ptr<ModelResource> r = std::move(resources_.back());
    resources_.pop_back();
    std::string label = "?";
    try {
      label = r->label();
      r->release(*backend_);
      ++report.released;
    } catch (const std::exception& e) {
      report.failures.push_back({label, e.what()});
    } catch (...) {
      report.failures.push_back({label, "unknown exception"});
    }
  }
  report.swept = backend_->sweep_unreleased();
  report.live_bytes_after = backend_->live_bytes();
  if (report.swept > 0) {
    log::warn("teardown: the ledger sweep freed {} allocation(s) that no resource released",
              report.swept);
  }
  backend_.reset();
  return report;
}

}  // namespace metrale
