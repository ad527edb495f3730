"""Roofline plot of `metrale bench --json` documents.

`python -m metrale plot bench.json [more.json ...] -o roofline.png` draws, for each document,
the measured roofs with one point per benched layer and M, and under it the bench table.

This module imports only matplotlib (and the standard library) so that it works without the
compiled extension, e.g. on a laptop plotting a document copied from a GPU host.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

# The fields of a layer entry the plot and the table read; a document missing one is refused up
# front rather than failing half-way through drawing.
_LAYER_FIELDS = ("layer", "M", "N", "K", "route", "ms", "GBps", "TFLOPs", "pct_bandwidth",
                 "pct_flops", "error")
_TABLE_COLUMNS = ("layer", "M", "N", "K", "route", "ms", "GB/s", "TFLOP/s", "% bandwidth",
                  "% FLOPs", "error")
# One marker per M, in the order the Ms first appear; colours come from the tab10 cycle.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _float(value: Any) -> float:
    """`value` as a float, NaN for null."""
    return float(value) if _is_number(value) else math.nan


def _problem(doc: Any) -> str | None:
    """What makes `doc` unplottable, or None when it is a usable bench document."""
    if not isinstance(doc, dict):
        return "not a JSON object"
    roof = doc.get("roofline")
    if not isinstance(roof, dict):
        return 'no "roofline" object'
    for key in ("bandwidth_GBps", "TFLOPs"):
        if not _is_number(roof.get(key)):
            return f'"roofline" has no number "{key}"'
    if not roof["bandwidth_GBps"] > 0:
        return '"roofline" bandwidth_GBps is not positive'
    layers = doc.get("layers")
    if not isinstance(layers, list) or not layers:
        return 'no "layers" list (or it is empty)'
    for i, entry in enumerate(layers):
        if not isinstance(entry, dict):
            return f"layers[{i}] is not an object"
        missing = [f for f in _LAYER_FIELDS if f not in entry]
        if missing:
            return f"layers[{i}] lacks {', '.join(missing)}"
        # The shape must be numbers; the measured fields may also be null (the bench writes a
        # NaN as null), which the table shows as n/a and the plot leaves out.
        for f in _LAYER_FIELDS[1:4]:
            if not _is_number(entry[f]):
                return f"layers[{i}] {f} is not a number"
        for f in _LAYER_FIELDS[5:]:
            if entry[f] is not None and not _is_number(entry[f]):
                return f"layers[{i}] {f} is not a number"
    return None


def _intensity(entry: dict) -> float:
    """FLOP per byte moved, from the bytes the bench itself counted (GB/s times time).

    Deriving the bytes from the measured rate keeps the plot in step with whatever the bench
    counts (weights, scales, activations) instead of re-modelling the format here.
    """
    flops = 2.0 * entry["M"] * entry["N"] * entry["K"]
    moved = _float(entry["GBps"]) * 1e9 * _float(entry["ms"]) * 1e-3
    return flops / moved if moved > 0 else math.nan


def _fmt(value: Any, spec: str) -> str:
    """`value` formatted with `spec`, or "n/a" where the bench wrote null (e.g. a NaN error)."""
    if _is_number(value) and math.isfinite(value):
        return format(value, spec)
    return "n/a"


def _title(doc: dict) -> str:
    roof = doc["roofline"]
    title = f"{doc.get('backend', '?')}: {doc.get('device', '?')}"
    if doc.get("model"):
        title += f" - {doc['model']}"
    if roof["TFLOPs"] <= 0:
        title += "\nno compute roof measured: bandwidth roof only"
    return title


def _draw_roofline(ax: Any, doc: dict, colours: dict[str, Any], markers: dict[int, str]) -> None:
    """Roofs and one point per layer entry on log-log axes of intensity against TFLOP/s."""
    from matplotlib.lines import Line2D

    roof = doc["roofline"]
    bw = roof["bandwidth_GBps"] * 1e9  # bytes/s
    peak = roof["TFLOPs"]  # 0 where no compute roof was measured
    ridge = peak * 1e12 / bw if peak > 0 else None

    def roof_at(x: float) -> float:
        return min(bw * x / 1e12, peak) if peak > 0 else bw * x / 1e12

    points = [(e, _intensity(e)) for e in doc["layers"]]
    # Log axes cannot show a zero or null rate; such entries stay in the table only.
    shown = [(e, x) for e, x in points if x > 0 and _float(e["TFLOPs"]) > 0]
    xs = [x for _, x in shown]

    # The x range covers every point and the ridge, with a factor of 4 of margin each side.
    span = xs + ([ridge] if ridge else [])
    lo, hi = (min(span) / 4, max(span) * 4) if span else (0.1, 1000.0)
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [roof_at(x) for x in grid], color="black", lw=1.8, zorder=2)
    if ridge:
        ax.axvline(ridge, color="grey", ls=":", lw=1)
    # At one M the layers land at nearly the same intensity and rate, so a point would hide the
    # others: each layer is drawn one size smaller than the one before and on top of it, which
    # leaves every colour visible as a ring.
    order = {name: i for i, name in enumerate(dict.fromkeys(e["layer"] for e in doc["layers"]))}
    for entry, x in shown:
        rank = order[entry["layer"]]
        ax.scatter(x, entry["TFLOPs"], color=colours[entry["layer"]],
                   marker=markers[entry["M"]], s=max(200 * 0.7 ** rank, 20),
                   edgecolors="black", linewidths=0.6, zorder=3 + rank)

    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    # The y range holds the points and the roof above each of them, not the roof at the ends of
    # the x range: on a fast GPU with no compute roof that would squash the points to a line.
    ys = [e["TFLOPs"] for e, _ in shown] + [roof_at(x) for x in xs]
    if peak > 0:
        ys.append(peak)
    if not xs:
        ys += [roof_at(lo), roof_at(hi)]
    ax.set_ylim(min(ys) / 4, max(ys) * 3)
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(_title(doc), fontsize=11)
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", alpha=0.1)

    # Legend outside the axes, on the right, so it never covers points: the roofs, then the
    # layers by colour, then the Ms by marker.
    handles = [Line2D([], [], color="black", lw=1.8,
                      label=f"memory roof: {roof['bandwidth_GBps']:.1f} GB/s")]
    if peak > 0:
        handles += [Line2D([], [], color="black", lw=1.8,
                           label=f"compute roof: {peak:.3g} TFLOP/s"),
                    Line2D([], [], color="grey", ls=":", label=f"ridge: {ridge:.3g} FLOP/B")]
    else:
        handles.append(Line2D([], [], ls="", label="compute roof: not measured"))
    layers_here = list(order)
    ms_here = list(dict.fromkeys(e["M"] for e in doc["layers"]))
    handles += [Line2D([], [], ls="", marker="s", ms=8, color=colours[name], label=name)
                for name in layers_here]
    handles += [Line2D([], [], ls="", marker=markers[m], ms=7, color="white",
                       markeredgecolor="black", label=f"M = {m}") for m in ms_here]
    if len(shown) < len(points):
        hidden = len(points) - len(shown)
        handles.append(Line2D([], [], ls="", label=f"not drawn: {hidden} with no rate"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9,
              frameon=False)


def _draw_table(ax: Any, doc: dict, colours: dict[str, Any]) -> None:
    """The bench table as an image; the layer cell is tinted with the layer's plot colour."""
    from matplotlib.colors import to_rgba

    rows = [[str(e["layer"]), str(e["M"]), str(e["N"]), str(e["K"]), str(e["route"]),
             _fmt(e["ms"], ".3f"), _fmt(e["GBps"], ".1f"), _fmt(e["TFLOPs"], ".3g"),
             _fmt(e["pct_bandwidth"], ".1f"), _fmt(e["pct_flops"], ".1f"),
             _fmt(e["error"], ".2e")] for e in doc["layers"]]
    ax.axis("off")
    table = ax.table(cellText=rows, colLabels=_TABLE_COLUMNS, loc="upper center",
                     cellLoc="center", bbox=[0.0, 0.0, 1.0, 1.0])
    table.auto_set_font_size(False)
    table.set_fontsize(9.5)
    for (row, _), cell in table.get_celld().items():
        cell.set_edgecolor("#bbbbbb")
        if row == 0:
            cell.set_facecolor("#e8e8e8")
            cell.set_text_props(weight="bold")
    for i, entry in enumerate(doc["layers"], start=1):
        table[i, 0].set_facecolor(to_rgba(colours[entry["layer"]], 0.35))


