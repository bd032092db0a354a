"""Bubble timelines: one row per rank, forward/backward/communication coloured apart.

Idle time shows as the grey background between coloured bars. Small runs get
microbatch ids on the bars; large runs show a sample of ranks from every
pipeline stage (saying how many), since a thousand rows help nobody.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dflop.trace.chrome import COMM, COMPUTE
from dflop.trace.metrics import metrics
from dflop.viz.style import COLORS, figure, save

LABEL_LIMIT = 600


def _rows(doc: dict[str, Any], max_rows: int) -> list[int]:
    workers = doc.get("otherData", {}).get("workers", [])
    pids = sorted({e["pid"] for e in doc["traceEvents"] if e.get("ph") == "X"})
    if len(pids) <= max_rows or not workers:
        return pids[:max_rows]
    groups: dict[tuple, list[int]] = {}
    for pid in pids:
        w = workers[pid]
        groups.setdefault((w["module"] != "encoder", w["rank"]), []).append(pid)
    per_group = max(1, max_rows // len(groups))
    rows = []
    for key in sorted(groups):
        members = groups[key]
        picks = np.unique(np.linspace(0, len(members) - 1, min(per_group, len(members))).round().astype(int))
        rows.extend(members[i] for i in picks)
    return rows[:max_rows]


def _unit(span_us: float) -> tuple[float, str]:
    return (1e6, "s") if span_us >= 2e6 else (1e3, "ms")


def _draw(ax: Any, doc: dict[str, Any], rows: list[int], scale: float, title: str) -> None:
    workers = doc.get("otherData", {}).get("workers", [])
    steps = doc.get("otherData", {}).get("steps", [])
    ypos = {pid: i for i, pid in enumerate(rows)}
    bars: dict[str, list[tuple[float, float, int]]] = {}
    labels = []
    for e in doc["traceEvents"]:
        if e.get("ph") != "X" or e["pid"] not in ypos:
            continue
        key = e.get("cat", "F") if e.get("tid") == COMPUTE else e.get("cat", "p2p")
        bars.setdefault(key if e.get("tid") == COMPUTE else f"comm:{key}", []).append(
            (e["ts"] / scale, e["dur"] / scale, ypos[e["pid"]]))
        if e.get("tid") == COMPUTE and "microbatch" in e.get("args", {}):
            labels.append((e["ts"] / scale, e["dur"] / scale, ypos[e["pid"]], e["args"]["microbatch"]))
    end = max((s["end_us"] for s in steps), default=max((x + w for v in bars.values() for x, w, _ in v),
                                                          default=1.0) * scale) / scale
    for y in range(len(rows)):
        ax.broken_barh([(0, end)], (y - 0.4, 0.8), facecolors=COLORS["idle"], zorder=0)
    names = {"F": "forward", "B": "backward", "I": "backward (inputs)", "W": "backward (weights)",
             "comm:p2p": "p2p transfer", "comm:bridge": "encoder->LLM bridge", "comm:allreduce": "DP all-reduce"}
    for key, items in sorted(bars.items()):
        by_row: dict[int, list[tuple[float, float]]] = {}
        for x, w, y in items:
            by_row.setdefault(y, []).append((x, w))
        color = COLORS.get(key.split(":")[-1], COLORS["comm"]) if key.startswith("comm") else COLORS.get(key, "#999")
        if key == "comm:bridge":
            color = "#17becf"
        for i, (y, spans) in enumerate(by_row.items()):
            lo, height = (y + 0.22, 0.16) if key.startswith("comm") else (y - 0.34, 0.54)
            ax.broken_barh(spans, (lo, height), facecolors=color, edgecolors="white", linewidth=0.3,
                           label=names.get(key, key) if i == 0 else None, zorder=2)
    if len(labels) <= LABEL_LIMIT:
        for x, w, y, k in labels:
            if w > end * 0.012:
                ax.text(x + w / 2, y - 0.07, str(k), ha="center", va="center", fontsize=6.5, color="white",
                        zorder=3)
    for s in steps[1:]:
        ax.axvline(s["start_us"] / scale, color="#444", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([workers[p]["name"] if p < len(workers) else f"rank {p}" for p in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, end * 1.01)
    ax.set_title(title, fontsize=10, loc="left")
    if bars:
        ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=7, fontsize=7, frameon=False,
                  borderaxespad=0.2)


def _summary(doc: dict[str, Any], label: str, shown: int) -> str:
    m = metrics(doc)
    total = len(doc.get("otherData", {}).get("workers", [])) or shown
    ranks = f"{total} ranks" if shown == total else f"{shown} of {total} ranks shown"
    if not m.steps:
        return f"{label}no steps | {ranks}"
    return (f"{label}step {m.step_time_mean:.3g} s | bubble {_share(m.bubble_fraction)} | "
            f"idle {_share(m.idle_fraction)} | {ranks}")


def _share(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:.1%}"


def plot_timeline(doc: dict[str, Any], path: str | Path, *, compare: dict[str, Any] | None = None,
                  labels: tuple[str, str] = ("", ""), max_rows: int = 40) -> Path:
    """Draw ``doc`` (and ``compare`` below it, on the same time axis) to a PNG."""
    docs = [doc] + ([compare] if compare is not None else [])
    rows = [_rows(d, max_rows) for d in docs]
    span = max(max((s["end_us"] for s in d.get("otherData", {}).get("steps", [])), default=0.0)
               or max((e["ts"] + e["dur"] for e in d["traceEvents"] if e.get("ph") == "X"), default=1.0)
               for d in docs)
    scale, unit = _unit(span)
    heights = [max(2.2, 0.32 * len(r) + 1.2) for r in rows]
    fig, axes = figure(len(docs), 1, size=(13, sum(heights) + 0.6), sharex=True,
                       gridspec_kw={"height_ratios": heights})
    axes = np.atleast_1d(axes)
    for ax, d, r, label in zip(axes, docs, rows, labels):
        _draw(ax, d, r, scale, _summary(d, f"{label}: " if label else "", len(r)))
        ax.set_xlim(0, span / scale * 1.01)
    axes[-1].set_xlabel(f"time ({unit})")
    fig.tight_layout()
    return save(fig, path)
