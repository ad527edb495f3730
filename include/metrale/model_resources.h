// Model resources for what a loader holds besides device buffers (DeviceBufferResource, in
// model_scope.h): pinned staging memory, streams, events and graphs. Each gives its handle back
// at teardown, once: the handle is cleared before the call, so a failed release is reported by
// the teardown and never retried as a double free.
#pragma once

#include <string>
#include <utility>

#include "metrale/backend.h"
#include "metrale/model_scope.h"

namespace metrale {

// A handle of type H owned as a model resource and given back with (backend.*Release)(handle).
template <class H, void (Backend::*Release)(H)>
class HandleResource final : public ModelResource {
 public:
  HandleResource(std::string label, H handle) : label_(std::move(label)), handle_(handle) {}
  std::string label() const override { return label_; }
  // Gives the handle back (nothing when it is null or already given back).
  void release(Backend& backend) override {
    if (handle_) (backend.*Release)(std::exchange(handle_, H{}));
  }
  // The handle, or null once released.
  H get() const noexcept { return handle_; }

 private:
  std::string label_;
  H handle_;
};

// Host memory from Backend::alloc_pinned.
using PinnedBufferResource = HandleResource<void*, &Backend::free_pinned>;
// A stream from Backend::create_stream.
using StreamResource = HandleResource<StreamHandle, &Backend::destroy_stream>;
// An event from Backend::create_event.
using EventResource = HandleResource<EventHandle, &Backend::destroy_event>;
// A graph from Backend::end_capture.
using GraphResource = HandleResource<GraphHandle, &Backend::destroy_graph>;

}  // namespace metrale
