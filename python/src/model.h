// Model: a ModelScope seen from Python, with the weights uploaded to it and the GEMMs on them.
// A caller's arrays are borrowed (Backend::borrow) for the length of one call, so metrale reads
// and writes them in place and never frees them; a call returns once its work is done, so
// nothing it queued still uses them (docs/ARCHITECTURE.md, The Python package).
#pragma once

#include <nanobind/nanobind.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "arrays.h"
#include "metrale/cpu_backend.h"
#include "metrale/ledger.h"
#include "metrale/model_scope.h"
#include "metrale/ops/fp8_gemm.h"
#include "metrale/ops/gemm.h"
#include "metrale/ops/grouped_fp8.h"
#include "metrale/ops/grouped_gemm.h"
#include "metrale/ops/quant_weights.h"
#include "metrale/quant.h"

namespace metrale::py {

class Model;

// An upload layout by its Python name ("auto", "source", "decode", "panels"); Error
// (kInvalidArgument) naming api and the text for any other.
ops::UploadLayout parse_upload_layout(std::string_view api, std::string_view text);

// 4-bit weights on a model's device: a model resource, released at the model's teardown.
struct Weights {
  Model* model = nullptr;
  ops::QuantWeights q;
  std::string label;
  double pack_seconds = 0.0;
};

// Block-scaled E4M3 weights on a model's device, for the W8A8 op; released at teardown.
struct Fp8Weights {
  Model* model = nullptr;
  ops::Fp8Weights q;
  std::string label;
};

// BF16 weights [N, K] on a model's device for the dense GEMM (a checkpoint's BF16 layers, run as
// they are); released at teardown.
struct DenseWeights {
  Model* model = nullptr;
  DevicePtr w;
  std::int64_t n = 0, k = 0;
  std::string label;
};

// The weights of E experts of one MoE projection on a model's device (one grouped resource, with
// an optional BF16 bias [E, N]), for Model.moe_experts; released at teardown. 4-bit experts (q)
// or FP8 block-128 ones run by the grouped W8A8 op (fp8, f).
struct GroupedWeights {
  Model* model = nullptr;
  ops::GroupedWeights q;
  DevicePtr bias;
  std::string label;
  bool fp8 = false;
  ops::GroupedFp8Weights f;

  std::int32_t experts() const { return fp8 ? f.experts : q.experts; }
  std::int64_t n() const { return fp8 ? f.expert.n : q.expert.n; }
  std::int64_t k() const { return fp8 ? f.expert.k : q.expert.k; }
  std::string format() const;  // "nvfp4", "mxfp4", "int4" or "e4m3_block128"
};

// What a GEMM would run, for reading (either op's plan, flattened).
struct PlanView {
  std::string route;  // a GemmRoute's name, or "w8a8"
  std::int64_t m = 0, n = 0, k = 0, splits = 1;
  std::uint64_t workspace_bytes = 0;
  nanobind::list launches;           // each: kernel, grid, block, smem_bytes
  std::optional<std::string> dense;  // the backend's dense GEMM, when the plan runs one
  std::string text;                  // the plan's describe()
};

// A, C and the bias of one GEMM call, checked (arrays.h) against the weights' N and K.
struct Operands {
  ArrayArg a, c;
  std::optional<ArrayArg> bias;
};

class Model {
 public:
  // A model on backend `which` ("auto", "cpu", "cuda"); the backend is made with the GIL off.
  explicit Model(std::string_view which);

  const std::string& backend_name() const { return name_; }
  const std::string& device() const { return device_; }
  const std::string& chosen() const { return chosen_; }
  bool closed() const { return closing_ || scope_->torn_down(); }
  // DLPack's device type of the arrays this model takes (kDLCPU or kDLCUDA).
  int device_type() const;
  // The stream every call runs on, as DLPack's stream rule names it (CUDA: the CUstream).
  std::uint64_t stream();

  // Uploads 4-bit weights in the layout `layout` names ("auto", "source", "decode").
  Weights upload(const HostQuantWeights& host, std::string_view layout, std::string label);
  // Uploads E4M3 codes [N, K] and FP32 block scales [ceil(N/128), ceil(K/128)] (host arrays).
  Fp8Weights upload_fp8(nanobind::handle codes, nanobind::handle scales, std::int64_t n,
                        std::int64_t k, std::string label);

  // Uploads a host BF16 array [N, K] (bits: a uint16 array holding BF16 patterns) as it is.
  DenseWeights upload_dense(nanobind::handle weights, bool bits, std::string label);
  // The plan of C[M, N] = A · dequant(W)ᵀ for M rows (bias: whether there will be one).
  PlanView plan(std::int64_t m, const Weights& w, std::string_view route, bool allow_e4m3,
                bool bias);
  // The plan of the W8A8 op for M rows.
  PlanView plan_w8a8(std::int64_t m, const Fp8Weights& w, bool bias);
  // out = a · dequant(w)ᵀ (+ bias) on the arrays in place; returns when out is written, or, with
  // a caller's stream (a CUDA stream handle), once the work is queued on it (Note [foreign
  // streams]). The same holds for dense_gemm and w8a8_gemm.
  void gemm(nanobind::handle a, bool a_bits, const Weights& w, nanobind::handle out, bool out_bits,
            std::string_view route, bool allow_e4m3, nanobind::handle bias, bool bias_bits,
            std::optional<std::uint64_t> stream);
  // The plan of the backend's dense BF16 GEMM for M rows.
  PlanView plan_dense(std::int64_t m, const DenseWeights& w, bool bias);
  // out = a · Wᵀ (+ bias) on BF16 weights, the backend's dense GEMM, on the arrays in place.
  void dense_gemm(nanobind::handle a, bool a_bits, const DenseWeights& w, nanobind::handle out,
                  bool out_bits, nanobind::handle bias, bool bias_bits,
                  std::optional<std::uint64_t> stream);
  // The W8A8 op (A cast to E4M3 per row per 128 K) on the arrays in place.
  void w8a8_gemm(nanobind::handle a, bool a_bits, const Fp8Weights& w, nanobind::handle out,
                 bool out_bits, nanobind::handle bias, bool bias_bits,
                 std::optional<std::uint64_t> stream);

