// The sm_90 units a warp-specialized kernel drives, on the host (the wrappers of
// kernel_host_ptx.h call these; cuda_host.h's run_grid starts and ends each block): the block's
// dynamic shared memory, mbarriers with their phases and transaction counts, bulk copies and
// cp.async copies that land later and in random order (the fibers' progress hook), warpgroup
// MMAs (wgmma.mma_async RS m64n128k16 BF16, SS m64n128k32 E4M3) that read their registers and
// shared memory only when waited for, named barriers, a bank-conflict check of every
// shared-memory access a warp makes, and faults a test plants in a kernel. Rules from the PTX
// ISA: 9.7.13.15 (mbarrier: phases, pending arrivals, tx-count, try_wait.parity), 9.7.9.25
// (cp.async.bulk: complete_tx on the barrier when the bytes land), 9.7.9.23-24 (cp.async: its
// groups, wait_group), 9.7.15 (wgmma: fragments, descriptors, commit and wait groups, the
// 128-byte swizzle), the async proxy (wgmma reads its shared operands through it: a generic
// write needs its writer's fence.proxy.async first). wgmma.fence is modelled as a warpgroup
// barrier, stronger than the hardware's: a missing one is not caught here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace metrale::emulation {

// Faults a test plants in a kernel to show that the emulation catches them (the kernel asks with
// METRALE_FUSED_PLANTED or METRALE_TILED_PLANTED). kNone plants nothing.
enum class Plant {
  kNone,
  kWrongParity,       // a consumer waits for the wrong phase of a full barrier
  kEarlyRelease,      // a consumer releases a stage before its wgmmas are waited for
  kSkipExpectTx,      // the producer does not announce the bulk copies' bytes
  kWrongSwizzle,      // the activations (grouped FP8: both operands) stored without the swizzle
  kDropPartialTile,   // the tile count rounds the last, partial M tile away
  kNoTurns,           // the consumer warpgroups issue their wgmmas without taking turns
  kExpertZeroTable,   // a grouped kernel takes expert 0's scales (table) for every expert
  kSmallTileRing,     // the grouped kernel's ring of tiles holds 2, not 8
  kNoExpertRowBound,  // a grouped kernel's epilogue stores past its expert's rows
  kNoAsyncWait,       // cp.async.wait_group lands nothing (copies land only when they will)
  kPartNotReset,      // the grouped FP8 kernel's first MMA of a block adds to the last block's
  kNoProxyFence,      // the grouped FP8 kernel's copies reach wgmma without fence.proxy.async
  kInt4FirstEntry,    // the fused INT4 kernel takes every 32-K span's scale from entry 0
  kInt4ScaleRounded,  // the fused INT4 kernel rounds an FP16 scale to BF16 before its product
};
void set_plant(Plant p);
bool planted(Plant p);

// ---- shared memory ----

// The shared address of the arena's first byte: 1024-aligned (the swizzle is a function of the
// address) and not 0, so that an offset mistaken for an address shows.
inline constexpr std::uint32_t kSharedBase = 0x400;
inline constexpr std::size_t kSharedBytes = 228 * 1024;

// The running block's dynamic shared memory (kSharedBytes, 1024-aligned, poisoned at each block's
// start with 0xFF bytes: BF16 NaNs where a kernel reads what nobody wrote).
unsigned char* shared_memory();
// The shared address of p, a pointer into the arena.
std::uint32_t shared_address(const void* p);
// The arena's bytes at shared address `addr`, or nullptr and a fault when [addr, addr + bytes)
// is outside it or misaligned for `bytes` (what the device's instruction requires).
unsigned char* shared_at(std::uint32_t addr, std::size_t bytes, std::size_t align,
                         const char* what);
// Records the calling thread's shared-memory access for the bank-conflict check: a warp's n-th
// access of each of its threads is one instruction.
void record_shared(std::uint32_t addr, int bytes, const char* what);

// The bank-conflict check of what ran since the last reset: every warp instruction split into
// the phases the hardware serves at once (32 lanes for accesses of 4 bytes or less, 16 for 8,
// 8 for 16), and in each phase no bank asked for two different 4-byte words.
struct BankReport {
  long instructions = 0, conflicted = 0;
  std::string first;  // the first conflicted instruction, described
};
BankReport bank_report();
void reset_bank_report();

// ---- mbarriers and bulk copies ----

void mbarrier_init(std::uint32_t bar, std::uint32_t count);
void mbarrier_expect_tx(std::uint32_t bar, std::uint32_t bytes);
void mbarrier_arrive(std::uint32_t bar);
// Returns once the phase of parity `parity` has completed.
void mbarrier_wait(std::uint32_t bar, std::uint32_t parity);
// Starts a copy of `bytes` from global `src` to shared `dst`; it lands (and completes its bytes on
// `bar`) at a later switch between fibers.
void bulk_copy(std::uint32_t dst, const void* src, std::uint32_t bytes, std::uint32_t bar);

// ---- the generic and async proxies ----

// The calling thread wrote [addr, addr + bytes) of shared memory through the generic proxy
// (st.shared): a wgmma may read it only after the thread's fence.proxy.async (a fault where not).
void note_generic_write(std::uint32_t addr, std::size_t bytes);
// fence.proxy.async: the calling thread's generic-proxy writes so far (its landed cp.async copies
// among them) become visible to the async proxy.
void fence_proxy_async();

// ---- cp.async (sm_80's asynchronous copies, per thread) ----

// Starts the calling thread's copy of 16 bytes from global `src` to shared `dst`, the bytes past
// `src_bytes` (0 or 16) zero (PTX ISA 9.7.9.23, cp.async with src-size); it lands at the
// thread's wait for its group, or earlier at a random switch between fibers.
void cp_async(std::uint32_t dst, const void* src, int src_bytes);
// Closes the thread's open copies into a group (cp.async.commit_group).
void cp_async_commit();
// Lands the thread's committed groups but the newest `pending` (cp.async.wait_group).
void cp_async_wait(int pending);

// ---- warpgroup MMA ----

void wgmma_fence();
// Records this thread's part of a wgmma.mma_async.m64n128k16.f32.bf16.bf16 with A from
// registers: its accumulators d and A registers a are read (and d written) when a wait retires
// the wgmma, as the hardware may read them any time until then.
void wgmma_rs_m64n128k16(float* d, const std::uint32_t* a, std::uint64_t desc_b);
// Records this thread's part of a wgmma.mma_async.m64n128k32.f32.e4m3.e4m3 with both operands
// K-major in shared memory: D = A (64 x 32) x B (32 x 128) (+ D when accumulate), read and
// written when a wait retires it.
void wgmma_ss_e4m3_m64n128k32(float* d, std::uint64_t desc_a, std::uint64_t desc_b,
                              bool accumulate);
void wgmma_commit();
void wgmma_wait(int pending);
// The warpgroups (threadIdx.x / 128) of the committed wgmma groups of the last grid, in the
// order they were committed.
const std::vector<int>& wgmma_commit_order();

// bar.sync `id` for `count` threads.
void named_barrier(int id, int count);

// ---- the block's life (cuda_host.h's run_grid) ----

void sm90_begin_block();
// "" or what the block left undone: copies in flight, wgmmas not waited for.
std::string sm90_end_block();
// The fibers' progress hook: lands one pending copy (a random one under a random schedule);
// without force, only sometimes. Whether it landed one.
bool sm90_progress(bool force);
// Clears the commit order (kept across the blocks of a grid).
void sm90_begin_grid();

}  // namespace metrale::emulation
