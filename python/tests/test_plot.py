"""Tests of `metrale plot`: the roofline PNG of `metrale bench --json` documents."""

import copy
import json
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from metrale import plot  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# The llama3-8b shapes `metrale bench` uses by default, (layer, N, K).
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]


def _entry(layer: str, m: int, n: int, k: int, bw: float, tflops: float) -> dict:
    """One layer entry as the bench writes it, with rates consistent with its time."""
    moved = n * k * 0.5625 + 2 * m * (n + k)  # 4-bit codes + scales, fp16 activations
    ms = moved / (0.8 * bw * 1e9) * 1e3 * (1 + m / 8)
    gbps = moved / (ms * 1e-3) / 1e9
    achieved = 2 * m * n * k / (ms * 1e-3) / 1e12
    return {"layer": layer, "variant": "auto", "M": m, "N": n, "K": k,
            "route": "decode" if m <= 8 else "gemm", "plan": "tile 64x128", "ms": ms,
            "GBps": gbps, "TFLOPs": achieved, "pct_bandwidth": 100 * gbps / bw,
            "pct_flops": 100 * achieved / tflops if tflops else 0.0, "error": 1.3e-3}


@pytest.fixture
def bench_doc() -> dict:
    """A document shaped like `metrale bench --backend cpu --m 1,16 --json` prints."""
    bw, tflops = 23.4, 0.41
    layers = [_entry(name, m, n, k, bw, tflops) for m in (1, 16) for name, n, k in SHAPES]
    routes = [dict(e, variant="scalar", route="scalar") for e in layers[:2]]
    return {
        "backend": "cpu", "device": "AMD EPYC 7B13 64-Core Processor (2 threads)",
        "chosen": "--backend cpu", "model": "llama3-8b", "graph": False,
        "timing": "median of 2 repeats", "allow_e4m3": False,
        "roofline": {"bandwidth_GBps": bw, "bandwidth_of": "multi-threaded read of 512 MiB",
                     "TFLOPs": tflops, "flops_of": "FMA loop on 2 threads"},
        "layers": layers, "routes": routes,
        "blocks": [{"M": 1, "ms": 5.0, "blocks": 32, "tokens_per_s": 6.25},
                   {"M": 16, "ms": 12.0, "blocks": 32, "tokens_per_s": 41.7}],
        "passed": True,
    }


def _write(path, doc) -> str:
    path.write_text(json.dumps(doc))
    return str(path)


def _check_png(path, dpi: int = 120) -> None:
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    image = mpimg.imread(path)
    height, width, channels = image.shape
    assert channels in (3, 4)
    # The figure is 13 inches wide; a roofline and its table make it taller than half that.
    assert width == pytest.approx(13 * dpi, abs=2)
    assert height > 0.5 * width
    assert image[..., :3].std() > 0.05  # something was drawn, not a blank page


def _rooflines(fig) -> list:
    return [ax for ax in fig.axes if ax.get_label() == "roofline"]


