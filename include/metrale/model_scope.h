// Model-scoped resources and their teardown (docs/CONTRACT.md, teardown). A model owns a backend
// and the resources made on it; teardown releases them newest-first, tries every one even after a
// failure, reports each failure with its label, then sweeps the backend's ledger.
//
// Threads that work on a model while another may tear it down hold a ModelScope::Use for each
// unit of work (a request, a step): once teardown begins, new uses are refused with
// Error(kState), and teardown waits for every live use to end before it releases anything, so
// no call that is still running loses its backend, its scratch or its buffers.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <source_location>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "metrale/handles.h"
#include "metrale/ledger.h"

namespace metrale {

class Backend;

// Something a model holds on a backend that must be given back at teardown.
class ModelResource {
 public:
  virtual ~ModelResource() = default;
  // A short name used in teardown reports ("op scratch", "weights").
  virtual std::string label() const = 0;
  // Gives everything back to backend; may throw. A second call must do nothing.
  virtual void release(Backend& backend) = 0;
};

// A device allocation owned as a model resource; release frees it (once).
class DeviceBufferResource final : public ModelResource {
 public:
  DeviceBufferResource(std::string label, DevicePtr ptr) : label_(std::move(label)), ptr_(ptr) {}
  std::string label() const override { return label_; }
  void release(Backend& backend) override;
  // The buffer, or null once released.
  DevicePtr ptr() const noexcept { return ptr_; }

 private:
  std::string label_;
  DevicePtr ptr_;
};

// What teardown did: each failure with its resource label, and what the sweep found.
struct TeardownReport {
  struct Failure {
    std::string label;
    std::string message;
  };
  std::vector<Failure> failures;
  std::size_t released = 0;          // resources whose release returned normally
  std::size_t swept = 0;             // ledger entries the sweep had to free
  std::size_t swept_bytes = 0;       // their bytes
  std::vector<LedgerEntry> leaks;    // those entries, largest first, each with its call site
  std::size_t live_bytes_after = 0;  // ledger live bytes once everything ran
  // True when every release succeeded and the sweep found nothing.
  bool clean() const noexcept { return failures.empty() && swept == 0; }
  // "" when the sweep found nothing, else "2 allocation(s), 8.0 KiB: 4.0 KiB from a.cpp:12, ..."
  // naming up to max_sites call sites, largest first (the rest counted).
  std::string leak_summary(std::size_t max_sites = 5) const;
  // The sites part of leak_summary: "4.0 KiB from a.cpp:12, ..." ("" when none).
  std::string leak_sites(std::size_t max_sites = 5) const;
};

// One loaded model: the backend it runs on and the resources it made, in creation order.
// The backend's OpCache is registered first, so its scratch is released last. Thread-safe: use(),
// add(), alloc_buffer() and teardown() may race; backend() is for the thread that owns the model.
class ModelScope {
 public:
  // A claim on the model for one unit of work: while any Use is alive, teardown waits, so the
  // backend and everything made on it stay valid. Movable; counted against the thread that took
  // it (that thread must not call teardown() while holding it).
  class Use {
   public:
    Use(Use&& other) noexcept
        : scope_(std::exchange(other.scope_, nullptr)), owner_(other.owner_) {}
    // Ends this claim, then takes over other's.
    Use& operator=(Use&& other) noexcept;
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;
    // Ends the claim (teardown may go on once no other Use is alive).
    ~Use() { reset(); }

    // The model's backend, valid until this Use ends; throws kState after reset().
    Backend& backend() const;
    // Ends the claim now; later calls do nothing.
    void reset() noexcept;
    // Whether this Use still holds its claim.
    explicit operator bool() const noexcept { return scope_ != nullptr; }

   private:
    friend class ModelScope;
    Use(ModelScope* scope, std::thread::id owner) : scope_(scope), owner_(owner) {}
    ModelScope* scope_;
    std::thread::id owner_;
  };

  // Takes ownership of backend; registers its OpCache as the "op scratch" resource.
  explicit ModelScope(std::unique_ptr<Backend> backend);
  ModelScope(const ModelScope&) = delete;
  ModelScope& operator=(const ModelScope&) = delete;
  // Tears down if teardown() was not called; never throws (failures are logged).
  ~ModelScope();

  // Claims the model for one unit of work; throws Error(kState) once teardown has begun.
  Use use();
  // Uses alive now (a snapshot: other threads may change it at once).
  std::size_t live_uses() const;

  // The backend; throws kState once teardown has begun. Unguarded: a thread that may race
  // teardown must hold a Use and call Use::backend() instead.
  Backend& backend();
  // Adds a resource (released before every resource added earlier); returns it for use.
  template <class R>
  R& add(std::unique_ptr<R> resource) {
    R* ptr = resource.get();  // not dereferenced until add_resource has refused a null one
    add_resource(std::move(resource));
    return *ptr;
  }
  // Allocates bytes on the backend (ledger names the caller) and owns it as resource label.
  DevicePtr alloc_buffer(std::string label, std::size_t bytes,
                         std::source_location loc = std::source_location::current());
  // Refuses new uses, waits for the live ones to end (warning every few seconds while it
  // waits), releases resources newest-first, then sweeps the ledger and destroys the backend
  // (whose own sweep finds nothing left). A later or concurrent second call waits for the
  // first and returns an empty report. Throws kState, changing nothing, when the calling
  // thread holds a Use of this model (it would wait for itself).
  TeardownReport teardown();
  // True once teardown() has finished.
  bool torn_down() const noexcept { return state_.load(std::memory_order_acquire) == kTornDown; }

 private:
  enum State { kOpen, kClosing, kTornDown };
  void add_resource(std::unique_ptr<ModelResource> resource);
  void end_use(std::thread::id owner) noexcept;
  TeardownReport release_all();

  // mu_ guards holders_ and the state changes; cv_ wakes teardown when the last Use ends and
  // second teardown callers when the first finishes. backend_ and resources_ are written only
  // by the thread that moved the state to kClosing, after every Use ended.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<State> state_{kOpen};
  std::unordered_map<std::thread::id, std::size_t> holders_;  // live uses by taking thread
  std::size_t uses_ = 0;
  std::unique_ptr<Backend> backend_;
  std::vector<std::unique_ptr<ModelResource>> resources_;
};

}  // namespace metrale
