// A stream another library owns, adopted by a backend for one scope (Backend::adopt_stream):
// metrale.torch queues a GEMM on torch's current stream through one. Note [foreign streams] in
// docs/NOTES.md says who waits for what.
#pragma once

#include <cstdint>

#include "metrale/backend.h"

namespace metrale {

class ForeignStream {
 public:
  // Adopts the driver's stream raw on backend; throws as Backend::adopt_stream.
  ForeignStream(Backend& backend, std::uint64_t raw)
      : backend_(backend), handle_(backend.adopt_stream(raw)) {}
  ForeignStream(const ForeignStream&) = delete;
  ForeignStream& operator=(const ForeignStream&) = delete;
  // Ends the adoption; the stream stays with its owner.
  ~ForeignStream() { backend_.release_stream(handle_); }

  // The handle to queue work with while this lives.
  StreamHandle handle() const noexcept { return handle_; }

 private:
  Backend& backend_;
  StreamHandle handle_;
};

}  // namespace metrale
