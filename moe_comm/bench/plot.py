"""The benchmarks' figure: per panel (one op), latency (µs) and bandwidth (GB/s, or TFLOP/s) against
tokens per rank, one line per transport or backend, baselines and ceilings dotted, the measured
memory-copy floor dashed black. Needs matplotlib (``pip install 'moe-comm[plot]'``), imported only here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence

__all__ = ["Point", "Series", "Panel", "case_series", "floor_series", "plot"]

#: (tokens per rank, median µs, rate in the panel's unit or None)
Point = tuple[int, float, Optional[float]]
#: ``ours``: moe-comm; ``baseline``: another implementation; ``ceiling``: a raw primitive of the same
#: bytes (all-to-all, matmul); ``floor``: the memory-copy floor of the same bytes; ``part``: a part of
#: the op timed alone (communication without the compute, compute without the communication)
Kind = Literal["ours", "baseline", "ceiling", "floor", "part"]


@dataclass(frozen=True)
class Series:
    """One line: ``points`` sorted by tokens per rank; series of one ``colour`` key (default: the
    label; e.g. a transport and its hooked variant) share a colour in every panel; ``marker`` (a
    matplotlib marker) replaces the kind's, to tell apart lines of one kind and colour."""

    label: str
    kind: Kind
    points: tuple[Point, ...]
    colour: str = ""
    marker: str = ""


@dataclass(frozen=True)
class Panel:
    """One op: a latency plot and, when some series has rates, a rate plot in ``unit`` (its y label)."""

    title: str
    series: tuple[Series, ...]
    unit: str = "GB/s per rank"


_STYLE = {"ours": dict(linestyle="-", marker="o"), "baseline": dict(linestyle=":", marker="s"),
          "ceiling": dict(linestyle="-.", marker="^"), "floor": dict(linestyle="--", marker="x", color="black"),
          "part": dict(linestyle=(0, (3, 1, 1, 1, 1, 1)), marker="v")}


def case_series(runs: Sequence[tuple[int, dict[str, dict[str, Any]]]], case: str, label: str, kind: Kind,
                rate: Optional[str] = "GBps_per_rank", latency: str = "median_us",
                colour: str = "") -> Optional[Series]:
    """The row named ``case`` of each run (``(tokens, {case: row})``): its ``latency`` and ``rate``
    fields (``rate`` None: latency only); None when no run has the case."""
    points = tuple(sorted((t, rows[case][latency], rows[case].get(rate) if rate else None)
                          for t, rows in runs if case in rows))
    return Series(label, kind, points, colour) if points else None


def floor_series(runs: Sequence[tuple[int, dict[str, dict[str, Any]]]], case: str,
                 label: str = "memory-copy floor") -> Optional[Series]:
    """The memory-copy floor of the row named ``case`` (its ``floor_us``; rate = its bytes per rank /
    floor, i.e. the measured memcpy bandwidth); None when no run has one."""
    points = tuple(sorted((t, rows[case]["floor_us"], rows[case]["bytes_per_rank_mean"] / rows[case]["floor_us"] / 1e3)
                          for t, rows in runs if "floor_us" in rows.get(case, {})))
    return Series(label, "floor", points) if points else None


def plot(path: str, title: str, panels: Sequence[Panel]) -> str:
    """Draws ``panels`` (one row each: rate left when any panel has rates, latency right, x = tokens per
    rank on a log2 axis, latency and rate on log axes) into one figure saved to ``path``; returns ``path``.
    A single token count draws as points."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend
    from matplotlib.ticker import NullLocator

    panels = [p for p in panels if p.series]
    if not panels:
        raise ValueError("plot: no panel has a series to draw")
    has_rate = [any(pt[2] is not None for s in p.series for pt in s.points) for p in panels]
    cols = 2 if any(has_rate) else 1
    # constrained layout keeps the suptitle and the legends (right of each row) clear of the plots
    fig = Figure(figsize=(5.6 * cols + 3.2, 3.4 * len(panels) + 0.6), layout="constrained")
    axes = fig.subplots(len(panels), cols, squeeze=False)
    keys = list(dict.fromkeys(s.colour or s.label for p in panels for s in p.series if s.kind != "floor"))
    colours = {key: colormaps["tab10"](i % 10) for i, key in enumerate(keys)}  # in order of first appearance
    tokens = sorted({pt[0] for p in panels for s in p.series for pt in s.points})
    for panel, row, rated in zip(panels, axes, has_rate):
        latency, rate = row[-1], (row[0] if cols == 2 else None)
        for s in panel.series:
            style = {"color": colours.get(s.colour or s.label), **_STYLE[s.kind]}
            if s.marker:
                style["marker"] = s.marker
            latency.plot([pt[0] for pt in s.points], [pt[1] for pt in s.points], label=s.label, **style)
            rated_points = [pt for pt in s.points if pt[2] is not None]
            if rate is not None and rated_points:
                rate.plot([pt[0] for pt in rated_points], [pt[2] for pt in rated_points], label=s.label, **style)
        latency.set_yscale("log")
        latency.set_ylabel("latency, median (µs)")
        latency.set_title(f"{panel.title}: latency")
        if rate is not None:
            rate.set_ylabel(panel.unit)
            rate.set_title(f"{panel.title}: {'bandwidth' if panel.unit.startswith('GB/s') else 'throughput'}")
            rate.set_yscale("log")  # the floor and the ceilings are often orders of magnitude apart
            if not rated:
                rate.set_visible(False)
        for ax in row:
            ax.set_xscale("log", base=2)
            ax.set_xticks(tokens, [str(t) for t in tokens])
            ax.xaxis.set_minor_locator(NullLocator())  # x ticks: the token counts run, nothing between
            ax.set_xlabel("tokens per rank")
            ax.grid(True, alpha=0.3)
        # one legend per row, right of the latency plot (the rate plot's lines are the same)
        latency.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle(title)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path
