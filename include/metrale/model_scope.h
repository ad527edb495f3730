// Model-scoped resources and their teardown (system.md §1). A model owns a backend and the
// resources made on it; teardown releases them newest-first, tries every one even after a
// failure, reports each failure with its label, then sweeps the backend's ledger.
#pragma once

#include <cstddef>
#include <memory>
#include <source_location>
#include <string>
#include <vector>

#include "metrale/handles.h"

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
  std::size_t live_bytes_after = 0;  // ledger live bytes once everything ran
  // True when every release succeeded and the sweep found nothing.
  bool clean() const noexcept { return failures.empty() && swept == 0; }
};

// One loaded model: the backend it runs on and the resources it made, in creation order.
// The backend's OpCache is registered first, so its scratch is released last.
class ModelScope {
 public:
  // Takes ownership of backend; registers its OpCache as the "op scratch" resource.
  explicit ModelScope(std::unique_ptr<Backend> backend);
  ModelScope(const ModelScope&) = delete;
  ModelScope& operator=(const ModelScope&) = delete;
  // Tears down if teardown() was not called; never throws (failures are logged).
  ~ModelScope();

  // The backend; throws kState after teardown.
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
  // Releases resources newest-first, then sweeps the ledger; a second call returns an empty
  // report. The backend is destroyed at the end (its own sweep finds nothing left).
  TeardownReport teardown();
  // True after teardown().
  bool torn_down() const noexcept { return backend_ == nullptr; }

 private:
  void add_resource(std::unique_ptr<ModelResource> resource);
  std::unique_ptr<Backend> backend_;
  std::vector<std::unique_ptr<ModelResource>> resources_;
};

}  // namespace metrale
