// What the upload repacks (decode_pack.cpp, panel_pack.cpp) share: the check of the host weights
// they read, and the split of a repack over threads. Internal to src/ops.
#pragma once

#include <cstdint>
#include <string_view>

#include "metrale/quant.h"

namespace metrale::ops::pack {

// Throws Error(kInvalidArgument, api) naming the bad value unless w is NVFP4 or MXFP4 in either
// layout, with N, K >= 1, K a multiple of the group, code and scale buffers of the shape's size,
// and a shape padded by up to pad_n rows and pad_k K still addressable.
void check_source(std::string_view api, const HostQuantWeights& w, std::int64_t pad_n,
                  std::int64_t pad_k);

// Runs fn(begin, end) over [0, count) cut into one range per hardware thread (up to 16), each
// at least per_thread items, so small work stays on the caller's thread; when no thread can be
// started, the ranges not started run on the caller's. Returns once every range is done.
void split(std::int64_t count, std::int64_t per_thread,
           void (*fn)(void* context, std::int64_t begin, std::int64_t end), void* context);

// split() for a callable f(begin, end) (called from several threads at once).
template <class F>
void split(std::int64_t count, std::int64_t per_thread, const F& f) {
  split(
      count, per_thread,
      [](void* c, std::int64_t b, std::int64_t e) { (*static_cast<const F*>(c))(b, e); },
      const_cast<void*>(static_cast<const void*>(&f)));
}

}  // namespace metrale::ops::pack
