#include "metrale/model_scope.h"

#include <fmt/format.h>

#include <chrono>

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

std::string TeardownReport::leak_sites(std::size_t max_sites) const {
  std::string out;
  for (std::size_t i = 0; i < leaks.size() && i < max_sites; ++i) {
    out += fmt::format("{}{} from {}", i ? ", " : "", format_bytes(leaks[i].bytes),
                       leaks[i].site.str());
  }
  if (leaks.size() > max_sites) out += fmt::format(" and {} more", leaks.size() - max_sites);
  return out;
}

std::string TeardownReport::leak_summary(std::size_t max_sites) const {
  if (leaks.empty()) return {};
  return fmt::format("{} allocation(s), {}: {}", leaks.size(), format_bytes(swept_bytes),
                     leak_sites(max_sites));
}

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
  } catch (const std::exception& e) {
    log::error("teardown: {}; memory may be left behind", e.what());
  } catch (...) {
    log::error("teardown: an unexpected exception escaped; memory may be left behind");
  }
}

namespace {

// Why a scope in state `closing` or torn down refuses api.
Error refused(std::string_view api, bool torn_down) {
  return Error(
      ErrorCode::kState, api,
      torn_down ? "the model was torn down" : "the model is being torn down; new work is refused");
}

}  // namespace

ModelScope::Use ModelScope::use() {
  const std::thread::id me = std::this_thread::get_id();
  std::lock_guard lock(mu_);
  const State st = state_.load(std::memory_order_relaxed);
  if (st != kOpen) throw refused("ModelScope::use", st == kTornDown);
  ++holders_[me];
  ++uses_;
  return Use(this, me);
}

std::size_t ModelScope::live_uses() const {
  std::lock_guard lock(mu_);
  return uses_;
}

void ModelScope::end_use(std::thread::id owner) noexcept {
  bool last = false;
  {
    std::lock_guard lock(mu_);
    const auto it = holders_.find(owner);
    if (it != holders_.end() && --it->second == 0) holders_.erase(it);
    last = --uses_ == 0;
  }
  // Only teardown waits for the count to reach zero.
  if (last) cv_.notify_all();
}

ModelScope::Use& ModelScope::Use::operator=(Use&& other) noexcept {
  if (this != &other) {
    reset();
    scope_ = std::exchange(other.scope_, nullptr);
    owner_ = other.owner_;
  }
  return *this;
}

Backend& ModelScope::Use::backend() const {
  if (scope_ == nullptr) throw Error(ErrorCode::kState, "ModelScope::Use", "this use has ended");
  // Teardown destroys the backend only after every Use ended, so this read needs no lock.
  return *scope_->backend_;
}

void ModelScope::Use::reset() noexcept {
  if (ModelScope* s = std::exchange(scope_, nullptr)) s->end_use(owner_);
}

Backend& ModelScope::backend() {
  const State st = state_.load(std::memory_order_acquire);
  if (st != kOpen) throw refused("ModelScope", st == kTornDown);
  return *backend_;
}

void ModelScope::add_resource(std::unique_ptr<ModelResource> resource) {
  std::lock_guard lock(mu_);
  const State st = state_.load(std::memory_order_relaxed);
  if (st != kOpen) throw refused("ModelScope", st == kTornDown);
  if (!resource) throw Error(ErrorCode::kInvalidArgument, "ModelScope", "resource is null");
  resources_.push_back(std::move(resource));
}

DevicePtr ModelScope::alloc_buffer(std::string label, std::size_t bytes, std::source_location loc) {
  // The allocation and its registration run under a Use, so teardown cannot destroy the
  // backend between them; when teardown began meanwhile, add() refuses and the buffer is freed.
  const Use use = this->use();
  Backend& b = use.backend();
  const DevicePtr p = b.alloc(bytes, loc);
  try {
    add(std::make_unique<DeviceBufferResource>(std::move(label), p));
  } catch (...) {
    b.free(p);
    throw;
  }
  return p;
}

TeardownReport ModelScope::teardown() {
  {
    std::unique_lock lock(mu_);
    const State st = state_.load(std::memory_order_relaxed);
    if (st == kTornDown) return {};
    if (st == kClosing) {
      // Another thread is tearing down: wait for it, so "returned" always means "gone".
      cv_.wait(lock, [&] { return state_.load(std::memory_order_relaxed) == kTornDown; });
      return {};
    }
    if (const auto it = holders_.find(std::this_thread::get_id()); it != holders_.end()) {
      throw Error(ErrorCode::kState, "teardown",
                  fmt::format("this thread holds {} use(s) of the model; end them first "
                              "(teardown waits for every use, so it would wait for itself)",
                              it->second));
    }
    state_.store(kClosing, std::memory_order_release);
    // Calls already running finish; the warning names a use that never ends (a stuck request).
    constexpr auto kWarnEvery = std::chrono::seconds(5);
    while (!cv_.wait_for(lock, kWarnEvery, [&] { return uses_ == 0; })) {
      log::warn("teardown: still waiting for {} live use(s) of the model to end", uses_);
    }
  }
  // Whatever release_all does, the scope ends torn down: a second caller waiting above must
  // wake, and nothing may start on a half-released model.
  auto finish = [this] {
    {
      std::lock_guard lock(mu_);
      state_.store(kTornDown, std::memory_order_release);
    }
    cv_.notify_all();
  };
  TeardownReport report;
  try {
    report = release_all();
  } catch (...) {
    finish();
    throw;
  }
  finish();
  return report;
}

TeardownReport ModelScope::release_all() {
  // No Use is alive and none can start: this thread alone touches backend_ and resources_.
  TeardownReport report;
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
  report.leaks = backend_->sweep_unreleased_entries();
  report.swept = report.leaks.size();
  for (const LedgerEntry& e : report.leaks) report.swept_bytes += e.bytes;
  report.live_bytes_after = backend_->live_bytes();
  if (report.swept > 0) {
    log::warn(
        "teardown: the ledger sweep freed {} allocation(s) that no resource released, {} in "
        "all: {}",
        report.swept, format_bytes(report.swept_bytes), report.leak_sites());
  }
  backend_.reset();
  return report;
}

}  // namespace metrale
