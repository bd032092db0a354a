"""A frozen encoder (``training.freeze_encoder``) against a trained one, in the simulator.

Run: .venv/bin/python benchmarks/bench_frozen_encoder.py
Each setting as bench_optimizer makes it (8 samples per GPU, H100 nodes of 8, the analytical cost
model), searched twice by the optimizer: the encoder trained, and frozen (forward only: no backward,
activations, gradients, optimizer state or gradient reduction of its own). Each search times its
plans on its own sampled batches; the step ratio is frozen over trained, and each speedup is over the
strongest baseline searched with the same recipe.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from bench_optimizer import SHORT, problem
from dflop.cost import System
from dflop.plan.evaluate import PlanningProblem
from dflop.plan.search import optimize
from dflop.specs import GIB

SETTINGS = (
    ("siglip-so400m", "qwen2.5-7b", "llava-ov", 32),
    ("internvit-6b", "qwen2.5-7b", "video-heavy", 64),
)


def frozen(p: PlanningProblem) -> PlanningProblem:
    training = replace(p.training, freeze_encoder=True)
    return replace(p, system=System(p.model, p.cluster, training, p.cost))


def main() -> None:
    rows = []
    for encoder, llm, mix, gpus in SETTINGS:
        p, batch = problem(encoder, llm, gpus, mix)
        name = f"{SHORT[encoder]} + {SHORT[llm]}, {mix}, {gpus}"
        found = {}
        for recipe, problem_ in (("trained", p), ("frozen", frozen(p))):
            start = time.perf_counter()
            found[recipe] = optimize(problem_, batch)
            print(f"{name}, encoder {recipe}: {time.perf_counter() - start:.1f} s", flush=True)
        for recipe, r in found.items():
            best = r.best
            base = f"{r.strongest.name}: {r.strongest.best.mean:.3f} ({r.speedup:.2f}x)" if r.strongest else "none fits"
            ratio = best.mean / found["trained"].best.mean
            rows.append(f"| {name} | {recipe} | {best.mean:.3f} ({float(np.mean(best.mfu)):.0%}) | {ratio:.2f} | "
                        f"{best.peak_memory / GIB:.0f} | {base} | {best.plan.describe().replace(' | ', '; ')} |")
    print("\nstep s (MFU), dflop's plan, fast evaluator, H100; ratio: the step over the trained encoder's; speedup "
          "over the strongest baseline of the same recipe\n")
    print("| setting | encoder | step s (MFU) | ratio | peak GiB | strongest baseline (speedup) | dflop's plan |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
