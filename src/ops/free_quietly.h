// Freeing on an error path: the uploads free what they allocated before rethrowing the error that
// stopped them, so a second failure is logged, never thrown over the first.
#pragma once

#include <exception>

#include "core/log.h"
#include "metrale/backend.h"

namespace metrale::ops {

// Frees p (nothing for null); a failure is a warning naming the backend and the address.
inline void free_quietly(Backend& backend, DevicePtr p) noexcept {
  if (!p) return;
  try {
    backend.free(p);
  } catch (const std::exception& e) {
    log::warn("{}: freeing 0x{:x} after an error failed too: {}", backend.name(), p.address(),
              e.what());
  }
}

}  // namespace metrale::ops