def _figure(docs: list[dict], dpi: int = 120) -> Any:
    """The matplotlib Figure for `docs`: per document a roofline axes with its table under it.

    Documents stack vertically so each table keeps the full width for its eleven columns.
    The roofline axes carry the label "roofline" (tests count them).
    """
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    # Colours and markers are shared by all documents, so one layer or M looks the same in
    # every subplot and two backends can be compared at a glance.
    palette = plt.get_cmap("tab10").colors
    colours: dict[str, Any] = {}
    markers: dict[int, str] = {}
    for doc in docs:
        for entry in doc["layers"]:
            colours.setdefault(entry["layer"], palette[len(colours) % len(palette)])
            markers.setdefault(entry["M"], _MARKERS[len(markers) % len(_MARKERS)])

    # The layout is in inches, top to bottom, so the text keeps one size whatever the number of
    # documents and rows: title, roofline, x label, table, gap.
    title_in, plot_in, label_in, row_in, gap_in = 0.7, 4.6, 0.75, 0.27, 0.45
    blocks = [(len(doc["layers"]) + 1) * row_in for doc in docs]
    width = 13.0
    height = sum(title_in + plot_in + label_in + table + gap_in for table in blocks)
    fig = plt.figure(figsize=(width, height), dpi=dpi)
    top = height
    for doc, table_in in zip(docs, blocks):
        top -= title_in + plot_in
        # Left for the y label, right for the legend, which sits outside the axes.
        ax = fig.add_axes([0.07, top / height, 0.62, plot_in / height], label="roofline")
        _draw_roofline(ax, doc, colours, markers)
        top -= label_in + table_in
        table_ax = fig.add_axes([0.02, top / height, 0.96, table_in / height], label="table")
        _draw_table(table_ax, doc, colours)
        top -= gap_in
    return fig