def test_main_writes_png(tmp_path, bench_doc, capsys):
    source = _write(tmp_path / "bench.json", bench_doc)
    out = tmp_path / "roofline.png"
    assert plot.main([source, "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    _check_png(out)


def test_dpi_option(tmp_path, bench_doc):
    source = _write(tmp_path / "bench.json", bench_doc)
    out = tmp_path / "small.png"
    assert plot.main([source, "--output", str(out), "--dpi", "60"]) == 0
    _check_png(out, dpi=60)


def test_points_at_counted_intensity(bench_doc):
    """Each layer entry is one point at (2MNK / bytes counted, achieved TFLOP/s)."""
    fig = plot._figure([bench_doc])
    try:
        (ax,) = _rooflines(fig)
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        drawn = sorted(tuple(xy) for c in ax.collections for xy in c.get_offsets())
        expected = sorted(
            (2 * e["M"] * e["N"] * e["K"] / (e["GBps"] * 1e9 * e["ms"] * 1e-3), e["TFLOPs"])
            for e in bench_doc["layers"])
        assert len(drawn) == len(expected) == 8
        for (x, y), (ex, ey) in zip(drawn, expected):
            assert x == pytest.approx(ex) and y == pytest.approx(ey)
        # Every point lies inside the axes.
        (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
        assert all(x0 < x < x1 and y0 < y < y1 for x, y in drawn)
    finally:
        plt.close(fig)


def test_table_columns_and_error_format(bench_doc):
    bench_doc["layers"][1]["error"] = None  # the bench writes null for a NaN error
    fig = plot._figure([bench_doc])
    try:
        (table_ax,) = [ax for ax in fig.axes if ax.get_label() == "table"]
        cells = table_ax.tables[0].get_celld()
        header = [cells[0, c].get_text().get_text() for c in range(11)]
        assert header == ["layer", "M", "N", "K", "route", "ms", "GB/s", "TFLOP/s",
                          "% bandwidth", "% FLOPs", "error"]
        assert len({r for r, _ in cells}) == 1 + len(bench_doc["layers"])
        assert cells[1, 10].get_text().get_text() == "1.30e-03"
        assert cells[2, 10].get_text().get_text() == "n/a"
    finally:
        plt.close(fig)


def test_null_rate_stays_in_table(tmp_path, bench_doc):
    """A NaN time or rate (written as null) is left off the plot, said so, and shown as n/a."""
    bench_doc["layers"][0].update(ms=None, GBps=None, TFLOPs=None, pct_bandwidth=None)
    fig = plot._figure([bench_doc])
    try:
        (ax,) = _rooflines(fig)
        assert sum(len(c.get_offsets()) for c in ax.collections) == len(bench_doc["layers"]) - 1
        assert "not drawn: 1 with no rate" in [t.get_text() for t in ax.get_legend().get_texts()]
        (table_ax,) = [a for a in fig.axes if a.get_label() == "table"]
        assert table_ax.tables[0].get_celld()[1, 5].get_text().get_text() == "n/a"
    finally:
        plt.close(fig)


def test_no_compute_roof(tmp_path, bench_doc):
    bench_doc["roofline"]["TFLOPs"] = 0.0
    for e in bench_doc["layers"]:
        e["pct_flops"] = 0.0
    fig = plot._figure([bench_doc])
    try:
        (ax,) = _rooflines(fig)
        assert "bandwidth roof only" in ax.get_title()
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "compute roof: not measured" in legend
    finally:
        plt.close(fig)
    out = tmp_path / "bw_only.png"
    plot.plot_bench(bench_doc, str(out))
    _check_png(out)


def test_two_docs_two_subplots(tmp_path, bench_doc, capsys):
    gpu = copy.deepcopy(bench_doc)
    gpu.update(backend="cuda", device="NVIDIA H200")
    gpu["roofline"].update(bandwidth_GBps=4200.0, TFLOPs=0.0)
    fig = plot._figure([bench_doc, gpu])
    try:
        titles = [ax.get_title() for ax in _rooflines(fig)]
        assert len(titles) == 2
        assert "cpu" in titles[0] and "AMD EPYC" in titles[0]
        assert "cuda" in titles[1] and "NVIDIA H200" in titles[1]
    finally:
        plt.close(fig)

    out = tmp_path / "both.png"
    files = [_write(tmp_path / "cpu.json", bench_doc), _write(tmp_path / "gpu.json", gpu)]
    assert plot.main(files + ["-o", str(out)]) == 0
    _check_png(out)
    height, width, _ = mpimg.imread(out).shape
    assert height > width  # two stacked rooflines with their tables


def _bad_file(tmp_path, doc: dict, case: str) -> tuple[str, str]:
    """The file for one bad input case, and text its error line must contain."""
    if case == "missing":
        return str(tmp_path / "missing.json"), "No such file"
    if case == "broken":
        broken = tmp_path / "broken.json"
        broken.write_text('{"backend": "cpu", "layers": [')
        return str(broken), "invalid JSON"
    if case in ("no_layers", "no_roofline"):
        key = case[3:]
        without = {k: v for k, v in doc.items() if k != key}
        return _write(tmp_path / f"{case}.json", without), f'"{key}"'
    assert case == "list"
    return _write(tmp_path / "list.json", [doc]), "not a JSON object"


@pytest.mark.parametrize("case", ["missing", "broken", "no_layers", "no_roofline", "list"])
def test_bad_input(tmp_path, bench_doc, capsys, case):
    path, reason = _bad_file(tmp_path, bench_doc, case)
    good = _write(tmp_path / "good.json", bench_doc)
    out = tmp_path / "out.png"
    # The bad file comes second: the good one before it must not be plotted either.
    assert plot.main([good, path, "-o", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"metrale plot: {path}: ")
    assert reason in lines[0]
    assert not out.exists()


def test_missing_output_option(tmp_path, bench_doc, capsys):
    assert plot.main([_write(tmp_path / "bench.json", bench_doc)]) == 2
    assert "--output" in capsys.readouterr().err


def test_plot_bench_rejects_bad_document(tmp_path, bench_doc):
    del bench_doc["layers"][0]["ms"]
    with pytest.raises(ValueError, match=r"layers\[0\] lacks ms"):
        plot.plot_bench(bench_doc, str(tmp_path / "x.png"))
    bench_doc["layers"][0]["ms"] = 1.0
    bench_doc["layers"][1]["N"] = "4096"
    with pytest.raises(ValueError, match=r"layers\[1\] N is not a number"):
        plot.plot_bench([bench_doc], str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()


def test_imports_alone():
    """The module needs nothing of the package (no compiled extension) to import and plot."""
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('plot', {plot.__file__!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "assert not [n for n in sys.modules if n.startswith('metrale')]; "
            "assert 'matplotlib.pyplot' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
