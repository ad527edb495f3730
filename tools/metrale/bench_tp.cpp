// metrale bench --tp N: one block's linear layers split over N ranks, one process each (mpirun
// -np N; on the CPU over MPI, on CUDA a GPU per rank over NCCL), with the tensor-parallel layers of
// metrale/ops/parallel_linear.h: q/k/v and gate/up column-parallel (gathered), o and down
// row-parallel (FP32 partials, summed, rounded once). Every rank holds its shard of the same random
// weights; rank 0 also runs each whole layer alone on a backend with every core (the one-rank time
// the speedup is against, and the result each case is checked against: bit for bit for
// column-parallel, within the row-parallel bound otherwise). Times are each phase's median over the
// repeats, the slowest rank's.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench_models.h"
#include "commands.h"
#include "metrale/checkpoint_layers.h"
#include "metrale/communicator.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/model_scope.h"
#include "metrale/numerics.h"
#include "metrale/ops/elementwise.h"
#include "metrale/ops/gemm.h"
#include "metrale/ops/parallel_linear.h"
#include "metrale/ops/quant_weights.h"
#include "metrale/runtime.h"
#include "metrale/sharded_checkpoint.h"
#include "toolkit/gemm_tolerance.h"
#include "toolkit/random_weights.h"

namespace metrale::cli {
namespace {

using Clock = std::chrono::steady_clock;

enum class Split { kColumn, kRow };

struct TpLayer {
  Layer layer;
  Split split = Split::kColumn;
};

// A checkpoint's NVFP4 linear layers ("<layer>.weight" U8 with its "<layer>.weight_scale"):
// o_proj and down_proj row-parallel, the others column-parallel. Error(kIo) when there is none.
std::vector<TpLayer> checkpoint_layers(const ShardedCheckpoint& ckpt) {
  std::vector<TpLayer> out;
  constexpr std::string_view kSuffix = ".weight";
  for (const std::string& name : ckpt.names()) {
    if (name.size() <= kSuffix.size() || !name.ends_with(kSuffix)) continue;
    const std::string layer = name.substr(0, name.size() - kSuffix.size());
    const SafetensorsTensorInfo& info = ckpt.info(name);
    if (info.dtype != "U8" || info.shape.size() != 2 || !ckpt.contains(layer + ".weight_scale")) {
      continue;
    }
    const bool row =
        layer.find("o_proj") != std::string::npos || layer.find("down_proj") != std::string::npos;
    out.push_back({{layer, info.shape[0], info.shape[1] * 2}, row ? Split::kRow : Split::kColumn});
  }
  if (out.empty()) {
    throw Error(ErrorCode::kIo, "bench",
                fmt::format("{}: no NVFP4 linear layer (a U8 '<layer>.weight' with its "
                            "'<layer>.weight_scale') to split",
                            ckpt.index_path()));
  }
  return out;
}

// A model's o and down projections are row-parallel (their input is the previous layer's
// sharded output), the others column-parallel; --shapes alternate, as a block's pairs do.
std::vector<TpLayer> tp_layers(const BenchOptions& bench) {
  std::vector<TpLayer> out;
  if (!bench.shapes.empty()) {
    for (std::size_t i = 0; i < bench.shapes.size(); ++i) {
      out.push_back({{fmt::format("{}x{}", bench.shapes[i].first, bench.shapes[i].second),
                      bench.shapes[i].first, bench.shapes[i].second},
                     i % 2 == 0 ? Split::kColumn : Split::kRow});
    }
    return out;
  }
  for (const Layer& l : model_shape(bench.model).layers) {
    out.push_back({l, l.name == "o" || l.name == "down" ? Split::kRow : Split::kColumn});
  }
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// f run once to warm up, then `repeats` times with every rank starting together (a barrier
// before each); the median in ms.
template <class F>
double timed(Communicator& comm, Backend& backend, int repeats, F&& f) {
  f();
  backend.synchronize(backend.default_stream());
  std::vector<double> ms;
  for (int r = 0; r < repeats; ++r) {
    comm.barrier();
    const auto start = Clock::now();
    f();
    backend.synchronize(backend.default_stream());
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  }
  return median(std::move(ms));
}

// Each value's largest over the ranks (the slowest rank sets a layer's time).
std::vector<double> slowest(Communicator& comm, const std::vector<double>& mine) {
  Backend& b = comm.backend();
  const std::size_t bytes = mine.size() * sizeof(double);
  const DevicePtr in = b.alloc(bytes), all = b.alloc(bytes * static_cast<std::size_t>(comm.size()));
  b.copy_h2d(in, mine.data(), bytes);
  comm.all_gather(in, all, bytes);
  std::vector<double> every(mine.size() * static_cast<std::size_t>(comm.size()));
  b.copy_d2h(every.data(), all, every.size() * sizeof(double));
  b.free(in);
  b.free(all);
  std::vector<double> out = mine;
  for (std::size_t i = 0; i < every.size(); ++i) {
    out[i % mine.size()] = std::max(out[i % mine.size()], every[i]);
  }
  return out;
}

template <class T>
DevicePtr upload(ModelScope& scope, const std::vector<T>& v, const char* label) {
  const DevicePtr p = scope.alloc_buffer(label, v.size() * sizeof(T));
  scope.backend().copy_h2d(p, v.data(), v.size() * sizeof(T));
  return p;
}

std::vector<std::uint16_t> download(Backend& b, DevicePtr p, std::size_t n) {
  std::vector<std::uint16_t> v(n);
  b.copy_d2h(v.data(), p, n * 2);
  return v;
}

// Random BF16 activations in [-1, 1], the same on every rank for a seed.
std::vector<std::uint16_t> activations(std::uint64_t seed, std::size_t n) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<std::uint16_t> a(n);
  for (auto& x : a) x = num::f32_to_bf16(u(gen));
  return a;
}

// Columns [k0, k1) of each of the m rows of A [m, k].
std::vector<std::uint16_t> column_slice(const std::vector<std::uint16_t>& a, std::int64_t m,
                                        std::int64_t k, std::int64_t k0, std::int64_t k1) {
  std::vector<std::uint16_t> out;
  out.reserve(static_cast<std::size_t>(m * (k1 - k0)));
  for (std::int64_t r = 0; r < m; ++r) {
    out.insert(out.end(), a.begin() + r * k + k0, a.begin() + r * k + k1);
  }
  return out;
}

// The row-parallel check on a sample of outputs: against float64 and against one rank, within
// the bounds of docs/RELIABILITY.md ("Collectives across ranks"); the worst ratio to its bound.
double row_check(const std::vector<std::uint16_t>& tp, const std::vector<std::uint16_t>& one,
                 const std::vector<std::uint16_t>& a, const HostQuantWeights& w, std::int64_t m,
                 int ranks, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  double worst = 0;
  for (int s = 0; s < 64; ++s) {
    const std::int64_t i = static_cast<std::int64_t>(gen() % static_cast<std::uint64_t>(m));
    const std::int64_t j = static_cast<std::int64_t>(gen() % static_cast<std::uint64_t>(w.n));
    double exact = 0, magnitude = 0;
    for (std::int64_t kk = 0; kk < w.k; ++kk) {
      const double t =
          static_cast<double>(num::bf16_to_f32(a[static_cast<std::size_t>(i * w.k + kk)])) *
          w.exact_weight(j, kk);
      exact += t;
      magnitude += std::fabs(t);
    }
    const double c_tp = num::bf16_to_f32(tp[static_cast<std::size_t>(i * w.n + j)]);
    const double c_one = num::bf16_to_f32(one[static_cast<std::size_t>(i * w.n + j)]);
    const double roundings = 2.0 * static_cast<double>(w.k) + ranks + 4;
    worst = std::max({worst, toolkit::row_parallel_ratio(c_tp, c_one, magnitude, roundings),
                      toolkit::row_parallel_exact_ratio(c_tp, exact, magnitude, roundings)});
  }
  return worst;
}

struct Case {
  std::string layer, split;
  std::int64_t n = 0, k = 0, m = 0;
  double compute_ms = 0, comm_ms = 0, total_ms = 0, one_rank_ms = 0;
  std::string check;
  bool ok = true;
};

// The backend of each rank's process. CPU: this node's cores shared among its ranks (OpenMPI
// says how many share it), every core for rank 0's one-rank run. CUDA: the process's first
// visible GPU, a GPU per rank (docs/TENSOR_PARALLEL.md: CUDA_VISIBLE_DEVICES from the local
// rank); "auto" takes CUDA where it is usable, else the CPU.
struct RankBackends {
  bool cuda = false;
  unsigned threads = 0;  // CPU: threads per rank
  // A backend for this rank's share (whole = false) or for one rank alone (whole = true).
  std::unique_ptr<Backend> make(bool whole) const {
    if (cuda) return create_backend("cuda");
    if (whole) return std::make_unique<CpuBackend>();
    CpuBackendOptions cpu;
    cpu.threads = threads;
    return std::make_unique<CpuBackend>(cpu);
  }
};

RankBackends rank_backends(const std::string& which, int tp) {
  RankBackends rb;
  if (which == "cuda") {
    rb.cuda = true;
  } else if (which == "auto") {
    std::string why;
    rb.cuda = create_backend("auto", &why)->name() == "cuda";
  } else if (which != "cpu") {
    (void)create_backend(which);  // an unknown name: its kInvalidArgument
  }
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const unsigned per_node = local != nullptr && std::atoi(local) > 0
                                ? static_cast<unsigned>(std::atoi(local))
                                : static_cast<unsigned>(tp);
  rb.threads = std::max(1u, std::max(1u, std::thread::hardware_concurrency()) / per_node);
  return rb;
}

}  // namespace

int run_bench_tp(const CommonOptions& options, const BenchOptions& bench) {
  const int tp = bench.tp;
  // A sharded checkpoint (its index), opened and checked on every rank before anything runs:
  // a bad one is the same kIo error everywhere (exit 2).
  std::optional<ShardedCheckpoint> ckpt;
  if (!bench.weights.empty()) {
    ckpt.emplace(ShardedCheckpoint::open(resolve_checkpoint_path(bench.weights)));
  }
  const RankBackends rb = rank_backends(options.backend, tp);
  ModelScope scope(rb.make(/*whole=*/false));
  const bool cuda = scope.backend().name() == "cuda";
  CommunicatorOptions co;
  co.transport = cuda ? "nccl" : "mpi";
  Communicator& comm = create_communicator(scope, co);
  if (comm.size() != tp) {
    throw Error(ErrorCode::kInvalidArgument, "bench",
                fmt::format("--tp {} but this process is rank {} of {}: start it as `mpirun -np "
                            "{} metrale bench --tp {} ...`",
                            tp, comm.rank(), comm.size(), tp, tp));
  }
  const bool lead = comm.rank() == 0;
  Backend& backend = scope.backend();
  const StreamHandle stream = backend.default_stream();

  // The seed: fresh on rank 0, the same on every rank.
  std::vector<std::uint64_t> seed_v{
      lead ? (std::uint64_t{std::random_device{}()} << 32) ^ std::random_device{}() : 0};
  const DevicePtr seed_buf = upload(scope, seed_v, "seed");
  comm.broadcast(seed_buf, 8, 0);
  backend.copy_d2h(seed_v.data(), seed_buf, 8);
  const std::uint64_t seed = seed_v[0];

  // Rank 0's one-rank runs: the whole layer on every core, or on rank 0's GPU.
  std::unique_ptr<ModelScope> alone;
  if (lead) alone = std::make_unique<ModelScope>(rb.make(/*whole=*/true));

  const std::vector<std::int64_t> ms =
      bench.ms.empty() ? std::vector<std::int64_t>{1, 16} : bench.ms;
  std::vector<Case> cases;
  bool all_ok = true;
  std::uint64_t layer_seed = seed;
  for (const TpLayer& tl : ckpt ? checkpoint_layers(*ckpt) : tp_layers(bench)) {
    const Layer& l = tl.layer;
    const bool column = tl.split == Split::kColumn;
    std::mt19937_64 gen(++layer_seed);
    // Each rank's shard: read alone from the checkpoint (rank 0 also reads the whole layer, for
    // its one-rank run), or cut from the same random weights on every rank.
    HostQuantWeights full, mine;
    TensorSlice part;
    if (ckpt) {
      Nvfp4LinearShard shard =
          load_nvfp4_linear_shard(*ckpt, l.name, column ? 0 : 1, comm.rank(), tp);
      mine = std::move(shard.w);
      part = shard.slice;
      if (lead) full = load_nvfp4_linear_shard(*ckpt, l.name, 0, 0, 1).w;
    } else {
      full = toolkit::random_weights(WeightFormat::kNvfp4, l.n, l.k, gen);
      part = shard_slice(column ? 0 : 1, column ? l.n : l.k, column ? 8 : 16, comm.rank(), tp);
      mine = column ? slice_rows(full, part.begin, part.end)
                    : slice_columns(full, part.begin, part.end);
    }
    const ops::QuantWeights& w =
        scope.add(ops::make_weights_resource(backend, mine, l.name)).weights();
    const ops::QuantWeights* w_one = nullptr;
    if (lead) {
      w_one = &alone->add(ops::make_weights_resource(alone->backend(), full, l.name)).weights();
    }
    for (const std::int64_t m : ms) {
      const std::vector<std::uint16_t> a = activations(
          layer_seed * 7919 + static_cast<std::uint64_t>(m), static_cast<std::size_t>(m * l.k));
      const auto out_elems = static_cast<std::size_t>(m * l.n);
      const DevicePtr a_dev =
          upload(scope, column ? a : column_slice(a, m, l.k, part.begin, part.end), "A");
      const DevicePtr c = scope.alloc_buffer("C", out_elems * 2);
      Case cs;
      cs.layer = l.name;
      cs.split = column ? "column" : "row";
      cs.n = l.n;
      cs.k = l.k;
      cs.m = m;
      double compute = 0, communicate = 0, total = 0;
      if (column) {
        const std::int64_t n_local = part.end - part.begin;
        const DevicePtr c_local =
            scope.alloc_buffer("C shard", static_cast<std::size_t>(m * n_local) * 2);
        const ops::GemmPlan p = ops::plan(backend, m, w);
        const ops::GemmWorkspace ws = ops::scratch_workspace(p, stream);
        compute = timed(comm, backend, bench.repeats,
                        [&] { ops::run(p, stream, a_dev, w, c_local, ws); });
        communicate = timed(comm, backend, bench.repeats,
                            [&] { ops::gather_columns(comm, c_local, m, n_local, c, stream); });
        total = timed(comm, backend, bench.repeats,
                      [&] { ops::column_parallel_gemm(comm, p, stream, a_dev, w, c_local, c); });
      } else {
        ops::GemmOptions o;
        o.out_f32 = true;
        const ops::GemmPlan p = ops::plan(backend, m, w, o);
        const ops::GemmWorkspace ws = ops::scratch_workspace(p, stream);
        const DevicePtr partial = scope.alloc_buffer("partials", out_elems * 4);
        compute = timed(comm, backend, bench.repeats,
                        [&] { ops::run(p, stream, a_dev, w, partial, ws); });
        communicate = timed(comm, backend, bench.repeats, [&] {
          comm.all_reduce_sum(partial, partial, out_elems, ReduceType::kF32, stream);
          ops::cast_f32_to_bf16(backend, stream, partial, c, out_elems);
        });
        total = timed(comm, backend, bench.repeats,
                      [&] { ops::row_parallel_gemm(comm, p, stream, a_dev, w, c); });
      }
      const std::vector<std::uint16_t> got = download(backend, c, out_elems);
      // The one-rank run and the check, on rank 0 while the others wait at the barrier.
      double one_rank = 0, worst = 0;
      if (lead) {
        Backend& ab = alone->backend();
        const DevicePtr a_one = upload(*alone, a, "A");
        const DevicePtr c_one = alone->alloc_buffer("C", out_elems * 2);
        const ops::GemmPlan p = ops::plan(ab, m, *w_one);
        const ops::GemmWorkspace ws = ops::scratch_workspace(p, ab.default_stream());
        std::vector<double> t;
        for (int r = 0; r <= bench.repeats; ++r) {
          const auto start = Clock::now();
          ops::run(p, ab.default_stream(), a_one, *w_one, c_one, ws);
          ab.synchronize(ab.default_stream());
          if (r > 0)
            t.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
        }
        one_rank = median(std::move(t));
        const std::vector<std::uint16_t> one = download(ab, c_one, out_elems);
        if (column && got == one) {
          cs.check = "bitwise";
        } else if (column && !cuda) {
          cs.ok = false;
          cs.check = "DIFFERS";
        } else {
          // Row-parallel; or a CUDA column shard, whose narrower N may split K otherwise than
          // the whole layer's GEMM does (the decode route's split-K), so its FP32 sums are the
          // same terms in another order: held to the same bound.
          worst = row_check(got, one, a, full, m, tp, layer_seed + static_cast<std::uint64_t>(m));
          cs.ok = worst <= 1.0;
          cs.check = fmt::format("{:.2f} of bound", worst);
        }
      }
      comm.barrier();
      const std::vector<double> t = slowest(comm, {compute, communicate, total, one_rank});
      cs.compute_ms = t[0];
      cs.comm_ms = t[1];
      cs.total_ms = t[2];
      cs.one_rank_ms = t[3];
      all_ok = all_ok && cs.ok;
      cases.push_back(std::move(cs));
    }
  }

  const std::string transport = fmt::format("{}", comm.transport());
  std::vector<double> leftover{0};
  if (lead) {
    const TeardownReport r = alone->teardown();
    leftover[0] += static_cast<double>(r.live_bytes_after + r.swept_bytes);
  }
  // The ranks' teardowns are reported through a communicator of their own, made before the
  // model's goes.
  ModelScope report(std::make_unique<CpuBackend>(CpuBackendOptions{builtin_host_modules(), 1}));
  CommunicatorOptions over_mpi;
  over_mpi.transport = "mpi";
  Communicator& tell = create_communicator(report, over_mpi);
  const TeardownReport td = scope.teardown();
  leftover[0] += static_cast<double>(td.live_bytes_after + td.swept_bytes);
  const double worst_leftover = slowest(tell, leftover)[0];
  const bool clean = worst_leftover == 0;
  const TeardownReport last = report.teardown();
  const bool last_clean = last.clean() && last.live_bytes_after == 0;

  if (lead) {
    if (options.json) {
      nlohmann::json doc;
      doc["tp"] = tp;
      doc["transport"] = transport;
      doc["backend"] = std::string(backend.name());
      if (!cuda) doc["threads_per_rank"] = rb.threads;
      doc["seed"] = seed;
      for (const Case& c : cases) {
        doc["cases"].push_back({{"layer", c.layer},
                                {"split", c.split},
                                {"n", c.n},
                                {"k", c.k},
                                {"m", c.m},
                                {"compute_ms", c.compute_ms},
                                {"comm_ms", c.comm_ms},
                                {"total_ms", c.total_ms},
                                {"one_rank_ms", c.one_rank_ms},
                                {"speedup", c.one_rank_ms / c.total_ms},
                                {"check", c.check},
                                {"ok", c.ok}});
      }
      doc["teardown_bytes_left_on_worst_rank"] = worst_leftover;
      fmt::print("{}\n", doc.dump(2));
    } else {
      fmt::print("metrale bench --tp {}: {} on {} ranks ({}), {}, seed {}\n", tp,
                 ckpt ? ckpt->index_path()
                      : (bench.shapes.empty() ? bench.model + " block" : std::string("--shapes")),
                 tp, transport,
                 cuda ? std::string("cuda backend, a GPU per rank")
                      : fmt::format("cpu backend, {} thread(s) per rank", rb.threads),
                 seed);
      fmt::print("times: the slowest rank's median of {} runs; 1 rank: rank 0 alone on {}\n",
                 bench.repeats, cuda ? "its GPU" : "every core");
      std::size_t width = 8;  // the layer column fits the longest name (a checkpoint's are long)
      for (const Case& c : cases) width = std::max(width, c.layer.size());
      fmt::print("{:<{}} {:<6} {:>6} {:>6} {:>5} {:>11} {:>9} {:>9} {:>10} {:>8}  {}\n", "layer",
                 width, "split", "N", "K", "M", "compute ms", "comm ms", "total ms", "1 rank ms",
                 "speedup", "check");
      for (const Case& c : cases) {
        fmt::print(
            "{:<{}} {:<6} {:>6} {:>6} {:>5} {:>11.3f} {:>9.3f} {:>9.3f} {:>10.3f} {:>7.2f}x  {}\n",
            c.layer, width, c.split, c.n, c.k, c.m, c.compute_ms, c.comm_ms, c.total_ms,
            c.one_rank_ms, c.one_rank_ms / c.total_ms, c.check);
      }
      fmt::print("teardown: {} on every rank ({} ranks)\n",
                 clean ? std::string("0 bytes left")
                       : fmt::format("{} bytes left on the worst", worst_leftover),
                 tp);
    }
  }
  if (!last_clean) {
    fmt::print(stderr, "metrale bench: rank {}: the report communicator's teardown: {}\n",
               comm.rank(), last.leak_summary());
  }
  return all_ok && clean && last_clean ? 0 : 1;
}

}  // namespace metrale::cli
