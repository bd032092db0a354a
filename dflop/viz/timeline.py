"""Bubble timelines: one row per rank, compute above and communication in a thin lane below.

Idle time shows as the grey background between bars. Encoder and LLM work have
their own colours; where a colocated plan runs the encoder inside the LLM's
first stage, that stage's bars are hatched. Sends (p2p, the encoder->LLM
bridge) and collectives (gradient reduction, FSDP gathers) are drawn in the
lane; receives only mark arrivals and are not drawn. Microbatch ids label the
bars only when they tell bars apart and there are few enough to read.

A many-step trace is drawn one step at a time (the first by default), with a
time window to zoom; large runs show a sample of ranks from every pipeline
stage. :func:`layout` says what would be drawn, so tests check the content, and
:func:`plot_timeline` draws it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dflop.errors import DflopError
from dflop.specs.plan import Module
from dflop.trace.chrome import COMPUTE
from dflop.trace.metrics import MODULE_GROUP_NAMES, metrics
from dflop.trace.record import RECV
from dflop.viz import style

LABEL_LIMIT = 600
"""Most microbatch labels one panel shows; beyond that they are noise."""
LABEL_MIN_WIDTH = 0.012
"""Narrowest labelled bar, as a share of the window."""
Step = int | str | None
"""1-based step number, ``"all"``, or None for the first step."""


@dataclass(frozen=True)
class Bar:
    row: int
    start: float
    """Seconds from the panel's origin (its step's start, or the trace's)."""
    width: float
    category: str
    """``"llm F"``, ``"encoder B"``, ``"llm+encoder F"`` (colocated first stage), or a communication
    category (``p2p``, ``bridge``, ``reduce_grad``, ``unshard``)."""
    comm: bool
    label: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    rows: tuple[str, ...]
    bars: tuple[Bar, ...]
    step_starts: tuple[float, ...]
    """Where later steps begin (dashed lines), seconds from the origin."""
    end: float

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for b in self.bars:
            out[b.category] = out.get(b.category, 0) + 1
        return out

    @property
    def labels(self) -> list[str]:
        return [b.label for b in self.bars if b.label]


@dataclass(frozen=True)
class Timeline:
    panels: tuple[Panel, ...]
    window: tuple[float, float]
    """Seconds shown, the same for every panel."""
    origin: str = "step"
    """What time 0 is: the drawn step's start, or the trace's."""

    @property
    def unit(self) -> tuple[float, str]:
        """(seconds per unit, unit name) of the time axis."""
        return (1.0, "s") if self.window[1] - self.window[0] >= 2.0 else (1e-3, "ms")


# ---- what to draw ------------------------------------------------------------------------------

def _rows(doc: dict[str, Any], max_rows: int) -> list[int]:
    workers = doc.get("otherData", {}).get("workers", [])
    pids = sorted({e["pid"] for e in doc["traceEvents"] if e.get("ph") == "X"})
    if len(pids) <= max_rows or not workers:
        return pids[:max_rows]
    groups: dict[tuple, list[int]] = {}
    for pid in pids:
        w = workers[pid]
        groups.setdefault((w["module"] != Module.ENCODER, w["rank"]), []).append(pid)
    per_group = max(1, max_rows // len(groups))
    rows = []
    for key in sorted(groups):
        members = groups[key]
        picks = np.unique(np.linspace(0, len(members) - 1, min(per_group, len(members))).round().astype(int))
        rows.extend(members[i] for i in picks)
    return rows[:max_rows]


def _steps(doc: dict[str, Any]) -> list[dict[str, Any]]:
    steps = doc.get("otherData", {}).get("steps") or []
    if steps:
        return steps
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in doc["traceEvents"] if e.get("ph") == "X"]
    return [{"start_us": min((a for a, _ in spans), default=0.0), "end_us": max((b for _, b in spans), default=1.0)}]


