// The sm_90 units on the host (sm90_host.h). One block runs at a time, its threads as fibers on
// one OS thread, so the state below needs no locks.
#include "sm90_host.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "fibers.h"
#include "metrale/numerics.h"

namespace metrale::emulation {
namespace {

struct Mbarrier {
  std::uint32_t count = 0;  // arrivals a phase expects
  std::uint32_t pending = 0;
  std::int64_t tx = 0;      // bytes announced and not yet landed
  std::uint64_t phase = 0;  // phases completed
};

struct Copy {
  std::uint32_t dst = 0, bar = 0, bytes = 0;
  const unsigned char* src = nullptr;
};

// One wgmma of a warpgroup: its descriptors and each thread's registers. RS BF16 m64n128k16 (A
// from the threads' registers) or, with e4m3, SS E4M3 m64n128k32 (A through desc_a).
struct Wgmma {
  std::uint64_t desc = 0, desc_a = 0;
  bool e4m3 = false, accumulate = true;
  std::array<float*, 128> d{};
  std::array<const std::uint32_t*, 128> a{};
  int threads = 0;
};

// One thread's cp.async copy of 16 bytes; src null: zeros.
struct AsyncCopy {
  std::uint32_t dst = 0;
  const unsigned char* src = nullptr;
  int thread = 0;  // the issuer: its fence.proxy.async covers the bytes once they have landed
};

// A thread's copies not yet landed: those since its last commit, then its committed groups.
struct AsyncCopies {
  std::vector<AsyncCopy> open;
  std::deque<std::vector<AsyncCopy>> groups;
};

struct Warpgroup {
  Barrier sync{128};
  std::vector<Wgmma> open;        // the wgmmas since the last commit
  std::array<int, 128> issued{};  // per thread: how many of them it issued
  std::deque<std::vector<Wgmma>> committed;
};

// A warp instruction's accesses: lane -> (address, bytes).
struct Access {
  std::array<std::uint32_t, 32> addr{};
  std::array<int, 32> bytes{};
  std::uint32_t lanes = 0;
  const char* what = "";
};

constexpr int kMaxWarpgroups = 8;

struct State {
  std::unique_ptr<unsigned char[]> storage;
  unsigned char* arena = nullptr;
  std::unordered_map<std::uint32_t, Mbarrier> bars;
  std::vector<Copy> copies;
  std::array<AsyncCopies, 1024> async;  // per thread
  // Shared memory written through the generic proxy (st.shared, cp.async) and not yet ordered
  // before the async proxy by its writer's fence.proxy.async: per thread its 16-byte granules,
  // and per granule how many threads hold it so.
  std::array<std::unordered_set<std::uint32_t>, 1024> unfenced;
  std::unordered_map<std::uint32_t, int> unfenced_by;
  std::array<Warpgroup, kMaxWarpgroups> groups;
  std::vector<int> commit_order;
  std::map<int, Barrier> named;
  std::map<std::pair<int, long>, Access> accesses;  // (warp, sequence)
  std::array<long, 1024> sequence{};                // per thread
  BankReport banks;
  Plant plant = Plant::kNone;
};

State& st() {
  static State s;
  if (!s.storage) {
    s.storage = std::make_unique<unsigned char[]>(kSharedBytes + 1024);
    const auto at = reinterpret_cast<std::uintptr_t>(s.storage.get());
    s.arena = s.storage.get() + ((1024 - at % 1024) % 1024);
  }
  return s;
}

Warpgroup& group_of_caller() {
  return st().groups[static_cast<std::size_t>(current_fiber() / 128)];
}

// A phase completes when its arrivals are all in and its announced bytes have all landed.
void maybe_complete(Mbarrier& b) {
  if (b.pending == 0 && b.tx == 0) {
    ++b.phase;
    b.pending = b.count;
  }
}

Mbarrier* barrier_at(std::uint32_t bar, const char* what) {
  auto it = st().bars.find(bar);
  if (it == st().bars.end()) {
    fault(std::string(what) + ": no mbarrier was initialized at shared address " +
          std::to_string(bar));
    return nullptr;
  }
  return &it->second;
}

void land(std::size_t i) {
  State& s = st();
  const Copy c = s.copies[i];
  s.copies.erase(s.copies.begin() + static_cast<std::ptrdiff_t>(i));
  if (unsigned char* to = shared_at(c.dst, c.bytes, 16, "cp.async.bulk")) {
    std::memcpy(to, c.src, c.bytes);
  }
  Mbarrier* b = barrier_at(c.bar, "cp.async.bulk complete_tx");
  if (b == nullptr) return;
  b->tx -= c.bytes;
  if (b->tx < 0) {
    fault("cp.async.bulk: " + std::to_string(c.bytes) +
          " bytes landed on an mbarrier whose phase announced fewer (a missing expect_tx)");
    b->tx = 0;
  }
  maybe_complete(*b);
}

// Thread t wrote [addr, addr + bytes) through the generic proxy.
void mark_generic(int t, std::uint32_t addr, std::size_t bytes) {
  State& s = st();
  for (std::uint32_t g = addr / 16; g <= (addr + static_cast<std::uint32_t>(bytes) - 1) / 16; ++g) {
    if (s.unfenced[static_cast<std::size_t>(t)].insert(g).second) ++s.unfenced_by[g];
  }
}

// A wgmma operand read at addr: a fault where a generic-proxy write to it has no fence.proxy.async
// of its writer after it (PTX ISA, "Async Proxy" and wgmma.mma_async: wgmma reads its shared
// operands through the async proxy, and only fence.proxy.async orders the generic proxy's
// writes before such reads).
void check_async_read(std::uint32_t addr, const char* what) {
  State& s = st();
  if (s.unfenced_by.empty()) return;
  const auto it = s.unfenced_by.find(addr / 16);
  if (it != s.unfenced_by.end() && it->second > 0) {
    fault(std::string(what) + ": shared address " + std::to_string(addr) +
          " was written through the generic proxy with no fence.proxy.async after it");
  }
}

// The shared address of byte `byte` of row `row` of a K-major tile through its descriptor: start
// address, stride between 8-row groups, 128-byte rows, the 128-byte swizzle on the address (bits
// 4-6 XOR bits 7-9).
std::uint32_t operand_address(std::uint64_t desc, int row, int byte) {
  const auto start = static_cast<std::uint32_t>(desc & 0x3FFFu) << 4;
  const auto sbo = static_cast<std::uint32_t>((desc >> 32) & 0x3FFFu) << 4;
  const std::uint32_t linear = start + static_cast<std::uint32_t>(row / 8) * sbo +
                               static_cast<std::uint32_t>(row % 8) * 128u +
                               static_cast<std::uint32_t>(byte);
  return linear ^ (((linear >> 7) & 7u) << 4);
}

// B element (kk, n) of a K-major BF16 tile.
float b_element(std::uint64_t desc, int n, int kk) {
  const std::uint32_t addr = operand_address(desc, n, 2 * kk);
  check_async_read(addr, "wgmma B operand");
  std::uint16_t b = 0;
  if (const unsigned char* p = shared_at(addr, 2, 2, "wgmma B operand")) std::memcpy(&b, p, 2);
  return num::bf16_to_f32(b);
}

// Element (row, kk) of a K-major E4M3 tile (A or B of an SS wgmma).
float e4m3_element(std::uint64_t desc, int row, int kk, const char* what) {
  const std::uint32_t addr = operand_address(desc, row, kk);
  check_async_read(addr, what);
  const unsigned char* p = shared_at(addr, 1, 1, what);
  return p == nullptr ? 0.0f : num::e4m3_to_f32(*p);
}

// Whether desc is what the kernels' tiles are: K-major, 128-byte swizzle, 1024-byte row groups.
bool swizzled_k_major(std::uint64_t desc) {
  return desc >> 62 == 1 && ((desc >> 32) & 0x3FFFu) == 1024 / 16;
}

float bf16_half(std::uint32_t reg, int half) {
  return num::bf16_to_f32(static_cast<std::uint16_t>(reg >> (16 * half)));
}

// Retires one wgmma: D (64 x 128, FP32) += A (64 x 16 from the threads' registers) x B (16 x 128
// from shared memory). A element (r, kk) is in thread 32 (r / 16) + 4 (r % 8) + (kk % 8) / 2,
// register (r % 16 >= 8) + 2 (kk >= 8), half kk % 2; D element (r, n) is register
// 4 (n / 8) + 2 ((r % 16) / 8) + n % 2 of thread 32 (r / 16) + 4 (r % 8) + (n % 8) / 2. FP32
// sums in k order (products of BF16 are exact).
void retire_rs(const Wgmma& w) {
  if (!swizzled_k_major(w.desc)) {
    fault("wgmma: a B descriptor that is not K-major 128-byte swizzled with 1024-byte row groups");
    return;
  }
  static float b[16][128];
  for (int kk = 0; kk < 16; ++kk) {
    for (int n = 0; n < 128; ++n) b[kk][n] = b_element(w.desc, n, kk);
  }
  for (int r = 0; r < 64; ++r) {
    float a[16];
    for (int kk = 0; kk < 16; ++kk) {
      const int at = 32 * (r / 16) + 4 * (r % 8) + (kk % 8) / 2;
      const int reg = ((r % 16) >= 8 ? 1 : 0) + (kk >= 8 ? 2 : 0);
      a[kk] = bf16_half(w.a[static_cast<std::size_t>(at)][reg], kk % 2);
    }
    for (int n = 0; n < 128; ++n) {
      const int dt = 32 * (r / 16) + 4 * (r % 8) + (n % 8) / 2;
      const int di = 4 * (n / 8) + 2 * ((r % 16) / 8) + n % 2;
      float sum = w.d[static_cast<std::size_t>(dt)][di];
      for (int kk = 0; kk < 16; ++kk) sum += a[kk] * b[kk][n];
      w.d[static_cast<std::size_t>(dt)][di] = sum;
    }
  }
}

// Retires one SS E4M3 wgmma: D (64 x 128, FP32) = A (64 x 32) x B (32 x 128) (+ D when
// accumulate), both operands K-major in shared memory, D in the fragments retire_rs describes.
// FP32 sums in k order (products of E4M3 are exact); the tensor cores' own accumulation keeps
// fewer bits (toolkit/gemm_tolerance.h), which a device run's bound allows for.
void retire_ss(const Wgmma& w) {
  if (!swizzled_k_major(w.desc) || !swizzled_k_major(w.desc_a)) {
    fault(
        "wgmma: an operand descriptor that is not K-major 128-byte swizzled with 1024-byte row "
        "groups");
    return;
  }
  static float a[64][32], b[128][32];
  for (int kk = 0; kk < 32; ++kk) {
    for (int r = 0; r < 64; ++r) a[r][kk] = e4m3_element(w.desc_a, r, kk, "wgmma A operand");
    for (int n = 0; n < 128; ++n) b[n][kk] = e4m3_element(w.desc, n, kk, "wgmma B operand");
  }
  for (int r = 0; r < 64; ++r) {
    for (int n = 0; n < 128; ++n) {
      const int dt = 32 * (r / 16) + 4 * (r % 8) + (n % 8) / 2;
      const int di = 4 * (n / 8) + 2 * ((r % 16) / 8) + n % 2;
      float sum = w.accumulate ? w.d[static_cast<std::size_t>(dt)][di] : 0.0f;
      for (int kk = 0; kk < 32; ++kk) sum += a[r][kk] * b[n][kk];
      w.d[static_cast<std::size_t>(dt)][di] = sum;
    }
  }
}

void retire(const Wgmma& w) {
  if (w.e4m3) {
    retire_ss(w);
  } else {
    retire_rs(w);
  }
}

// Lands one cp.async copy.
void land_async(const AsyncCopy& c) {
  mark_generic(c.thread, c.dst, 16);
  if (unsigned char* to = shared_at(c.dst, 16, 16, "cp.async")) {
    if (c.src != nullptr) {
      std::memcpy(to, c.src, 16);
    } else {
      std::memset(to, 0, 16);
    }
  }
}

// Lands one pending cp.async copy of any thread, drawn at random: hardware may complete a copy
// any time between its issue and the wait for its group.
// Only while copies are pending, and then only sometimes, so that kernels without cp.async keep
// the schedules they had.
bool land_random_async() {
  State& s = st();
  std::size_t pending = 0;
  for (const AsyncCopies& t : s.async) {
    pending += t.open.size();
    for (const auto& g : t.groups) pending += g.size();
  }
  if (pending == 0 || schedule_draw(4) != 0) return false;
  std::size_t pick = static_cast<std::size_t>(schedule_draw(pending));
  const auto take = [&pick](std::vector<AsyncCopy>& v) {
    if (pick >= v.size()) {
      pick -= v.size();
      return false;
    }
    land_async(v[pick]);
    v.erase(v.begin() + static_cast<std::ptrdiff_t>(pick));
    return true;
  };
  for (AsyncCopies& t : s.async) {
    if (take(t.open)) return true;
    for (auto& g : t.groups) {
      if (take(g)) return true;
    }
  }
  return false;
}

// The phases of one warp instruction and the worst number of distinct words a bank served in one.
int conflict_degree(const Access& a) {
  int per_phase = 32;
  for (int lane = 0; lane < 32; ++lane) {
    if ((a.lanes >> lane) & 1u)
      per_phase = a.bytes[static_cast<std::size_t>(lane)] >= 16  ? 8
                  : a.bytes[static_cast<std::size_t>(lane)] == 8 ? 16
                                                                 : 32;
  }
  int worst = 1;
  for (int first = 0; first < 32; first += per_phase) {
    std::array<std::vector<std::uint32_t>, 32> words;
    for (int lane = first; lane < first + per_phase; ++lane) {
      if (((a.lanes >> lane) & 1u) == 0) continue;
      const auto l = static_cast<std::size_t>(lane);
      for (std::uint32_t w = a.addr[l] / 4; w <= (a.addr[l] + a.bytes[l] - 1) / 4; ++w) {
        auto& bank = words[w % 32];
        if (std::find(bank.begin(), bank.end(), w) == bank.end()) bank.push_back(w);
      }
    }
    for (const auto& bank : words) worst = std::max(worst, static_cast<int>(bank.size()));
  }
  return worst;
}

void judge(int warp, long seq, const Access& a) {
  State& s = st();
  ++s.banks.instructions;
  const int degree = conflict_degree(a);
  if (degree > 1 && s.banks.conflicted++ == 0) {
    s.banks.first = std::string(a.what) + " (warp " + std::to_string(warp) + ", its access " +
                    std::to_string(seq) + "): a " + std::to_string(degree) + "-way bank conflict";
  }
}

}  // namespace

void set_plant(Plant p) {
  st().plant = p;
}

bool planted(Plant p) {
  return st().plant == p;
}

unsigned char* shared_memory() {
  return st().arena;
}

std::uint32_t shared_address(const void* p) {
  const auto* c = static_cast<const unsigned char*>(p);
  return kSharedBase + static_cast<std::uint32_t>(c - st().arena);
}

unsigned char* shared_at(std::uint32_t addr, std::size_t bytes, std::size_t align,
                         const char* what) {
  if (addr % align != 0 || addr < kSharedBase || addr - kSharedBase + bytes > kSharedBytes) {
    fault(std::string(what) + ": " + std::to_string(bytes) + " bytes at shared address " +
          std::to_string(addr) + (addr % align != 0 ? ", misaligned" : ", outside the block's") +
          " (thread " + std::to_string(current_fiber()) + ")");
    return nullptr;
  }
  return st().arena + (addr - kSharedBase);
}

void record_shared(std::uint32_t addr, int bytes, const char* what) {
  State& s = st();
  const int tid = current_fiber(), warp = tid / 32, lane = tid % 32;
  const long seq = s.sequence[static_cast<std::size_t>(tid)]++;
  Access& a = s.accesses[{warp, seq}];
  a.addr[static_cast<std::size_t>(lane)] = addr;
  a.bytes[static_cast<std::size_t>(lane)] = bytes;
  a.lanes |= 1u << lane;
  a.what = what;
  if (a.lanes == 0xFFFFFFFFu) {
    judge(warp, seq, a);
    s.accesses.erase({warp, seq});
  }
}

BankReport bank_report() {
  return st().banks;
}

void reset_bank_report() {
  st().banks = BankReport{};
}

void mbarrier_init(std::uint32_t bar, std::uint32_t count) {
  if (shared_at(bar, 8, 8, "mbarrier.init") == nullptr) return;
  Mbarrier& b = st().bars[bar];
  b = Mbarrier{};
  b.count = count;
  b.pending = count;
}

void mbarrier_expect_tx(std::uint32_t bar, std::uint32_t bytes) {
  if (Mbarrier* b = barrier_at(bar, "mbarrier.expect_tx")) b->tx += bytes;
}

void mbarrier_arrive(std::uint32_t bar) {
  Mbarrier* b = barrier_at(bar, "mbarrier.arrive");
  if (b == nullptr) return;
  if (b->pending == 0) {
    fault("mbarrier.arrive: more arrivals than the phase expects");
    return;
  }
  --b->pending;
  maybe_complete(*b);
  yield();  // whoever waited may go first
}

void mbarrier_wait(std::uint32_t bar, std::uint32_t parity) {
  Mbarrier* b = barrier_at(bar, "mbarrier.try_wait.parity");
  if (b == nullptr) return;
  // Phase n's parity is n % 2; it has completed once b->phase > n, that is when the current
  // phase's parity differs from `parity`.
  const std::function<bool()> done = [b, parity] { return (b->phase & 1u) != (parity & 1u); };
  wait_until(done);
}

void bulk_copy(std::uint32_t dst, const void* src, std::uint32_t bytes, std::uint32_t bar) {
  if (bytes % 16 != 0 || dst % 16 != 0 || reinterpret_cast<std::uintptr_t>(src) % 16 != 0) {
    fault("cp.async.bulk: sizes and both addresses must be multiples of 16");
    return;
  }
  st().copies.push_back(Copy{dst, bar, bytes, static_cast<const unsigned char*>(src)});
  yield();
}

void note_generic_write(std::uint32_t addr, std::size_t bytes) {
  mark_generic(current_fiber(), addr, bytes);
}

void fence_proxy_async() {
  State& s = st();
  auto& mine = s.unfenced[static_cast<std::size_t>(current_fiber())];
  for (const std::uint32_t g : mine) {
    if (--s.unfenced_by[g] == 0) s.unfenced_by.erase(g);
  }
  mine.clear();
}

void cp_async(std::uint32_t dst, const void* src, int src_bytes) {
  if (src_bytes != 0 && src_bytes != 16) {
    fault("cp.async: the kernels copy 16 bytes or zero-fill 16 (src-size " +
          std::to_string(src_bytes) + ")");
    return;
  }
  if (dst % 16 != 0) {
    fault("cp.async: a shared address that is not 16-byte aligned");
    return;
  }
  const auto* from = src_bytes == 0 ? nullptr : static_cast<const unsigned char*>(src);
  st().async[static_cast<std::size_t>(current_fiber())].open.push_back(
      AsyncCopy{dst, from, current_fiber()});
}

void cp_async_commit() {
  AsyncCopies& t = st().async[static_cast<std::size_t>(current_fiber())];
  t.groups.push_back(std::move(t.open));
  t.open.clear();
}

void cp_async_wait(int pending) {
  AsyncCopies& t = st().async[static_cast<std::size_t>(current_fiber())];
  if (planted(Plant::kNoAsyncWait)) return;
  while (static_cast<int>(t.groups.size()) > pending) {
    for (const AsyncCopy& c : t.groups.front()) land_async(c);
    t.groups.pop_front();
  }
}

bool sm90_progress(bool force) {
  State& s = st();
  if (!force && land_random_async()) return true;
  if (s.copies.empty()) return false;
  if (!force && schedule_draw(2) == 0) return false;
  land(static_cast<std::size_t>(schedule_draw(s.copies.size())));
  return true;
}

void wgmma_fence() {
  wait_at(group_of_caller().sync);
}

void wgmma_rs_m64n128k16(float* d, const std::uint32_t* a, std::uint64_t desc_b) {
  Warpgroup& g = group_of_caller();
  const auto t = static_cast<std::size_t>(current_fiber() % 128);
  const auto i = static_cast<std::size_t>(g.issued[t]++);
  if (g.open.size() <= i) g.open.resize(i + 1);
  Wgmma& w = g.open[i];
  if (w.threads > 0 && w.desc != desc_b) {
    fault("wgmma: the threads of a warpgroup gave one wgmma different descriptors");
  }
  w.desc = desc_b;
  w.d[t] = d;
  w.a[t] = a;
  ++w.threads;
}

void wgmma_ss_e4m3_m64n128k32(float* d, std::uint64_t desc_a, std::uint64_t desc_b,
                              bool accumulate) {
  Warpgroup& g = group_of_caller();
  const auto t = static_cast<std::size_t>(current_fiber() % 128);
  const auto i = static_cast<std::size_t>(g.issued[t]++);
  if (g.open.size() <= i) g.open.resize(i + 1);
  Wgmma& w = g.open[i];
  if (w.threads > 0 &&
      (w.desc != desc_b || w.desc_a != desc_a || !w.e4m3 || w.accumulate != accumulate)) {
    fault("wgmma: the threads of a warpgroup gave one wgmma different operands");
  }
  w.desc = desc_b;
  w.desc_a = desc_a;
  w.e4m3 = true;
  w.accumulate = accumulate;
  w.d[t] = d;
  ++w.threads;
}

void wgmma_commit() {
  Warpgroup& g = group_of_caller();
  const int wg = current_fiber() / 128;
  wait_at(g.sync, [&g, wg] {
    for (const Wgmma& w : g.open) {
      if (w.threads != 128) fault("wgmma: a wgmma that not every thread of its warpgroup issued");
    }
    g.committed.push_back(std::move(g.open));
    g.open.clear();
    g.issued.fill(0);
    st().commit_order.push_back(wg);
  });
}

void wgmma_wait(int pending) {
  Warpgroup& g = group_of_caller();
  wait_at(g.sync, [&g, pending] {
    while (static_cast<int>(g.committed.size()) > pending) {
      for (const Wgmma& w : g.committed.front()) retire(w);
      g.committed.pop_front();
    }
  });
}

const std::vector<int>& wgmma_commit_order() {
  return st().commit_order;
}

void named_barrier(int id, int count) {
  Barrier& b = st().named[id];
  if (b.count == 0) b.count = count;
  if (b.count != count) fault("bar.sync: one named barrier used with two thread counts");
  wait_at(b);
}

void sm90_begin_grid() {
  st().commit_order.clear();
}

void sm90_begin_block() {
  State& s = st();
  std::memset(s.arena, 0xFF, kSharedBytes);
  s.bars.clear();
  s.copies.clear();
  for (AsyncCopies& t : s.async) t = AsyncCopies{};
  for (auto& t : s.unfenced) t.clear();
  s.unfenced_by.clear();
  for (Warpgroup& g : s.groups) g = Warpgroup{};
  s.named.clear();
  s.accesses.clear();
  s.sequence.fill(0);
}

std::string sm90_end_block() {
  State& s = st();
  if (!s.copies.empty()) {
    return "the block ended with " + std::to_string(s.copies.size()) + " bulk copies in flight";
  }
  for (const AsyncCopies& t : s.async) {
    bool waiting = !t.open.empty();
    for (const auto& g : t.groups) waiting = waiting || !g.empty();
    if (waiting) return "the block ended with cp.async copies that no wait landed";
  }
  for (const Warpgroup& g : s.groups) {
    if (!g.committed.empty() || !g.open.empty()) {
      return "the block ended with wgmmas that no wait retired";
    }
  }
  for (const auto& [key, a] : s.accesses) judge(key.first, key.second, a);
  s.accesses.clear();
  return "";
}

}  // namespace metrale::emulation
