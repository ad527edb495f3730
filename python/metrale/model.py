"""Model: one loaded model on one backend, torn down to zero bytes when it closes."""

from __future__ import annotations

from typing import Any, Optional

import threading

import numpy as np

from . import _metrale
from ._array import Array, as_input, device_of, empty_like_output
from .errors import DtypeError, LeakError, argument_error

_KDL_CUDA = 2


class TeardownReport(dict):
    """What teardown did: clean, released, failures, swept, swept_bytes, leaks, summary."""

    @property
    def clean(self) -> bool:
        """True when every resource gave its memory back and the ledger sweep found nothing."""
        return bool(self["clean"])


class Model:
    """A model on one backend ("auto": CUDA when available, else CPU).

    A context manager: leaving the ``with`` block tears the model down (weights, scratch, every
    allocation) and raises LeakError if anything was left for the ledger sweep. Calls on one
    model run one at a time; the GIL is released while they run and wait.
    """

    def __init__(self, backend: str = "auto") -> None:
        self._m = _metrale._Model(backend)
        self.report: Optional[TeardownReport] = None
        # Two threads closing at once: the second waits for the first's report.
        self._close_lock = threading.Lock()

    # ---- identity ----
    @property
    def backend(self) -> str:
        """"cpu" or "cuda"."""
        return self._m.backend

    @property
    def device(self) -> str:
        """The device's name."""
        return self._m.device

    @property
    def chosen(self) -> str:
        """Why this backend was chosen (with "auto": why not CUDA, on the CPU)."""
        return self._m.chosen

    @property
    def closed(self) -> bool:
        """True once the model is torn down."""
        return self._m.closed

    # ---- lifetime ----
    def __enter__(self) -> "Model":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        # An exception already on its way out wins; the leak check still runs and reports.
        self.close(check=exc_type is None)
        return False

    def close(self, check: bool = True) -> TeardownReport:
        """Tears the model down once (later calls return the same report).

        With check, raises LeakError when the report is not clean: a resource failed to give
        its memory back, or the ledger sweep found allocations nothing owned (named by call site).
        """
        with self._close_lock:
            if self.report is not None:
                return self.report
            self.report = TeardownReport(self._m.teardown())
        if check and not self.report.clean:
            failures = "; ".join(f"{f['label']}: {f['message']}" for f in self.report["failures"])
            raise LeakError(f"[teardown] not clean: {self.report['summary'] or failures}",
                            self.report)
        return self.report

    # ---- weights ----
    def upload_weights(self, weights: Any, scales: Any = None, *, n: Optional[int] = None,
                       k: Optional[int] = None, format: str = "nvfp4",
                       tensor_scale: float = 1.0, source_layout: str = "row_major",
                       layout: str = "auto", label: str = "weights") -> _metrale.Weights:
        """Uploads quantized weights W[N, K]; they live until the model closes.

        ``weights`` is a HostWeights (from quantize_nvfp4, quantize_mxfp4 or a Checkpoint), or
        an array of codes (uint8 [N, K/2], low nibble = even k) with ``scales`` (uint8 [N,
        K/group]); n and k default from the codes' shape. ``layout``: "auto" (the backend's
        preferred; on CUDA only the layout of a kernel a device run verified), "source" (as given), "decode" (the decode kernels' layout) or "panels" (the
        CPU kernels' panel layout).
        """
        if not isinstance(weights, _metrale.HostWeights):
            if scales is None:
                raise argument_error("upload_weights", "scales: needed with an array of codes")
            shape = getattr(weights, "shape", ())
            if n is None or k is None:
                if len(shape) != 2 or source_layout != "row_major":
                    raise argument_error("upload_weights", "n, k: give both unless codes is a "
                                         "row-major [N, K/2] array")
                n, k = int(shape[0]), int(shape[1]) * 2
            weights = _metrale.HostWeights(weights, scales, n=n, k=k, format=format,
                                           tensor_scale=tensor_scale, layout=source_layout)
        return self._m.upload_weights(weights, layout, label)

    def upload_fp8_weights(self, codes: Any, scales: Any, *, label: str = "fp8 weights"
                           ) -> _metrale.Fp8Weights:
        """Uploads E4M3 weights for the W8A8 op: codes uint8 [N, K] (float8_e4m3fn bytes) and
        FP32 scales [ceil(N/128), ceil(K/128)], one per 128 x 128 block (an FP8 checkpoint's
        ``weight`` and ``weight_scale_inv``, or quantize_e4m3_block128's pair)."""
        shape = getattr(codes, "shape", ())
        if len(shape) != 2:
            raise argument_error("upload_fp8_weights", f"codes: shape {tuple(shape)}, expected "
                                 "(N, K)")
        return self._m.upload_fp8_weights(codes, scales, int(shape[0]), int(shape[1]), label)

    def upload_dense_weights(self, w: Any, *, label: str = "dense weights"
                             ) -> _metrale.DenseWeights:
        """Uploads BF16 weights [N, K] as they are (ml_dtypes.bfloat16 NumPy, a torch.bfloat16
        CPU tensor, or a BF16 Array) for the dense GEMM: a checkpoint's BF16 layers
        (metrale.load's ``dense``), run unquantized."""
        obj, bits = as_input("upload_dense_weights", "w", w, None)
        return self._m.upload_dense_weights(obj, bits, label)

    # ---- GEMM ----
    def plan(self, m: int, w: Any, route: str = "auto", allow_e4m3: bool = False,
             bias: bool = False) -> _metrale.Plan:
        """The plan gemm would run for M rows of A: route, kernels, grid, workspace."""
        _check_weights("plan", w)
        if isinstance(w, _metrale.DenseWeights):
            _check_dense_call("plan", route)
            return self._m.plan_dense(m, w, bias)
        if isinstance(w, _metrale.Fp8Weights):
            _check_fp8_call("plan", route, allow_e4m3)
            return self._m.plan_w8a8(m, w, bias)
        return self._m.plan(m, w, route, allow_e4m3, bias)

    def gemm(self, a: Any, w: Any, out: Any = None, route: str = "auto",
             allow_e4m3: bool = False, bias: Any = None, stream: Optional[int] = None) -> Any:
        """C[M, N] = A[M, K] · dequant(W)ᵀ (+ bias), in BF16 with FP32 accumulation.

        ``a`` (and ``out``, ``bias``) are BF16 arrays on the model's device, used in place:
        torch.bfloat16 tensors, ml_dtypes.bfloat16 NumPy arrays, or Arrays metrale returned.
        ``w``: Weights (4-bit), Fp8Weights for the W8A8 op, which casts A to E4M3 per row per
        128 K and so needs ``allow_e4m3=True``, or DenseWeights (BF16) for the backend's dense
        GEMM. Returns ``out`` when given, else a new Array. Returns once the result is written,
        unless ``stream`` is given: a CUDA stream's handle of the model's device (as
        ``torch.cuda.current_stream().cuda_stream`` gives it; 0 is the legacy default stream).
        The GEMM is then queued on that stream, after the work already there, and the call
        returns at once; it may be captured into a CUDA graph there (Note [foreign streams]).
        """
        _check_weights("gemm", w)
        stream = _check_stream("gemm", stream, self._m.device_type == _KDL_CUDA)
        fp8 = isinstance(w, _metrale.Fp8Weights)
        dense = isinstance(w, _metrale.DenseWeights)
        if fp8:
            _check_fp8_call("gemm", route, allow_e4m3)
        if dense:
            _check_dense_call("gemm", route)
        on_gpu = self._m.device_type == _KDL_CUDA and not self._m.closed
        # The DLPack stream the arrays are exported to; 1 names the legacy default stream there.
        export = (stream or 1) if stream is not None else (self._m.stream if on_gpu else None)
        a_obj, a_bits = as_input("gemm", "a", a, export)
        if out is None:
            rows = _rows_of("gemm", "a", a, int(w.k))
            on_cuda = self._m.device_type == _KDL_CUDA and device_of(a)[0] == _KDL_CUDA
            result: Any = Array(empty_like_output("gemm", a, rows, w.n, on_cuda))
            out_obj, out_bits = as_input("gemm", "out", result, export)
        else:
            result = out
            out_obj, out_bits = as_input("gemm", "out", out, export)
        bias_obj, bias_bits = (None, False) if bias is None else as_input("gemm", "bias", bias,
                                                                          export)
        if fp8:
            self._m.w8a8_gemm(a_obj, a_bits, w, out_obj, out_bits, bias_obj, bias_bits, stream)
        elif dense:
            self._m.dense_gemm(a_obj, a_bits, w, out_obj, out_bits, bias_obj, bias_bits, stream)
        else:
            self._m.gemm(a_obj, a_bits, w, out_obj, out_bits, route, allow_e4m3, bias_obj,
                         bias_bits, stream)
        return result

    # ---- mixture of experts ----
    def upload_grouped_weights(self, experts: list, *, bias: Any = None, layout: str = "auto",
                               label: str = "experts") -> _metrale.GroupedWeights:
        """Uploads one MoE projection's experts: a list of HostWeights, one per expert, all of
        one format and shape [N, K] (NVFP4, MXFP4 or INT4; act-ordered INT4 experts in their
        stored K order, which moe_experts gathers x in for gate_up: a down projection's order
        must be folded into gate_up's rows first, take_rows and in_stored_order), as one grouped
        resource; ``bias`` an optional BF16 array [E, N]. They live until the model closes."""
        if not isinstance(experts, (list, tuple)):
            raise argument_error("upload_grouped_weights", f"experts: {type(experts).__name__}, "
                                 "expected a list of HostWeights", DtypeError)
        bias_obj, bias_bits = (None, False) if bias is None else as_input(
            "upload_grouped_weights", "bias", bias, None)
        return self._m.upload_grouped_weights(list(experts), bias_obj, bias_bits, layout, label)

    def upload_grouped_fp8_weights(self, codes: Any, scales: Any, *, bias: Any = None,
                                   layout: str = "auto",
                                   label: str = "experts") -> _metrale.GroupedWeights:
        """Uploads one MoE projection's FP8 block-128 experts for the grouped W8A8 op: codes
        uint8 [E, N, K] (each expert's float8_e4m3fn bytes) and FP32 scales [E, ceil(N/128),
        ceil(K/128)] (each expert's ``weight_scale_inv``), as one grouped resource; ``bias`` an
        optional BF16 array [E, N]; ``layout`` "auto" (the CPU's panel layout where it reads
        them), "source" or "panels". Activations are cast to E4M3 per row per 128 K when they
        run, as the W8A8 op casts them. They live until the model closes."""
        api = "upload_grouped_fp8_weights"
        shape, scale_shape = getattr(codes, "shape", ()), getattr(scales, "shape", ())
        if len(shape) != 3 or len(scale_shape) != 3 or scale_shape[0] != shape[0]:
            raise argument_error(api, f"codes {tuple(shape)} and scales {tuple(scale_shape)}: "
                                 "expected (E, N, K) and (E, ceil(N/128), ceil(K/128))")
        e = int(shape[0])
        bias_obj, bias_bits = (None, False) if bias is None else as_input(api, "bias", bias, None)
        return self._m.upload_grouped_fp8_weights(
            codes.reshape(e * int(shape[1]), int(shape[2])),
            scales.reshape(e * int(scale_shape[1]), int(scale_shape[2])), e, bias_obj, bias_bits,
            layout, label)

    def moe_route(self, logits: Any, top_k: int, *, scoring: str = "softmax",
                  renormalize: bool = False, scale: float = 1.0, groups: int = 1,
                  topk_groups: int = 1, bias: Any = None, allow_unverified: bool = False,
                  stream: Optional[int] = None) -> tuple:
        """Each token's top_k experts from a router's FP32 logits [T, E]: (ids int32 [T, top_k],
        weights float32 [T, top_k]), best first, ties to the lower expert. scoring: "softmax"
        (Qwen3-MoE, Mixtral: over all experts, then the top k; ``renormalize`` divides by their
        sum), "topk_softmax" (gpt-oss: the top k logits, then a softmax over them) or "sigmoid"
        (DeepSeek-V3: chosen by score + ``bias`` within the ``topk_groups`` best of ``groups``,
        weighted by the scores, renormalized when asked, times ``scale``). On the model's
        device: NumPy on the CPU backend, torch CUDA tensors on CUDA (given back as torch)."""
        api = "moe_route"
        # Checked before the outputs are sized from it (the op's rule: 1..32).
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= 32:
            raise argument_error(api, f"top_k = {top_k!r} is outside [1, 32]")
        stream = _check_stream(api, stream, self._m.device_type == _KDL_CUDA)
        on_gpu = self._m.device_type == _KDL_CUDA and not self._m.closed
        export = (stream or 1) if stream is not None else (self._m.stream if on_gpu else None)
        rows = _rows_of(api, "logits", logits)
        if on_gpu and device_of(logits)[0] == _KDL_CUDA:
            if not type(logits).__module__.startswith("torch"):
                raise argument_error(api, f"logits: a {type(logits).__name__} on a GPU; give a "
                                     "torch tensor (the outputs are made with torch)",
                                     DtypeError)
            import torch

            ids = torch.empty((rows, top_k), dtype=torch.int32, device=logits.device)
            weights = torch.empty((rows, top_k), dtype=torch.float32, device=logits.device)
        else:
            ids = np.empty((rows, top_k), dtype=np.int32)
            weights = np.empty((rows, top_k), dtype=np.float32)
        objs = [as_input(api, name, a, export)[0] for name, a in
                (("logits", logits), ("ids", ids), ("weights", weights))]
        bias_obj = None if bias is None else as_input(api, "bias", bias, export)[0]
        self._m.moe_route(*objs, scoring, int(top_k), bool(renormalize), float(scale),
                          int(groups), int(topk_groups), bias_obj, allow_unverified, stream)
        return ids, weights

    def moe_experts(self, x: Any, ids: Any, weights: Any, gate_up: Any, down: Any, *,
                    glu: str = "silu", alpha: float = 1.702, limit: float = 7.0, out: Any = None,
                    allow_unverified: bool = False, route: str = "auto",
                    stream: Optional[int] = None) -> Any:
        """An MoE layer's experts on routed tokens: out[t] = Σ_j weights[t, j] ·
        down_e(glu(gate_up_e(x[t]))) with e = ids[t, j], in one call (moe_align, moe_gather,
        the two grouped GEMMs, the activation, moe_combine; docs/CONTRACT.md, MoE routing).

        x BF16 [T, H]; ids int32 [T, top_k] (an id outside [0, E) contributes nothing);
        weights float32 [T, top_k]; gate_up and down GroupedWeights of [2I, H] and [H, I] per
        expert. glu: "silu" (rows [gate | up]: SiLU(gate) · up) or "clamped_swiglu" (gpt-oss:
        gate and up interleaved, clamps at ``limit``, gate · σ(alpha · gate) · (up + 1)).
        allow_unverified: run kernels no device run has verified (CUDA's, today). route: the
        grouped GEMMs' route, "auto" (the backend's verified choice), "decode", "fused" (4-bit
        experts in the decode layout) or "tiled" (FP8 experts on CUDA sm_90a); an unverified
        one also needs allow_unverified. Returns ``out`` (BF16 [T, H]) when given, else a new
        Array; ``stream`` as for gemm.
        """
        api = "moe_experts"
        for name, w in (("gate_up", gate_up), ("down", down)):
            if not isinstance(w, _metrale.GroupedWeights):
                raise argument_error(api, f"{name}: {type(w).__name__} is not GroupedWeights "
                                     "(model.upload_grouped_weights)", DtypeError)
        stream = _check_stream(api, stream, self._m.device_type == _KDL_CUDA)
        on_gpu = self._m.device_type == _KDL_CUDA and not self._m.closed
        export = (stream or 1) if stream is not None else (self._m.stream if on_gpu else None)
        x_obj, x_bits = as_input(api, "x", x, export)
        if out is None:
            rows = _rows_of(api, "x", x, int(gate_up.k))
            on_cuda = on_gpu and device_of(x)[0] == _KDL_CUDA
            result: Any = Array(empty_like_output(api, x, rows, down.n, on_cuda))
        else:
            result = out
        out_obj, out_bits = as_input(api, "out", result, export)
        ids_obj, _ = as_input(api, "ids", ids, export)
        w_obj, _ = as_input(api, "weights", weights, export)
        self._m.moe_experts(x_obj, x_bits, ids_obj, w_obj, gate_up, down, glu, alpha, limit,
                            out_obj, out_bits, allow_unverified, route, stream)
        return result

    # ---- figures ----
    def stats(self) -> dict:
        """The ledger's figures: owned_bytes (metrale's own memory) apart from borrowed_bytes
        (callers' arrays lent for a call), peaks and counts."""
        return self._m.stats()

    def alloc_report(self) -> str:
        """The ledger's live allocations, largest first, each with its call site."""
        return self._m.alloc_report()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"metrale.Model(backend={self.backend!r}, device={self.device!r}, {state})"