def _selection(doc: dict[str, Any], step: Step, name: str) -> tuple[list[dict[str, Any]], float]:
    """The steps to draw and the origin of the time axis (µs)."""
    steps = _steps(doc)
    if step == "all":
        return steps, 0.0
    k = 1 if step is None else step
    if not isinstance(k, int) or not 1 <= k <= len(steps):
        raise DflopError(f"step {step} is out of range: {name} has {len(steps)} step"
                         f"{'s' if len(steps) > 1 else ''} (1 to {len(steps)}, or all)")
    return [steps[k - 1]], steps[k - 1]["start_us"]


def _in_steps(e: dict[str, Any], chosen: list[dict[str, Any]]) -> bool:
    index = e.get("args", {}).get("step")
    if index is not None and all("step" in s for s in chosen):
        return any(s["step"] == index for s in chosen)
    return any(s["start_us"] <= e["ts"] < s["end_us"] for s in chosen)


def _colocated(doc: dict[str, Any]) -> bool:
    """A colocated plan: no encoder workers, yet the LLM's first stage processes vision tiles.

    The trace marks such events as module llm; their tiles give the encoder's share away."""
    workers = doc.get("otherData", {}).get("workers", [])
    if any(w.get("module") == Module.ENCODER or w.get("encoder_phase") for w in workers):
        return False
    return any(e.get("tid") == COMPUTE and e.get("args", {}).get("stage") == 0 and e["args"].get("tiles", 0) > 0
               for e in doc["traceEvents"] if e.get("ph") == "X")


def _category(e: dict[str, Any], colocated: bool, module: str) -> str:
    cat = e.get("cat", "")
    if e.get("tid") != COMPUTE:
        return cat or "p2p"
    if cat not in style.KIND_NAMES:
        return cat or "compute"
    args = e.get("args", {})
    module = args.get("module", module)
    if colocated and module == Module.LLM and args.get("stage") == 0:
        return f"llm+encoder {cat}"
    return f"{module} {cat}"


def _bars(doc: dict[str, Any], rows: list[int], chosen: list[dict[str, Any]], origin: float,
          window: tuple[float, float] | None) -> list[Bar]:
    workers = doc.get("otherData", {}).get("workers", [])
    ypos = {pid: i for i, pid in enumerate(rows)}
    colocated = _colocated(doc)
    bars = []
    for e in doc["traceEvents"]:
        if e.get("ph") != "X" or e["pid"] not in ypos or e.get("cat") == RECV or not _in_steps(e, chosen):
            continue
        start, end = (e["ts"] - origin) / 1e6, (e["ts"] + e["dur"] - origin) / 1e6
        if window is not None:
            if end <= window[0] or start >= window[1]:
                continue
            start, end = max(start, window[0]), min(end, window[1])
        module = workers[e["pid"]].get("module", "llm") if e["pid"] < len(workers) else "llm"
        label = str(e.get("args", {}).get("microbatch", "")) if e.get("tid") == COMPUTE else ""
        bars.append(Bar(ypos[e["pid"]], start, end - start, _category(e, colocated, module),
                        e.get("tid") != COMPUTE, label))
    return bars


def _keep_useful_labels(bars: Sequence[Bar], span: float) -> tuple[Bar, ...]:
    """Microbatch labels only where they tell bars apart and can be read."""
    labelled = [b for b in bars if b.label and b.width >= span * LABEL_MIN_WIDTH]
    useful = len({b.label for b in bars if b.label}) > 1 and len(labelled) <= LABEL_LIMIT
    keep = {id(b) for b in labelled} if useful else set()
    return tuple(b if id(b) in keep else replace(b, label="") for b in bars)


