"""Bubbles of torch's pipeline schedules with uniform costs, against their closed forms.

Every rank's share of the model costs F = 1 forward and B = 2 backward (I = 1
input gradients + W = 1 weight gradients) per microbatch, split evenly over
the stages it holds (v per rank; 2 for ZBVZeroBubble and DualPipeV). "bubble"
is the most idle rank's idle time in units of F; "frac" is dflop's bubble
fraction (idle share of all ranks' time up to the last compute), "/busy" the
bubble over a rank's busy time. Closed forms, with f, b, w the times of one
stage (F/v, B/v, W/v):

- 1F1B (p-1)(F+B) and ZBH1 (p-1)(F+B-2W): the DualPipe README's 1F1B and ZB1P rows;
- Interleaved1F1B (p-1)(F+B)/v: Narayanan et al. 2021; LoopedBFS has the same
  once a round of p microbatches fills the pipe (tests/test_v_schedules.py);
- DualPipeV with its F&B overlapped (p-1)(f&b + b - 3w), f&b = max(f, b): the
  DualPipe README's row, with PP = 2p stages (it holds where f equals the
  input-gradient time, as here); run back to back as torch runs the pair (one
  unit, its sends after both halves), (p-1)(f + b - 2w) + (p-1)f, ZB1P's form
  with one stage's times plus the forward output held during the backward half
  (measured; the tests pin where it holds);
- ZBVZeroBubble (p-1)f: with f = i = w only the fill idles (the last rank's
  first forward waits for p-1 forwards).

Run: .venv/bin/python benchmarks/bench_schedules.py [--quick] [--json PATH]
"""

from __future__ import annotations

import numpy as np

from report import Results, arguments

from dflop.sim import simulate_pipeline
from dflop.trace.metrics import metrics

F, I, W = 1.0, 1.0, 1.0  # noqa: E741
B = I + W

# (label, schedule, stages per rank, overlap, closed form (p, v) -> bubble or None)
ROWS = [
    ("1F1B", "1F1B", 1, "sequential", lambda p, v: (p - 1) * (F + B)),
    ("Interleaved1F1B", "Interleaved1F1B", 2, "sequential", lambda p, v: (p - 1) * (F + B) / v),
    ("ZBH1", "ZBH1", 1, "sequential", lambda p, v: (p - 1) * (F + B - 2 * W)),
    ("InterleavedZeroBubble", "InterleavedZeroBubble", 2, "sequential", None),
    ("LoopedBFS", "LoopedBFS", 2, "sequential", lambda p, v: (p - 1) * (F + B) / v),
    ("ZBVZeroBubble", "ZBVZeroBubble", 2, "sequential", lambda p, v: (p - 1) * F / v),
    ("DualPipeV", "DualPipeV", 2, "sequential", lambda p, v: (p - 1) * (F + B - 2 * W) / v + (p - 1) * F / v),
    ("DualPipeV overlapped", "DualPipeV", 2, "overlapped",
     lambda p, v: (p - 1) * (max(F, B) / v + B / v - 3 * W / v)),
]


def simulate(schedule: str, p: int, m: int, v: int, overlap: str):
    stages = p * v
    f, i, w = (np.full(stages, x / v) for x in (F, I, W))
    if schedule in ("1F1B", "Interleaved1F1B", "LoopedBFS"):
        return simulate_pipeline(f, i + w, schedule=schedule, microbatches=m, virtual_stages=v)
    return simulate_pipeline(f, i, bwd_weight=w, schedule=schedule, microbatches=m, virtual_stages=v,
                             overlap=overlap)


def table(results: Results, p: int, m: int) -> None:
    rows, bubbles = [], {}
    for label, schedule, v, overlap, closed in ROWS:
        result = simulate(schedule, p, m, v, overlap)
        busy = metrics(result.trace).busy_s
        bubble = result.step_time - min(busy)
        bubbles[label] = bubble
        rows.append([label, v, round(result.step_time, 2), round(bubble, 3), f"{result.bubble_fraction:.1%}",
                     f"{bubble / min(busy):.1%}", round(closed(p, v), 3) if closed else "-"])
    results.table(["schedule", "v", "step", "bubble", "frac", "/busy", "closed form"], rows,
                  f"p={p} ranks, m={m} microbatches, F={F:g} I={I:g} W={W:g} per rank")
    base = bubbles["Interleaved1F1B"]
    results.note(f"p={p}, m={m}: bubble / Interleaved1F1B's: " + ", ".join(
        f"{k} {bubbles[k] / base:.2f}" for k in ("ZBVZeroBubble", "DualPipeV", "DualPipeV overlapped")))


def main() -> None:
    args = arguments(__doc__.splitlines()[0]).parse_args()
    results = Results("Pipeline schedules: bubbles against their closed forms",
                      "python benchmarks/bench_schedules.py" + (" --quick" if args.quick else ""))
    for p, m in ((4, 8),) if args.quick else ((4, 8), (8, 32)):
        table(results, p, m)
    results.save(args.json)


if __name__ == "__main__":
    main()
