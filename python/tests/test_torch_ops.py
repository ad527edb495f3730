"""metrale.torch: the custom op against the float64 reference, torch.library.opcheck,
torch.compile(fullgraph=True) without a graph break, ownership and bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REQUIRED, check_gemm, need

import metrale

torch = need("torch")
mt = need("metrale.torch")


def _weights(rng, n, k, fmt="nvfp4"):
    w = rng.standard_normal((n, k)).astype(np.float32)
    return metrale.quantize_nvfp4(w) if fmt == "nvfp4" else metrale.quantize_mxfp4(w)


def _bf16(rng, *shape):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(torch.bfloat16)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 3)])
def test_linear_matches_the_float64_reference(rng, model, fmt, lead):
    host = _weights(rng, 96, 256, fmt)
    bias = _bf16(rng, 96)
    layer = mt.Linear(model, model.upload_weights(host), bias)
    x = _bf16(rng, *lead, 256)
    y = layer(x)
    assert y.shape == (*lead, 96) and y.dtype == torch.bfloat16
    check_gemm(y.reshape(-1, 96).float().numpy(), x.reshape(-1, 256).double().numpy(), host,
               bias.double().numpy())
    # Any float input: cast to BF16 for the GEMM, the output cast back.
    y32 = layer(x.float())
    assert y32.dtype == torch.float32
    assert torch.equal(y32, y.float())


def test_opcheck(rng, model):
    host = _weights(rng, 64, 128)
    handle = mt.register(model, model.upload_weights(host))
    op = torch.ops.metrale.linear.default
    for x, bias in [(_bf16(rng, 4, 128), None), (_bf16(rng, 2, 3, 128), _bf16(rng, 64)),
                    (_bf16(rng, 0, 128), None)]:
        torch.library.opcheck(op, (x, handle, bias))


def test_opcheck_catches_a_wrong_fake_shape(rng, model):
    """The check above is live: a fake implementation that lies about N fails it."""
    host = _weights(rng, 64, 128)
    handle = mt.register(model, model.upload_weights(host))
    torch.library.register_fake("metrale::linear",
                                lambda x, weights, bias=None: x.new_empty((*x.shape[:-1], 65)))
    try:
        with pytest.raises(Exception, match="test_faketensor"):
            torch.library.opcheck(torch.ops.metrale.linear.default,
                                  (_bf16(rng, 4, 128), handle, None))
    finally:
        torch.library.register_fake("metrale::linear", mt._linear_fake)


class _Mlp(torch.nn.Module):
    def __init__(self, model, rng):
        super().__init__()
        self.up = mt.Linear(model, model.upload_weights(_weights(rng, 128, 64)), _bf16(rng, 128))
        self.down = mt.Linear(model, model.upload_weights(_weights(rng, 64, 128, "mxfp4")))

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.up(x))) + x


def test_compile_fullgraph_traces_without_a_graph_break(rng, model):
    mlp = _Mlp(model, rng)
    x = _bf16(rng, 3, 64)
    eager = mlp(x)
    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), eager)
    # A new M reuses the graph (dynamic rows) or retraces; either way no break and the same
    # result.
    x2 = _bf16(rng, 7, 64)
    assert torch.equal(compiled(x2), mlp(x2))
    explained = torch._dynamo.explain(mlp)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    # The ops are in the graph, not run around it.
    graph = explained.graphs[0]
    calls = [n for n in graph.graph.nodes if "metrale" in str(n.target)]
    assert len(calls) == 2, graph.code


def test_compile_check_is_live(rng, model):
    """The same fullgraph compile of the plain API (Model.gemm in forward), the failure the op
    exists for, is refused: the check above can fail."""
    w = model.upload_weights(_weights(rng, 64, 64))

    class Plain(torch.nn.Module):
        def forward(self, x):
            return torch.from_dlpack(model.gemm(x, w))

    x = _bf16(rng, 2, 64)
    assert Plain()(x).shape == (2, 64)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(Plain(), fullgraph=True, backend="aot_eager")(x)


def test_compile_with_inductor(rng, model):
    mlp = _Mlp(model, rng)
    x = _bf16(rng, 5, 64)
    compiled = torch.compile(mlp, fullgraph=True)
    # Inductor may fuse the SiLU and the residual add in FP32 where eager rounds each to BF16:
    # torch's own BF16 tolerances, not ours.
    torch.testing.assert_close(compiled(x), mlp(x))


def test_weights_belong_to_the_model(rng):
    model = metrale.Model("cpu")
    host = _weights(rng, 64, 128)
    before = model.stats()["owned_bytes"]
    layer = mt.Linear(model, model.upload_weights(host))
    assert model.stats()["owned_bytes"] >= before + host.n * host.k // 2
    layer(_bf16(rng, 2, 128))
    assert model.close().clean
    with pytest.raises(metrale.StateError):
        layer(_bf16(rng, 2, 128))


def test_bad_inputs_name_the_call(rng, model):
    host = _weights(rng, 64, 128)
    handle = mt.register(model, model.upload_weights(host))
    op = torch.ops.metrale.linear
    with pytest.raises(metrale.DtypeError, match=r"metrale.torch.linear.*x: dtype torch.float32"):
        op(torch.zeros(2, 128), handle, None)
    with pytest.raises(metrale.InvalidArgumentError, match=r"x: shape \(2, 64\), expected"):
        op(torch.zeros(2, 64, dtype=torch.bfloat16), handle, None)
    with pytest.raises(metrale.InvalidArgumentError, match=r"weights: 0 is not a registered"):
        op(torch.zeros(2, 128, dtype=torch.bfloat16), 0, None)
    with pytest.raises(metrale.InvalidArgumentError, match=r"bias"):
        op(torch.zeros(2, 128, dtype=torch.bfloat16), handle, torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(metrale.DtypeError, match=r"metrale.torch.register"):
        mt.register(model, host)


def test_fp8_weights_run_the_w8a8_op(rng, model):
    codes, scales = metrale.quantize_e4m3_block128(rng.standard_normal((96, 256)))
    w = model.upload_fp8_weights(codes, scales)
    with pytest.raises(metrale.InvalidArgumentError, match="allow_e4m3=True"):
        mt.Linear(model, w)
    layer = mt.Linear(model, w, allow_e4m3=True)
    x = _bf16(rng, 3, 256)
    expected = torch.from_dlpack(model.gemm(x, w, allow_e4m3=True))
    assert torch.equal(layer(x), expected)


def test_swap_linears_and_timing(rng, model):
    torch.manual_seed(int(rng.integers(2**31)))
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.SiLU(), torch.nn.Linear(128, 64))
    holder = torch.nn.Module()
    holder.body, holder.lm_head = net, torch.nn.Linear(64, 32)
    x = _bf16(rng, 3, 64)
    assert mt.swap_linears(holder, model) == 2
    assert isinstance(net[0], mt.Linear) and isinstance(net[2], mt.Linear)
    assert type(holder.lm_head) is torch.nn.Linear  # skipped by name
    with mt.timing() as t:
        net(x)
    assert t["calls"] == 2 and t["seconds"] > 0
    net(x)
    assert t["calls"] == 2  # counted only inside the block


def test_nested_timing_blocks_count_for_themselves(rng, model):
    layer = mt.Linear(model, model.upload_weights(_weights(rng, 64, 128)))
    x = _bf16(rng, 2, 128)
    with mt.timing() as outer:
        layer(x)
        with mt.timing() as inner:
            layer(x)
            layer(x)
        layer(x)
    assert (outer["calls"], inner["calls"]) == (2, 2)
    assert outer["seconds"] > 0 and inner["seconds"] > 0


def test_no_backward_through_the_op(rng, model):
    """Inference only: a forward on inputs that need gradients runs, its backward raises (the
    C++ operator through torch's not-implemented autograd fallback, the Python one as a custom
    op without a backward)."""
    layer = mt.Linear(model, model.upload_weights(_weights(rng, 64, 128)))
    x = _bf16(rng, 2, 128).requires_grad_()
    y = layer(x)
    assert y.requires_grad
    with pytest.raises(RuntimeError):
        y.float().sum().backward()


def test_torch_views_whose_memory_holds_other_values_are_refused(rng, model):
    """A lazily negated view exports its memory as it lies (nanobind falls back to torch's
    to_dlpack when the tensor's own __dlpack__ refuses it): Model.gemm returned -ref for it, and
    wrote an out that needs gradients outside autograd."""
    w = model.upload_weights(_weights(rng, 64, 128))
    x = _bf16(rng, 3, 128)
    with pytest.raises(metrale.InvalidArgumentError, match="a: a torch view with its negative"):
        model.gemm((-x)._neg_view(), w)
    out = torch.zeros((3, 64), dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(metrale.InvalidArgumentError, match="out: requires grad"):
        model.gemm(x, w, out=out)
    # Resolved, the same view is x's values: the same bits as x itself.
    got = torch.from_dlpack(model.gemm((-x)._neg_view().resolve_neg(), w))
    assert torch.equal(got, torch.from_dlpack(model.gemm(x, w)))


_RELOADED = """
import importlib, numpy as np, torch, metrale, metrale.torch as mt, metrale.torch_moe as mm
rng = np.random.default_rng()
with metrale.Model("cpu") as model:
    w1, w2 = (model.upload_weights(metrale.quantize_nvfp4(rng.standard_normal((64, 128))))
              for _ in range(2))
    old = mt.Linear(model, w1)
    x = torch.from_numpy(rng.standard_normal((2, 128))).to(torch.bfloat16)
    before = old(x)
    importlib.reload(mm)
    mt = importlib.reload(mt)
    new = mt.Linear(model, w2)
    assert new.handle != old.handle, (new.handle, old.handle)
    assert torch.equal(old(x), before), "the old layer ran other weights"
    assert not torch.equal(new(x), before)
    del old, new
print("ok")
"""


def test_reloading_the_module_keeps_handles_unique():
    """importlib.reload(metrale.torch) restarted the handle counter: a new layer got an old
    layer's handle, and the old layer then ran the new one's weights."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _RELOADED], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_the_cpp_operator_is_in_use():
    """Where the test run requires torch (scripts/python-test.sh, CI), the C++ operator must have
    been built: a silent fallback to the Python one would hide a broken build."""
    built, why = mt.native()
    if not built and "torch" not in REQUIRED:
        pytest.skip(f"the C++ operator is not in use: {why}")
    assert built, why


_SAME_CALLS = """
import hashlib, numpy as np, torch, metrale, metrale.torch as mt
rng = np.random.default_rng(SEED)
with metrale.Model("cpu") as model:
    w = model.upload_weights(metrale.quantize_nvfp4(rng.standard_normal((96, 128))))
    layer = mt.Linear(model, w, torch.from_numpy(rng.standard_normal(96)).to(torch.bfloat16))
    x = torch.from_numpy(rng.standard_normal((3, 5, 128))).to(torch.bfloat16)
    h = hashlib.sha256(layer(x).view(torch.int16).numpy().tobytes())
    h.update(layer(x.float()).numpy().tobytes())
    for bad in (x.float(), x[..., :64]):
        try:
            torch.ops.metrale.linear(bad, layer.handle)
        except metrale.Error as e:
            h.update(f"{type(e).__name__}: {e}".encode())
    # Contiguous 2 bytes past a 16-byte boundary: both operators take a copy (the Python one
    # refused it), and a bias view there is copied once by Linear (every call refused it).
    odd = torch.from_numpy(rng.standard_normal(15 * 128 + 1)).to(torch.bfloat16)[1:]
    h.update(layer(odd.view(15, 128)).view(torch.int16).numpy().tobytes())
    odd_bias = torch.from_numpy(rng.standard_normal(97)).to(torch.bfloat16)[1:]
    h.update(mt.Linear(model, w, odd_bias)(x).view(torch.int16).numpy().tobytes())
    model.close()
    try:
        layer(x)
    except metrale.StateError as e:
        h.update(str(e).encode())
    print(mt.native()[0], h.hexdigest())
"""


def test_both_operators_compute_and_fail_alike(rng):
    """The C++ operator (this process) and the Python one (METRALE_TORCH_NATIVE=0) on the same
    calls: outputs bit for bit, and the same errors for a bad dtype, a bad shape and a closed
    model."""
    import os
    import subprocess
    import sys

    code = _SAME_CALLS.replace("SEED", str(int(rng.integers(2**31))))
    runs = {}
    for native in ("1", "0"):
        env = dict(os.environ, METRALE_TORCH_NATIVE=native)
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        runs[native] = done.stdout.split()
    if runs["1"][0] != "True" and "torch" not in REQUIRED:
        pytest.skip("the C++ operator is not in use here")
    assert runs["1"][0] == "True" and runs["0"][0] == "False"
    assert runs["1"][1] == runs["0"][1]


@pytest.mark.parametrize("m,n,k", [(1, 512, 1024), (64, 384, 512)])
def test_torch_threads_and_metrale_pool_agree(rng, model, m, n, k):
    """metrale's kernel blocks on torch's intra-op threads (the default with the C++ operator)
    give the same bits as on metrale's own pool: every block ran, once."""
    if not mt.native()[0]:
        pytest.skip("the C++ operator is not in use: no threads to share")
    layer = mt.Linear(model, model.upload_weights(_weights(rng, n, k)))
    x = _bf16(rng, m, k)
    try:
        assert mt.share_threads(False) is False
        own = layer(x)
        assert mt.share_threads(True) is True
        shared = layer(x)
    finally:
        mt.share_threads(True)
    assert torch.equal(own, shared)