def _title(doc: dict[str, Any], label: str, step: Step, shown: int) -> str:
    other = doc.get("otherData", {})
    m = metrics(doc)
    steps = _steps(doc)
    head = " | ".join(x for x in (label, other.get("plan", "")) if x)
    total = len(other.get("workers", [])) or shown
    ranks = f"{total} ranks" if shown == total else f"{shown} of {total} ranks shown"
    if not m.steps:
        return "\n".join(x for x in (head, f"no steps in the trace | {ranks}") if x)
    if step == "all" or len(steps) == 1:
        what = f"{len(steps)} step{'s' if len(steps) > 1 else ''}, mean {m.step_time_mean:.3g} s"
    else:
        k = step or 1
        s = steps[k - 1]
        what = (f"{'first step' if step is None else f'step {k}'} of {len(steps)}: "
                f"{(s['end_us'] - s['start_us']) / 1e6:.3g} s, mean {m.step_time_mean:.3g} s")
    return "\n".join(x for x in (head, f"{what} | bubble {_share(m.bubble_fraction)} | "
                                       f"idle {_share(m.idle_fraction)} | {ranks}") if x)


def _share(fraction: float | None) -> str:
    """A fraction as a percentage; '-' where the trace has nothing to measure it on."""
    return "-" if fraction is None else f"{fraction:.1%}"


def layout(doc: dict[str, Any], *, compare: dict[str, Any] | None = None, labels: Sequence[str] = ("", ""),
           step: Step = None, window: tuple[float, float] | None = None, max_rows: int = 40) -> Timeline:
    """What :func:`plot_timeline` draws: panels of rows and bars, on one time axis.

    ``step``: 1-based step to draw, ``"all"``, or None for the first; ``window``: (start, end) in
    seconds from the step's start (from the trace's start with all steps)."""
    if window is not None and not (0 <= window[0] < window[1] and math.isfinite(window[1])):
        raise DflopError(f"window {window[0]:g} {window[1]:g}: needs 0 <= START < END, both finite (seconds)")
    docs = [doc] + ([compare] if compare is not None else [])
    panels = []
    for d, label, default in zip(docs, list(labels) + ["", ""], ("the trace", "the compared trace")):
        chosen, origin = _selection(d, step, label or default)
        rows = _rows(d, max_rows)
        end = (max(s["end_us"] for s in chosen) - origin) / 1e6
        bars = _bars(d, rows, chosen, origin, window)
        workers = d.get("otherData", {}).get("workers", [])
        panels.append(Panel(_title(d, label, step, len(rows)),
                            tuple(workers[p]["name"] if p < len(workers) else f"rank {p}" for p in rows),
                            tuple(bars), tuple((s["start_us"] - origin) / 1e6 for s in chosen[1:]), end))
    span = window or (0.0, max(p.end for p in panels) or 1.0)
    if window is not None and window[0] >= max(p.end for p in panels):
        raise DflopError(f"window starts at {window[0]:g} s, after the end of what is drawn "
                         f"({max(p.end for p in panels):.3g} s)")
    panels = [replace(p, bars=_keep_useful_labels(p.bars, span[1] - span[0])) for p in panels]
    return Timeline(tuple(panels), span, "trace" if step == "all" else "step")


# ---- drawing -----------------------------------------------------------------------------------

def _legend_name(category: str) -> str:
    module, _, kind = category.partition(" ")
    if kind in style.KIND_NAMES:
        who = MODULE_GROUP_NAMES.get(module, module)
        return f"{who} {style.KIND_NAMES[kind]}"
    return style.COMM_NAMES.get(category, category)


def _color(category: str) -> str:
    module, _, kind = category.partition(" ")
    if module == "llm+encoder":
        return style.COLOCATED_COLORS.get(kind, style.OTHER_COLOR)
    if kind:
        return style.COMPUTE_COLORS.get((module, kind), style.OTHER_COLOR)
    return style.COMM_COLORS.get(category, style.OTHER_COLOR)


def _legend_order(category: str) -> tuple:
    """Encoder before LLM, forward before backward, communication last."""
    module, _, kind = category.partition(" ")
    if kind in style.KIND_NAMES:
        modules = ("encoder", "llm+encoder", "llm")
        return (0, modules.index(module) if module in modules else 3, list(style.KIND_NAMES).index(kind))
    names = list(style.COMM_NAMES)
    return (1, names.index(category) if category in names else len(names), category)