  // out = a · W^T (+ bias) on host memory given as pointers, with the GIL neither held nor
  // taken: metrale.torch's C++ operator (native_gemm.cpp). `w` is the Weights (or, with fp8, the
  // Fp8Weights) of this model; a, c and bias are BF16, rows x K, rows x N and N elements, C-
  // contiguous and 16-byte aligned, as check_operands would have them.
  // `executor`, when given, runs the CPU kernels' blocks instead of the backend's pool.
  void gemm_host(const void* w, bool fp8, const std::uint16_t* a, std::int64_t rows,
                 std::uint16_t* c, const std::uint16_t* bias, const CpuExecutor* executor);

  // Uploads E experts' host weights (one format and shape) as one grouped resource, with an
  // optional bias (a host BF16 array [E, N]; bits as for upload_dense).
  GroupedWeights upload_grouped(nanobind::list experts, nanobind::handle bias, bool bias_bits,
                                std::string_view layout, std::string label);
  // Uploads E experts' E4M3 weights as one grouped resource for the grouped W8A8 op: codes uint8
  // [E·N, K] (expert after expert), scales FP32 [E·ceil(N/128), ceil(K/128)], an optional bias
  // as upload_grouped's, in the layout named (auto, source or panels; decode is refused).
  GroupedWeights upload_grouped_fp8(nanobind::handle codes, nanobind::handle scales,
                                    std::int32_t experts, nanobind::handle bias, bool bias_bits,
                                    std::string_view layout, std::string label);
  // An MoE layer's experts on routed tokens (moe.cpp): out[t] = Σ_j weights[t, j] · down_e(
  // glu(gate_up_e(x[t]))) with e = ids[t, j], through moe_align, moe_gather, the grouped GEMMs,
  // moe_glu and moe_combine (ops/moe.h), on the arrays in place: x and out BF16 [T, H], ids int32
  // and weights FP32 [T, top_k]. glu: "silu" or "clamped_swiglu" (alpha, limit).
  // allow_unverified: run kernels no device run has verified (the CUDA ones, today). route: the
  // grouped GEMMs' ("auto", "decode", "fused" for 4-bit experts, "tiled" for FP8 experts).
  void moe_experts(nanobind::handle x, bool x_bits, nanobind::handle ids, nanobind::handle weights,
                   const GroupedWeights& gate_up, const GroupedWeights& down, std::string_view glu,
                   float alpha, float limit, nanobind::handle out, bool out_bits,
                   bool allow_unverified, std::string_view route,
                   std::optional<std::uint64_t> stream);

  // Each token's top_k experts from the router's logits (FP32 [T, E]) into ids (int32 [T, top_k])
  // and weights (FP32 [T, top_k]): ops::moe_route with scoring "softmax", "topk_softmax" or
  // "sigmoid" (groups, topk_groups and an FP32 bias [E] for DeepSeek's), on the arrays in place.
  void moe_route(nanobind::handle logits, nanobind::handle ids, nanobind::handle weights,
                 std::string_view scoring, std::int32_t top_k, bool renormalize, float scale,
                 std::int32_t groups, std::int32_t topk_groups, nanobind::handle bias,
                 bool allow_unverified, std::optional<std::uint64_t> stream);

  // The ledger's counters: owned apart from borrowed.
  nanobind::dict stats() const;
  // The ledger's live allocations with their call sites.
  std::string alloc_report() const { return probe_ ? probe_->report() : std::string(); }
  // Tears the model down once and reports it (a second call: Error(kState)).
  nanobind::dict teardown();

 private:
  // The backend, or Error(kState) naming api once the model is closed.
  Backend& open(std::string_view api);
  // The model's call lock (one call at a time), taken after open(); Error(kState) naming api
  // when a teardown ran while the call waited for it, destroying the backend open() returned.
  std::unique_lock<std::mutex> lock_open(std::string_view api);
  // Error(kInvalidArgument) unless weights of `label` belong to this model.
  void check_owner(std::string_view api, const Model* owner, const std::string& label,
                   std::string_view name = "w") const;
  // Plans the op of W (ops::plan for its weights and options) for args with the GIL off and
  // the model's lock held, lends the operands, runs the plan on the default stream and waits;
  // or on the caller's stream, giving the operands back in stream order without a wait.
  template <class W, class Options>
  void run_planned(Backend& b, const Operands& args, const W& w, const Options& options,
                   std::optional<std::uint64_t> stream);
  // run_planned's work, for a caller that does not hold the GIL.
  template <class W, class Options>
  void run_planned_unlocked(Backend& b, const Operands& args, const W& w, const Options& options,
                            std::optional<std::uint64_t> stream);
  Operands check_operands(std::string_view api, nanobind::handle a, bool a_bits,
                          nanobind::handle out, bool out_bits, nanobind::handle bias,
                          bool bias_bits, std::int64_t n, std::int64_t k) const;

  std::unique_ptr<ModelScope> scope_;
  std::optional<LedgerProbe> probe_;
  std::string name_, device_, chosen_;
  // Set by the first teardown; read without the GIL by calls from torch's threads.
  std::atomic<bool> closing_{false};
  // One call at a time: two calls lending the same array would overlap their borrows.
  std::mutex call_mu_;
};

}  // namespace metrale::py
