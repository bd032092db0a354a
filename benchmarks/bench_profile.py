"""Profile the tiny CPU models from scratch and report how well the profiled cost model predicts
shapes it was not fitted on.

Run: .venv/bin/python benchmarks/bench_profile.py   (a few minutes at most on a laptop CPU)

CPU timings on a shared machine are noisy; OMP_NUM_THREADS=1 steadies them (the
shipped profile was measured so, and its records say how many threads they used).
"""

from __future__ import annotations

import tempfile
import time

from dflop.cost.profiled import holdout_error
from dflop.cost.store import ProfileStore, shipped_records
from dflop.profile.profiler import profile_model


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        for model in ("tiny-llm", "tiny-vit"):
            start = time.perf_counter()
            report = profile_model(model, folder)
            seconds = time.perf_counter() - start
            records = [r for r in ProfileStore.in_dir(folder).read() if r["model"] == model]
            err = holdout_error(records)
            print(f"{model}: {report.measured} shapes in {seconds:.1f} s; held-out error on {err['shapes']} shapes: "
                  f"median {err['median']:.1%}, max {err['max']:.1%} (target: median under 10% on CPU)")
        records = ProfileStore.in_dir(folder).read()
        err = holdout_error(records)
        print(f"both: median {err['median']:.1%}, max {err['max']:.1%} over {err['shapes']} held-out shapes")
    err = holdout_error(shipped_records())
    print(f"shipped profile: median {err['median']:.1%}, max {err['max']:.1%} over {err['shapes']} held-out shapes")


if __name__ == "__main__":
    main()