def plot_bench(doc: dict | list[dict], out_path: str, dpi: int = 120) -> None:
    """Write a PNG roofline of one `metrale bench --json` document, or of a list of them.

    Each document gets a log-log roofline (its measured bandwidth roof, and its compute roof
    when one was measured) with one point per entry of doc["layers"] at (FLOP per byte moved,
    achieved TFLOP/s), coloured by layer and marked by M, and under it the bench table.
    Raises ValueError when a document lacks what the plot needs.
    """
    docs = doc if isinstance(doc, list) else [doc]
    if not docs:
        raise ValueError("no bench documents to plot")
    for i, d in enumerate(docs):
        problem = _problem(d)
        if problem:
            raise ValueError(f"document {i}: {problem}")
    fig = _figure(docs, dpi)
    import matplotlib.pyplot as plt

    try:
        fig.savefig(out_path, dpi=dpi)
    finally:
        plt.close(fig)  # pyplot keeps figures alive otherwise; callers may plot many


def _load(path: str) -> dict:
    """The bench document in `path`; raises ValueError with a one-line reason when unusable."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise ValueError(e.strerror or str(e)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"invalid JSON: {e}") from None
    problem = _problem(doc)
    if problem:
        raise ValueError(problem)
    return doc


def main(argv: list[str] | None = None) -> int:
    """`metrale plot bench.json [more.json ...] -o roofline.png`; returns the exit status.

    0 on success (the output path is printed), 2 for bad arguments or an unusable input file
    (one line on stderr naming the file), 1 when the PNG cannot be written.
    """
    parser = argparse.ArgumentParser(
        prog="metrale plot",
        description="Roofline plot and table of `metrale bench --json` documents.")
    parser.add_argument("inputs", nargs="+", metavar="bench.json",
                        help="documents printed by `metrale bench --json`; one subplot each")
    parser.add_argument("-o", "--output", required=True, help="PNG file to write")
    parser.add_argument("--dpi", type=int, default=120, help="resolution (default 120)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on usage errors; callers expect a status instead
        return e.code if isinstance(e.code, int) else 2

    docs = []
    for path in args.inputs:
        try:
            docs.append(_load(path))
        except ValueError as e:
            print(f"metrale plot: {path}: {e}", file=sys.stderr)
            return 2
    try:
        plot_bench(docs, args.output, dpi=args.dpi)
    except OSError as e:
        print(f"metrale plot: {args.output}: cannot write: {e.strerror or e}", file=sys.stderr)
        return 1
    print(args.output)
    return 0