def _rows_of(api: str, name: str, x: Any, cols: Optional[int] = None) -> int:
    """The rows of matrix argument x, checked (as a matrix of ``cols`` columns, when given)
    before an output is sized from them: a 1-D x of 2e6 elements sized an output of 2e6 rows,
    15.6 GiB, before the call refused it. 0 for an object with no shape: the call's own check
    names it."""
    if not hasattr(x, "shape"):
        return 0
    shape = tuple(int(d) for d in x.shape)
    if len(shape) != 2:
        raise argument_error(api, f"{name}: shape {shape} has {len(shape)} dimension(s), "
                             "expected 2")
    if shape[1] < 1:
        raise argument_error(api, f"{name}: shape {shape}, expected at least one column")
    if cols is not None and shape[1] != cols:
        raise argument_error(api, f"{name}: shape {shape}, expected (*, {cols})")
    return shape[0]


def _check_stream(api: str, stream: Any, on_cuda: bool) -> Optional[int]:
    """The caller's stream handle as the extension takes it, or None."""
    if stream is None:
        return None
    if isinstance(stream, bool) or not isinstance(stream, int) or not 0 <= stream < 2**64:
        raise argument_error(api, f"stream: {stream!r} is not a CUDA stream handle (an int, as "
                             "torch.cuda.Stream.cuda_stream gives it)")
    if not on_cuda:
        raise argument_error(api, f"stream: 0x{stream:x} given to a model that does not run on "
                             "CUDA (only a CUDA model queues work on a caller's stream)")
    return stream


