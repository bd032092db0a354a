"""Profile the tiny CPU models from scratch and report how well the profiled cost model predicts
shapes it was not fitted on.

Run: .venv/bin/python benchmarks/bench_profile.py [--quick] [--json PATH]
(a few minutes at most on a laptop CPU; --quick measures the small grid with 2 repeats)

CPU timings on a shared machine are noisy; OMP_NUM_THREADS=1 steadies them. Like the
shipped profile, it measures with two lock-step processes (``--processes 2``), the way the
torch backend's two ranks share this machine; the records say how many threads and
processes measured them.
"""

from __future__ import annotations

import tempfile
import time

from report import Results, arguments

from dflop.cost.profiled import holdout_error
from dflop.cost.store import ProfileStore, shipped_records
from dflop.profile.profiler import profile_model


def main() -> None:
    args = arguments(__doc__.splitlines()[0]).parse_args()
    results = Results("Model profiler: tiny CPU models, held-out error",
                      "python benchmarks/bench_profile.py" + (" --quick" if args.quick else ""))
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for model in ("tiny-llm", "tiny-vit"):
            start = time.perf_counter()
            report = profile_model(model, folder, grid="quick" if args.quick else None,
                                   repeats=2 if args.quick else None, processes=2)
            seconds = time.perf_counter() - start
            err = holdout_error([r for r in ProfileStore.in_dir(folder).read() if r["model"] == model])
            rows.append([model, report.measured, round(seconds, 1), err["shapes"], f"{err['median']:.1%}",
                         f"{err['max']:.1%}"])
        err = holdout_error(ProfileStore.in_dir(folder).read())
        rows.append(["both", "", "", err["shapes"], f"{err['median']:.1%}", f"{err['max']:.1%}"])
    err = holdout_error(shipped_records())
    rows.append(["shipped profile", "", "", err["shapes"], f"{err['median']:.1%}", f"{err['max']:.1%}"])
    results.table(["profile", "shapes measured", "seconds", "held-out shapes", "median error", "max error"], rows)
    results.note("target: median held-out error under 10% on CPU")
    results.save(args.json)


if __name__ == "__main__":
    main()