def _draw(ax: Any, panel: Panel, tl: Timeline) -> None:
    scale, _ = tl.unit
    lo, hi = tl.window
    for y in range(len(panel.rows)):
        ax.broken_barh([(lo / scale, (hi - lo) / scale)], (y - 0.4, 0.8), facecolors=style.COLORS["idle"], zorder=0)
    by_category: dict[str, list[Bar]] = {}
    for b in panel.bars:
        by_category.setdefault(b.category, []).append(b)
    for category, bars in sorted(by_category.items(), key=lambda kv: _legend_order(kv[0])):
        comm = bars[0].comm
        for i, y in enumerate(sorted({b.row for b in bars})):
            spans = [(b.start / scale, b.width / scale) for b in bars if b.row == y]
            lane = (y + 0.2, 0.18) if comm else (y - 0.38, 0.54)
            colocated = category.startswith("llm+encoder")
            ax.broken_barh(spans, lane, facecolors=_color(category), linewidth=0.3 if not colocated else 0.0,
                           edgecolors="white" if not colocated else "#ffffff80",
                           hatch=style.COLOCATED_HATCH if colocated else None,
                           label=_legend_name(category) if i == 0 else None, zorder=2)
    for b in panel.bars:
        if b.label:
            ax.text((b.start + b.width / 2) / scale, b.row - 0.11, b.label, ha="center", va="center",
                    fontsize=6.5, color="white", zorder=3)
    for x in panel.step_starts:
        if lo <= x <= hi:
            ax.axvline(x / scale, color="#444", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(len(panel.rows)))
    ax.set_yticklabels(panel.rows, fontsize=7)
    ax.set_ylim(len(panel.rows) - 0.5, -0.6)
    ax.set_title(panel.title, fontsize=9, loc="left")


def draw(tl: Timeline, path: str | Path) -> Path:
    """Draw a :class:`Timeline` to a PNG."""
    return style.save(figure(tl), path)


def figure(tl: Timeline) -> Any:
    """A :class:`Timeline` as a matplotlib Figure (a notebook shows it inline): its panels stacked,
    on one time axis, one legend below."""
    heights = [max(2.4, 0.34 * len(p.rows) + 1.6) for p in tl.panels]
    fig, axes = style.figure(len(tl.panels), 1, size=(13, sum(heights) + 0.6), sharex=True,
                             gridspec_kw={"height_ratios": heights})
    axes = np.atleast_1d(axes)
    scale, unit = tl.unit
    for ax, panel in zip(axes, tl.panels):
        _draw(ax, panel, tl)
    axes[-1].set_xlim(tl.window[0] / scale, tl.window[1] / scale)
    axes[-1].set_xlabel(f"time from the {tl.origin}'s start ({unit})")
    fig.tight_layout()
    handles: dict[str, Any] = {}
    for ax in axes:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(name, handle)
    names = [_legend_name(c) for c in sorted({b.category for p in tl.panels for b in p.bars}, key=_legend_order)]
    names = list(dict.fromkeys(n for n in names if n in handles))
    fig.legend([handles[n] for n in names], names, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=6,
               fontsize=8, frameon=False)
    return fig


def plot_timeline(doc: dict[str, Any], path: str | Path, *, compare: dict[str, Any] | None = None,
                  labels: Sequence[str] = ("", ""), max_rows: int = 40, step: Step = None,
                  window: tuple[float, float] | None = None) -> Path:
    """Draw ``doc`` (and ``compare`` below it, on the same time axis) to a PNG; see :func:`layout`."""
    return draw(layout(doc, compare=compare, labels=labels, step=step, window=window, max_rows=max_rows), path)


def timeline_figure(doc: dict[str, Any], *, compare: dict[str, Any] | None = None, labels: Sequence[str] = ("", ""),
                    max_rows: int = 40, step: Step = None, window: tuple[float, float] | None = None) -> Any:
    """What :func:`plot_timeline` draws, as a matplotlib Figure to show rather than a file."""
    return figure(layout(doc, compare=compare, labels=labels, step=step, window=window, max_rows=max_rows))