def _check_weights(api: str, w: Any) -> None:
    if not isinstance(w, (_metrale.Weights, _metrale.Fp8Weights, _metrale.DenseWeights)):
        hint = " (upload it first: model.upload_weights)" if isinstance(
            w, _metrale.HostWeights) else ""
        raise argument_error(api, f"w: {type(w).__name__} is not weights on a device{hint}",
                             DtypeError)


def _check_dense_call(api: str, route: str) -> None:
    if route != "auto":
        raise argument_error(api, f"route: '{route}' given for BF16 weights, which run the "
                             "backend's dense GEMM alone (route 'auto')")


def _check_fp8_call(api: str, route: str, allow_e4m3: bool) -> None:
    if route != "auto":
        raise argument_error(api, f"route: '{route}' given for FP8 weights, which run the W8A8 "
                             "op alone (route 'auto')")
    if not allow_e4m3:
        raise argument_error(api, "w: FP8 weights run the W8A8 op, which casts A to E4M3; pass "
                             "allow_e4m3=True")


def as_float32(api: str, w: Any) -> np.ndarray:
    """A host float32 copy-free view where possible (NumPy, torch CPU tensors) of weights."""
    if hasattr(w, "detach"):  # torch: any dtype, any device
        w = w.detach().to("cpu").float().numpy()
    try:
        return np.ascontiguousarray(w, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise argument_error(api, f"w: cannot be read as float32 ({e})") from None
