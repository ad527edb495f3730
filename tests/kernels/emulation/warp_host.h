// A warp's exchanges on the host, for kernels run by cuda_host.h: the shuffles (xor, up, indexed)
// of any 4- or 8-byte value, the ballot, and the few intrinsics around them. Every lane leaves
// its value, the warp meets, each reads its source lane's, and the warp meets again before the
// slots are reused (the PTX ISA's shfl.sync and vote.sync: all 32 lanes take part). Include it
// after cuda_host.h; the mask argument is not checked.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace metrale::emulation {

inline std::uint64_t& warp_slot(int warp, int lane) {
  static std::uint64_t slots[kMaxWarps][32];
  return slots[warp][lane];
}

// v of lane source(lane), or the caller's own v where source returns a lane outside [0, 32).
template <class T, class Source>
T warp_exchange(T v, Source source) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8);
  const int tid = current_fiber(), warp = tid / 32, lane = tid % 32;
  WarpState& w = grid_state().warps[warp];
  std::uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  warp_slot(warp, lane) = bits;
  wait_at(w.sync);
  const int from = source(lane);
  T r = v;
  if (from >= 0 && from < 32) {
    const std::uint64_t got = warp_slot(warp, from);
    std::memcpy(&r, &got, sizeof(T));
  }
  wait_at(w.sync);
  return r;
}

}  // namespace metrale::emulation

template <class T>
T __shfl_xor_sync(unsigned /*mask*/, T v, int lane_mask) {
  return ::metrale::emulation::warp_exchange(v, [&](int lane) { return lane ^ lane_mask; });
}
template <class T>
T __shfl_up_sync(unsigned /*mask*/, T v, unsigned delta) {
  return ::metrale::emulation::warp_exchange(v, [&](int lane) { return lane - int(delta); });
}
template <class T>
T __shfl_sync(unsigned /*mask*/, T v, int src_lane) {
  return ::metrale::emulation::warp_exchange(v, [&](int) { return src_lane % 32; });
}
// Bit l set where lane l's predicate is true.
inline unsigned __ballot_sync(unsigned /*mask*/, int predicate) {
  namespace emu = ::metrale::emulation;
  const int tid = emu::current_fiber(), warp = tid / 32, lane = tid % 32;
  emu::warp_slot(warp, lane) = predicate != 0 ? 1u : 0u;
  emu::wait_at(emu::grid_state().warps[warp].sync);
  unsigned mask = 0;
  for (int l = 0; l < 32; ++l) mask |= static_cast<unsigned>(emu::warp_slot(warp, l)) << l;
  emu::wait_at(emu::grid_state().warps[warp].sync);
  return mask;
}
inline int __popc(unsigned x) {
  return __builtin_popcount(x);
}
// Fibers switch only where they wait, so a read-modify-write is atomic here.
inline int atomicAdd(int* p, int v) {
  const int old = *p;
  *p = old + v;
  return old;
}
inline float __int_as_float(int x) {
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}
