"""The `dflop` command. Commands import their implementation lazily so `--help` is instant."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import click

from dflop.cli.output import emit, fmt_stats, log
from dflop.errors import DflopError, check_output, ensure_writable_folder
from dflop.specs.limits import MAX_GLOBAL_BATCH, MAX_GPUS, MAX_PREDICTION_ERROR, MAX_SAMPLES, MAX_STEPS
from dflop.specs.scheduling import Solver
from dflop.viz.style import IMAGE_SUFFIXES

JSON_HELP = "Print exactly one JSON object on stdout (logs go to stderr)."


def json_option(f: Any) -> Any:
    return click.option("--json", "as_json", is_flag=True, help=JSON_HELP)(f)


class Output(click.Path):
    """A path a command writes, checked when the command line is read, before any work."""

    def __init__(self, *, folder: bool = False, suffixes: tuple[str, ...] = ()) -> None:
        super().__init__(path_type=Path)
        self.folder, self.suffixes = folder, suffixes

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        try:
            return check_output(super().convert(value, param, ctx), folder=self.folder, suffixes=self.suffixes)
        except DflopError as exc:
            self.fail(str(exc), param, ctx)


def pipeline_schedule(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--schedule: a known pipeline schedule's canonical name."""
    if value is None:
        return None
    from dflop.program.schedules import canonical

    try:
        return canonical(value)
    except DflopError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def cluster_options(f: Any) -> Any:
    """--gpus and --nodes: the cluster's size instead of the plan file's or the config's."""
    f = click.option("--nodes", type=click.IntRange(1, MAX_GPUS),
                     help="Nodes of the cluster (with --gpus: the GPUs per node follow).")(f)
    return click.option("--gpus", type=click.IntRange(1, MAX_GPUS),
                        help="GPUs of the cluster (in whole nodes of the plan file's or the config's size, "
                             "unless --nodes is given).")(f)


def plan_file(path: Path | None) -> Any:
    """The plan file named by --plan, read before any work."""
    from dflop.specs.plan_file import load_plan

    return load_plan(path) if path is not None else None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors (anywhere on the line).")
@click.version_option(package_name="dflop", prog_name="dflop", message="%(prog)s %(version)s")
def cli(debug: bool) -> None:
    """dflop: data-aware planning, scheduling and simulation of multimodal LLM training."""


# ---- profile ---------------------------------------------------------------------------------

@cli.group()
def profile() -> None:
    """Profile the data (shapes) or the model (measured times)."""


@profile.command("data")
@click.option("--dataset", type=click.Path(path_type=Path),
              help="Manifest (LLaVA, ShareGPT/LLaMA-Factory/ms-swift, InternVL, transformers-style content lists, "
                   "MiniCPM-V, Mantis or preference pairs; JSON or JSON lines) or dataset list (LLaVA-NeXT data "
                   "YAML, InternVL meta JSON).")
@click.option("--format", "fmt", type=click.Choice(["auto", "llava", "sharegpt", "internvl", "content-list",
                                                    "minicpm-v", "mantis", "preference", "data-yaml",
                                                    "meta-json"]), default="auto", show_default=True,
              help="What --dataset is (detected when auto).")
@click.option("--preset", help="Synthetic mix: llava-ov, image-heavy, video-heavy, text-only.")
@click.option("--samples", type=click.IntRange(1, MAX_SAMPLES), help="Samples to draw (preset, default 5000) "
              "or to read at most (dataset).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the preset's draws, of random:N sampling and of InternVL's frame counts.")
@click.option("--encoder", default="siglip-so400m", show_default=True,
              help="Encoder whose tiling rules apply: a preset or a Hugging Face config.json.")
@click.option("--video-newline", type=click.Choice(["grid", "frame", "one_token", "none"]),
              help="Video token layout (LLaVA-NeXT's mm_newline_position; default: the encoder's).")
@click.option("--image-root", type=click.Path(path_type=Path),
              help="Folder image paths are relative to (default: the manifest's folder).")
@click.option("--video-root", type=click.Path(path_type=Path),
              help="Folder video paths are relative to (default: --image-root, else the manifest's folder).")
@click.option("--tokenizer", type=click.Path(path_type=Path),
              help="Count text tokens with this tokenizer.json (or checkpoint folder); default: estimate.")
@click.option("--skip-bad", is_flag=True, help="Skip and count malformed entries instead of failing.")
@click.option("--plot", type=Output(suffixes=IMAGE_SUFFIXES), help="Also draw the shape distributions here.")
@click.option("--out", type=Output(), required=True, help="Data profile (JSON) to write.")
@json_option
def profile_data(dataset: Path | None, fmt: str, preset: str | None, samples: int | None, seed: int,
                 encoder: str, video_newline: str | None, image_root: Path | None, video_root: Path | None,
                 tokenizer: Path | None, skip_bad: bool, plot: Path | None, out: Path, as_json: bool) -> None:
    """Record the per-sample shapes of a dataset or a synthetic mix."""
    from dataclasses import replace

    from dflop.specs.resolve import encoder_spec
    from dflop.workload import profile_dataset, profile_mix

    if (dataset is None) == (preset is None):
        raise click.UsageError("give exactly one of --dataset and --preset")
    enc = encoder_spec(encoder, "--encoder")
    if video_newline is not None:
        enc = replace(enc, tiling=replace(enc.tiling, video_newline=video_newline))
    if preset is not None:
        prof = profile_mix(preset, samples or 5000, enc, seed)
    else:
        prof = profile_dataset(dataset, enc, format=fmt, image_root=image_root, video_root=video_root,
                               tokenizer=tokenizer, skip_bad=skip_bad, samples=samples, seed=seed)
        _log_skips(prof.source)
    prof.save(out)
    summary = prof.summary()
    result: dict[str, Any] = {"out": str(out), "source": prof.source, "samples": summary["samples"],
                              "skipped": prof.source.get("skipped", 0),
                              "modalities": summary["modalities"], "all": summary["all"]}
    if plot is not None:
        from dflop.viz.data import plot_data_profile

        result["plot"] = str(plot_data_profile(prof, plot))
    emit(result, as_json, _data_profile_text)


def _log_skips(source: dict[str, Any]) -> None:
    """The --skip-bad summary on stderr: a count per reason and a few examples of each."""
    if not source.get("skipped"):
        return
    reasons = ", ".join(f"{n} {reason}" for reason, n in source["skipped_reasons"].items())
    log(f"dflop: skipped {source['skipped']} bad entries: {reasons}")
    for example in source["skipped_examples"]:
        log(f"  {example}")


def _data_profile_text(r: dict[str, Any]) -> str:
    src = r["source"]
    lines = [f"data profile of {r['samples']} samples -> {r['out']}"
             + (f" ({r['skipped']} bad entries skipped)" if r["skipped"] else "")]
    lines.append(f"  rule: {src['rule']} (encoder {src['encoder']})")
    if src.get("kind") == "dataset":
        renamed = src["renamed_ids"]
        lines.append(f"  text tokens: {src['text_tokens']}"
                     + (f"; {renamed} repeated ids renamed id#2, id#3, ..." if renamed else ""))
        for s in src["sources"] if len(src["sources"]) > 1 else []:
            skipped = f", {s['skipped']} skipped" if s["skipped"] else ""
            lines.append(f"  source {s['name']:<16} {s['samples']:>7} samples of {s['entries']} entries "
                         f"({s['sampling']}, {s['format']}){skipped}")
    for name, block in {**r["modalities"], "all": r["all"]}.items():
        lines.append(f"  {name:<12} {block['count']:>7} ({block['share']:6.1%})")
        lines.append(f"      tiles       {fmt_stats(block['tiles'])}")
        lines.append(f"      LLM tokens  {fmt_stats(block['llm_tokens'])}")
    if "plot" in r:
        lines.append(f"plot -> {r['plot']}")
    return "\n".join(lines)


@profile.command("model")
@click.option("--model", "model_name", required=True, help="Model preset (encoder or LLM), e.g. tiny-llm.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--dtype", default=None, help="float32, bfloat16 or float16 (default: float32 on CPU, "
              "bfloat16 on CUDA).")
@click.option("--tp", "tps", type=click.IntRange(min=1), multiple=True,
              help="Tensor-parallel degrees to profile (repeatable; default 1): with --processes, in real TP "
                   "groups; alone, one shard with its collectives left to the cost model.")
@click.option("--grid", type=click.Choice(["cpu", "gpu", "quick"]), default=None,
              help="Shapes to measure (default: cpu or gpu by device).")
@click.option("--repeats", type=click.IntRange(min=1), default=None, help="Timed repeats per shape (median kept).")
@click.option("--llm", "pair_llm", default=None, help="For an encoder: the LLM its projector maps into.")
@click.option("--processes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Measure while this many processes run the same shapes in lock-step (cpu): the way the "
                   "torch backend's ranks share the machine; TP degrees run in gloo groups of that size.")
@click.option("--fsdp", is_flag=True, help="With --processes: also what FSDP2 adds to each unit (all-gather, "
              "reduce-scatter) over a data-parallel group of all the processes, as ZeRO-2/3 plans run.")
@click.option("--out", type=Output(folder=True), required=True, help="Profile store folder.")
@json_option
def profile_model(model_name: str, device: str, dtype: str | None, tps: tuple[int, ...], grid: str | None,
                  repeats: int | None, pair_llm: str | None, processes: int, fsdp: bool, out: Path,
                  as_json: bool) -> None:
    """Measure one block's forward/backward time and memory over a grid of shapes."""
    from dflop.cli.progress import progress_bar
    from dflop.cost.profiled import holdout_error
    from dflop.cost.store import ProfileStore
    from dflop.profile.profiler import check_request
    from dflop.profile.profiler import profile_model as run_profile

    check_request(model_name, out, device=device, dtype=dtype, grid=grid, llm=pair_llm,
                  processes=processes, tps=tps or (1,), fsdp=fsdp)  # before the estimate
    if device == "cpu":
        _warn_cpu_profile(model_name, grid, tps or (1,), repeats, pair_llm)
    with progress_bar(f"profiling {model_name}", "shapes") as progress:
        report = run_profile(model_name, out, device=device, dtype=dtype, tps=tps or (1,), grid=grid,
                             llm=pair_llm, repeats=repeats, processes=processes, progress=progress, fsdp=fsdp)
    records = [r for r in ProfileStore(report.store).read(log) if r["model"] == model_name.strip().lower()]
    data = {"store": str(report.store), "measured": report.measured, "reused": report.reused,
            "measured_again": report.again, "records": len(records), "holdout_error": holdout_error(records)}
    again = f" ({len(report.again)} of them twice, off their neighbours the first time)" if report.again else ""
    emit(data, as_json, lambda r: (f"{r['measured']} shapes measured{again}, {r['reused']} already in {r['store']}; "
                                   f"held-out error median {r['holdout_error']['median']:.1%}, "
                                   f"max {r['holdout_error']['max']:.1%}"))


@profile.command("check")
@click.option("--profiles", "folders", type=click.Path(path_type=Path), multiple=True,
              help="Profile store folder to check (repeatable). Default: the profiles that ship with dflop.")
@click.option("--model", "model_names", multiple=True,
              help="Model to check (repeatable). Default: every model the profiles hold on this device.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--llm", "pair_llm", default=None, help="For an encoder: the LLM its projector maps into.")
@click.option("--tokens", type=click.IntRange(min=1), default=None,
              help="LLMs: measure around microbatches of this many tokens (default: the middle of the grid).")
@click.option("--tiles", type=click.IntRange(min=1), default=None,
              help="Encoders: measure around microbatches of this many tiles (default: the middle of the grid).")
@click.option("--repeats", type=click.IntRange(min=1), default=None, help="Timed repeats per shape (median kept).")
@json_option
def profile_check(folders: tuple[Path, ...], model_names: tuple[str, ...], device: str, pair_llm: str | None,
                  tokens: int | None, tiles: int | None, repeats: int | None, as_json: bool) -> None:
    """Measure some of a profile's shapes again: how far this machine has moved since it was measured."""
    from dflop.cli.progress import progress_bar
    from dflop.cost.store import load_records
    from dflop.profile.drift import measure_drift, overall_ratio
    from dflop.profile.profiler import device_name, require_device

    require_device(device)
    for folder in folders:
        if not folder.is_dir():
            raise DflopError(f"--profiles {folder}: not a folder")
    records = load_records(folders, log, shipped=not folders)
    where = device_name(device)
    names = model_names or tuple(sorted({r["model"] for r in records if r["device"] == where}))
    if not names:
        raise DflopError(f"--profiles: no records measured on {where}")
    drifts = []
    for name in names:
        with progress_bar(f"checking {name}", "shapes") as progress:
            drifts.append(measure_drift(records, name, device=device, llm=pair_llm, tokens=tokens, tiles=tiles,
                                        repeats=repeats, progress=progress))
    data = {"device": where, "ratio": overall_ratio(drifts),
            "models": [{"model": d.model, "processes": d.processes, "threads": d.threads, "dtype": d.dtype,
                        "measured_at": d.measured_at, "ratio": d.ratio, "parts": [{"tp": tp, "part": part, "ratio": r}
                                                    for (tp, part), r in d.parts().items()],
                        "shapes": [{"tp": s.record["tp"], "part": s.record["phase"], "shape": s.record["shape"],
                                    "then_ms": s.then_ms, "now_ms": s.now_ms} for s in d.shapes]}
                       for d in drifts]}
    emit(data, as_json, _profile_check_text)


def _profile_check_text(r: dict[str, Any]) -> str:
    lines = []
    for m in r["models"]:
        parts = "  ".join(f"tp{p['tp']} {p['part']} {p['ratio']:.2f}x" for p in m["parts"])
        size = "tiles" if "tiles" in m["shapes"][0]["shape"] else "tokens"
        at = ", ".join(str(v) for v in sorted({s["shape"][size] for s in m["shapes"]}))
        threads = f"{m['threads']} thread{'s' if m['threads'] > 1 else ''}"
        lines.append(f"{m['model']} ({m['dtype']}, {m['processes']} processes x {threads}, measured from "
                     f"{m['measured_at'][:16]}), at {at} {size}: {m['ratio']:.2f}x the time recorded\n  {parts}")
    off = 1 / r["ratio"] - 1
    lines.append(f"this {r['device']} runs the profile's shapes in {r['ratio']:.2f}x the time it records: it prices "
                 f"them {abs(off):.0%} too {'long' if off > 0 else 'short'} here now"
                 + ("; measure it again (dflop profile model) where that matters" if abs(off) > 0.1 else ""))
    return "\n".join(lines)


def _warn_cpu_profile(model_name: str, grid: str | None, tps: tuple[int, ...], repeats: int | None,
                      llm: str | None) -> None:
    """Say, before starting, how long profiling on this CPU may take; warn when it is long."""
    from dflop.profile.estimate import WARN_S, duration, profile_estimate
    from dflop.specs import presets

    cpu = presets.hardware("cpu")
    est = profile_estimate(model_name, cpu, grid=grid, tps=tps, repeats=repeats, llm=llm)
    basis = (f"{est.shapes} shapes, the largest block {est.largest_flops:.2g} FLOPs forward, at the cpu preset's "
             f"{cpu.peak_flops:.2g} FLOP/s peak")
    if est.seconds < WARN_S:
        log(f"dflop: profiling {model_name} on cpu: about {duration(est.seconds)} ({basis})")
    else:
        log(f"dflop: warning: profiling {model_name} on cpu may take about {duration(est.seconds)} ({basis}); "
            "--grid quick measures fewer shapes, --device cuda runs faster")


# ---- plan, schedule, simulate, run -------------------------------------------------------------

CALIBRATE_HELP = ("With a profile measured on another machine: measure a few of its shapes here first and scale "
                  "its times to this machine (the CPU profiles; not a GPU's profile on a machine without that GPU).")


ERROR_HELP = ("Per-sample prediction error (lognormal sigma) the speedups are also reported at (default: the "
              "profiled model's held-out error, or 0.2 for the analytical model).")


def _not_nan(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """NaN passes FloatRange (every comparison with it is false): refuse it here."""
    if value is not None and value != value:
        raise click.BadParameter("nan is not a number")
    return value


prediction_error_option = click.option("--prediction-error", "error", callback=_not_nan, help=ERROR_HELP,
                                       type=click.FloatRange(0.0, MAX_PREDICTION_ERROR))


def _pct(x: float | None) -> str:
    return f"{x:.1%}" if x is not None else "n/a"


def _idle(r: dict[str, Any]) -> str:
    """``idle 12.0% (encoder 30.1%, LLM 5.2%)``: which module's GPUs wait, when there is more than one."""
    from dflop.trace.metrics import MODULE_GROUP_NAMES

    groups = r.get("idle_by_module") or {}
    parts = ", ".join(f"{MODULE_GROUP_NAMES.get(g, g)} {v:.1%}" for g, v in sorted(groups.items()))
    return f"idle {_pct(r['idle_fraction'])}" + (f" ({parts})" if len(groups) > 1 else "")


def _gains(d: dict[str, Any]) -> str:
    """' = [layout gain x] plan gain x balance gain': the layout gain where dflop's plan has an encoder phase."""
    layout = d.get("layout_gain", 1.0)
    return (" = " + (f"layout gain {layout:.2f}x x " if layout != 1.0 else "")
            + f"plan gain {d['plan_gain']:.2f}x x balance gain {d['balance_gain']:.2f}x")


def baseline_lines(r: dict[str, Any]) -> list[str]:
    """The baselines table, the speedup and its decomposition, at zero and at the prediction error."""
    lines = ["baselines (space / batching: best plan; the same plan with dflop's bins):"]
    for b in r["baselines"]:
        name = f"{b['space']} / {b['batching']}"
        if b["plan"] is None:
            lines.append(f"  {name:<28} no plan: {b['reason']}")
            continue
        balanced = b["balanced_step_time_s"]
        lines.append(f"  {name:<28} {b['step_time_s']:7.3f} s  MFU {_pct(b['mfu'])}  [{b['plan']}]"
                     + (f"; with dflop's bins {balanced:.3f} s" if balanced is not None else ""))
    if r["speedup"] is not None:
        d = r["decomposition"]
        lines.append(f"speedup {r['speedup']:.2f}x against the strongest baseline ({r['baseline']['space']} / "
                     f"{r['baseline']['batching']})" + (_gains(d) if d else ""))
    e = r.get("prediction_error")
    if e:
        lines.append(f"at {e['sigma']:.0%} per-sample prediction error ({e['source']}): speedup {e['speedup']:.2f}x"
                     + (_gains(e) if e.get("plan_gain") else ""))
    lines += [f"warning: {w}" for w in r.get("warnings", [])]
    return lines


@cli.command()
@click.option("--config", type=click.Path(path_type=Path), help="Run config (default: the embedded one).")
@cluster_options
@prediction_error_option
@click.option("--out", type=Output(), required=True, help="Plan (YAML) to write, with the cluster it is made for.")
@click.option("--calibrate", is_flag=True, help=CALIBRATE_HELP)
@click.option("--max-seconds", type=click.FloatRange(0.0, min_open=True), callback=_not_nan,
              help="Search deadline: then the best plan found so far, with what was not searched.")
@click.option("--workers", type=click.IntRange(min=1), help="Processes the searches are spread over (default: "
              "one per CPU core this process may use; the plan is the same for any number).")
@json_option
def optimize(config: Path | None, gpus: int | None, nodes: int | None, error: float | None, out: Path,
             calibrate: bool, max_seconds: float | None, workers: int | None, as_json: bool) -> None:
    """Choose tensor/pipeline/data parallelism for the encoder and the LLM."""
    from dflop.cli.progress import progress_bar
    from dflop.cost.select import prediction_error
    from dflop.jobs.calibrate import planning_setup
    from dflop.jobs.optimize import optimize as optimize_
    from dflop.jobs.report import optimize_json
    from dflop.plan.search import usable_cores
    from dflop.specs.plan_file import save_plan

    s = planning_setup(config, calibrate, log, gpus=gpus, nodes=nodes)
    with progress_bar() as progress:
        result = optimize_(s, progress=progress, noise=error, max_seconds=max_seconds,
                           workers=workers or usable_cores())
    save_plan(result.best.plan, out, s.system.cluster)
    source = prediction_error(s.system.cost)[1] if error is None else "given with --prediction-error"
    data = {**optimize_json(result, s.system.hardware.usable_memory_bytes, source), "out": str(out)}

    def human(r: dict[str, Any]) -> str:
        p = r["plan"]
        lines = [f"plan: {p['describe']} ({p['batching']} bins)  -> {r['out']}",
                 f"  expected step {p['step_time_s']:.3f} s (+-{p['ci95_s']:.3f}, {p['batches']} batches)"
                 + (f", simulated {p['simulated_step_time_s']:.3f} s" if p["simulated_step_time_s"] else "")
                 + f"; MFU {_pct(p['mfu'])}, HFU {_pct(p['hfu'])}",
                 f"  bubbles {p['bubble_fraction']:.1%}, idle {p['idle_fraction']:.1%}, "
                 f"memory {p['peak_memory_gib']:.1f} of {r['usable_memory_gib']:.1f} GiB per GPU"]
        lines += baseline_lines(r)
        lines.append(f"ideal (all compute spread evenly): {r['ideal_step_time_s']:.3f} s")
        lines += ["alternatives (simulated where confirmed):"] + [
            f"  {a['simulated_step_time_s'] or a['step_time_s']:.3f} s  {a['plan']} ({a['batching']})"
            for a in r["alternatives"]]
        lines += ["why:"] + [f"  {w}" for w in r["why"]]
        lines.append(f"search: {r['search_seconds']:.1f} s; " + "; ".join(
            f"{k}: {v['enumerated']} plans, {v['pruned_memory']} too big, {v['pruned_bound']} bounded out, "
            f"{v['evaluated']} evaluated" for k, v in r["pruning"].items()))
        if r["not_searched"]:
            lines.append(r["not_searched"])
        return "\n".join(lines)

    emit(data, as_json, human)


@cli.command()
@click.option("--items", type=click.Path(path_type=Path), required=True,
              help='JSON {"items": [{"id": ..., "cost": [c_enc, c_llm, ...]}, ...]}; ids (strings, numbers '
                   'or booleans) come back as given and must be unique.')
@click.option("--bins", type=click.IntRange(min=1), required=True, help="Number of bins.")
@click.option("--solver", default="auto", show_default=True,
              help=f"{', '.join(Solver)} (any case); sequential is arrival order, the data-blind baseline.")
@click.option("--time-limit", type=float, default=1.0, show_default=True,
              help="Seconds the solver may take (finite, above 0).")
@json_option
def schedule(items: Path, bins: int, solver: str, time_limit: float, as_json: bool) -> None:
    """Partition items with cost vectors into balanced bins.

    \b
    status says how much is known about the answer, whatever the solver:
      optimal    the makespan equals a proven lower bound
      feasible   a search for better ran (auto, ilp, greedy) and stopped
                 without a proof (deadline, local optimum, within 0.01%)
      heuristic  one constructive pass (lpt, kk, sequential, random),
                 no search for better
    """
    from dflop.schedule.items import read_items
    from dflop.schedule.problem import PartitionProblem
    from dflop.schedule.solve import partition
    from dflop.specs import scheduling

    name = scheduling.solver(solver, "--solver")
    limit = scheduling.time_limit(time_limit, "--time-limit")
    ids, costs = read_items(items)
    try:
        problem = PartitionProblem(costs, bins, ids=ids)
    except DflopError as exc:
        raise DflopError(f"{items}: {exc}") from None
    result = partition(problem, name, time_limit=limit)
    data = {"bins": result.bins(ids), "makespan": result.makespan, "lower_bound": result.lower_bound,
            "gap": result.gap, "solver": result.solver, "status": result.status.value, "seconds": result.seconds,
            "loads": result.loads.tolist()}

    def human(r: dict[str, Any]) -> str:
        return (f"{len(r['bins'])} bins, makespan {r['makespan']:.6g}, lower bound {r['lower_bound']:.6g}, "
                f"gap {r['gap']:.4%} ({r['status']}, {r['solver']}, {r['seconds'] * 1e3:.1f} ms)")

    emit(data, as_json, human)


@cli.command()
@click.option("--config", type=click.Path(path_type=Path), help="Run config (default: the embedded one).")
@click.option("--plan", "plan_path", type=click.Path(path_type=Path),
              help="Plan YAML to simulate, on the cluster it was made for (default: the config's plan, else "
                   "the optimizer's choice).")
@cluster_options
@click.option("--schedule", "schedule_name", callback=pipeline_schedule,
              help="Pipeline schedule (overrides the plan's).")
@click.option("--steps", type=click.IntRange(1, MAX_STEPS), help="Steps to simulate.")
@click.option("--out", type=Output(folder=True), default=Path("out/simulate"), show_default=True)
@click.option("--calibrate", is_flag=True, help=CALIBRATE_HELP)
@json_option
def simulate(config: Path | None, plan_path: Path | None, gpus: int | None, nodes: int | None,
             schedule_name: str | None, steps: int | None, out: Path, calibrate: bool, as_json: bool) -> None:
    """Simulate a plan on the workload; write the trace and the timeline."""
    from dflop.jobs.calibrate import planning_setup
    from dflop.jobs.report import gpu_note, plan_summary, step_fields
    from dflop.jobs.simulate import pick_plan, simulate as simulate_
    from dflop.viz.timeline import plot_timeline

    s = planning_setup(config, calibrate, log, gpus=gpus, nodes=nodes, plan_file=plan_file(plan_path))
    plan = pick_plan(s, schedule_name)
    ensure_writable_folder(out, "output")
    sim, info = simulate_(s, plan, steps=steps or s.config.steps, solver=s.config.scheduler.solver, out=out,
                          name="simulate")
    timeline = plot_timeline(sim.trace, out / "timeline.png")
    from dflop.plan.report import implausible

    data = {"plan": plan_summary(plan), **step_fields(sim, s.system.training.global_batch),
            "steps": sim.metrics.steps, "gpus": s.system.cluster.gpus, "plan_gpus": plan.gpus,
            "note": gpu_note(plan, s.system.cluster.gpus), "cost_model": s.system.cost.name,
            "scheduler": info["scheduler"], "oom": sim.metrics.oom[:5],
            "warnings": implausible("plan", sim.metrics.mfu, s.system.hardware),
            "artifacts": {"trace": info["trace"], "timeline": str(timeline)}}

    def human(r: dict[str, Any]) -> str:
        return "\n".join([
            f"plan: {r['plan']['describe']}" + (f" ({r['note']})" if r["note"] else ""),
            f"  {r['steps']} steps, step {r['step_time_s']['mean']:.3f} s (p50 {r['step_time_s']['p50']:.3f}), "
            f"{r['throughput_samples_per_s']:.1f} samples/s",
            f"  MFU {_pct(r['mfu'])}, HFU {_pct(r['hfu'])}; bubbles {r['bubble_fraction']:.1%}, "
            f"{_idle(r)}, peak memory {r['peak_memory_gib']:.1f} GiB, "
            f"{r['oom_events']} out-of-memory events",
            *_fewer_microbatches(r["scheduler"]), *[f"warning: {w}" for w in r["warnings"]],
            f"trace -> {r['artifacts']['trace']}", f"timeline -> {r['artifacts']['timeline']}"])

    emit(data, as_json, human)


def backend_name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """--backend: a backend of the registry (any case), read when the command runs."""
    from dflop.backends.base import BACKENDS

    if value.strip().lower() not in BACKENDS:
        raise click.BadParameter(f"{value!r} is not one of {', '.join(repr(b) for b in BACKENDS)}.", ctx, param)
    return value


@cli.command()
@click.option("--config", type=click.Path(path_type=Path), help="Run config (default: the embedded one of the backend).")
@click.option("--backend", default="sim", show_default=True, callback=backend_name,
              help="sim: the SimPy simulator on the cost model; torch: trains the models for real on local "
                   "processes it spawns (or under torchrun), each step timed next to the simulator's prediction.")
@click.option("--plan", "plan_path", type=click.Path(path_type=Path),
              help="Run this plan (on the cluster it was made for) against itself on arrival-order batches, "
                   "instead of searching one.")
@cluster_options
@click.option("--steps", type=click.IntRange(1, MAX_STEPS), help="Steps to run.")
@prediction_error_option
@click.option("--out", type=Output(folder=True), default=Path("out/run"), show_default=True)
@click.option("--resume", type=click.Path(exists=True, file_okay=False, writable=True, path_type=Path),
              help="Continue the checkpointed torch run in this folder "
              "(its plans and schedules; needs execution.checkpoint_every in the config).")
@click.option("--init-from", "init_from", type=click.Path(path_type=Path), metavar="CHECKPOINT",
              help="torch: start a new run, with plans of its own, from another run's checkpoint (a step-NNNNNN "
                   "folder, a folder of them: the newest, or a run's --out folder: its dflop arm's newest), at "
                   "its step, resharded onto each arm's plan (execution.init_from).")
@click.option("--no-calibrate", "no_calibrate", is_flag=True,
              help="torch: report predictions on the profile as recorded, without first measuring a few of its "
                   "shapes here and scaling them (execution.calibrate: false).")
@click.option("--no-warmup", "no_warmup", is_flag=True,
              help="torch: time the first step as it comes, without first running the heaviest step's graph "
                   "once, untimed (execution.warmup: false).")
@json_option
def run(config: Path | None, backend: str, plan_path: Path | None, gpus: int | None, nodes: int | None,
        steps: int | None, error: float | None, out: Path, resume: Path | None, init_from: Path | None,
        no_calibrate: bool, no_warmup: bool, as_json: bool) -> None:
    """Plan, schedule every step and execute it: simulated (sim), or trained for real (torch); compare with the
    strongest baseline (with --plan: the same plan on arrival-order batches)."""
    from dflop.backends.base import get_backend
    from dflop.cli.progress import progress_bar
    from dflop.jobs.run import run as run_

    planned = plan_file(plan_path)
    with progress_bar() as progress:
        data = run_(get_backend(backend), config, steps=steps, out=out, resume=resume, progress=progress,
                    channel=progress.channel, plan_file=planned, gpus=gpus, nodes=nodes, noise=error,
                    calibrate=False if no_calibrate else None, init_from=init_from,
                    warmup=False if no_warmup else None)
    if data is not None:  # under torchrun only rank 0 reports
        emit(data, as_json, _run_human)


def _fewer_microbatches(scheduler: dict[str, Any]) -> list[str]:
    """A line where dflop's scheduler gave some replica fewer microbatches than the plan's (its first such
    step's count per replica)."""
    fewer = scheduler.get("fewer_microbatches")
    if not fewer:
        return []
    return [f"variable microbatches per rank in {len(fewer)} step(s): k = {fewer[0]['per_rank']} at step "
            f"{fewer[0]['step'] + 1}" + (", ..." if len(fewer) > 1 else "")]


def _run_human(r: dict[str, Any]) -> str:
    """The run in a few lines; where the backend trains, each arm's measured step split into step
    graph and optimizer, and its losses."""
    def arm(name: str, x: dict[str, Any], rule: str) -> list[str]:
        lines = [f"{name:<9} {rule}{x['plan']['describe']} ({x['batching']} bins)",
                 f"          step {x['step_time_s']['mean']:.3f} s, {x['throughput_samples_per_s']:.1f} samples/s, "
                 f"MFU {_pct(x['mfu'])}, HFU {_pct(x['hfu'])}, bubbles {x['bubble_fraction']:.1%}, {_idle(x)}"]
        if "graph_time_s" in x:
            lines.append(f"          measured step = step graph {x['graph_time_s']['mean']:.3f} s + optimizer "
                         f"{x['optimizer_time_s']['mean']:.3f} s; predicted graph "
                         f"{x['predicted_step_time_s']['mean']:.3f} s ({x['measured_prediction_error']:+.1%} after step 1)")
        if warm := x.get("warmup"):
            lines.append(f"          warmed up first: step {warm['step'] + 1}'s graph once, untimed, in {warm['seconds']:.2f} s")
        if "losses" in x:
            lines.append(f"          loss {x['losses'][0]:.4f} -> {x['losses'][-1]:.4f}")
        return lines

    b, d = r["baseline"], r["decomposition"] or {}
    trained = "losses" in r
    where = f"{r['plan_gpus']} {r['device']} processes ({r['backend']})" if trained else f"{r['gpus']} x {r['hardware']}"
    lines = [f"{r['model']} on {where}, {r['data']}, global batch {r['global_batch']}, {r['steps']} steps"]
    if start := r["init_from"]:
        lines.append(f"from      {start['checkpoint']}: steps {start['step'] + 1} to {start['step'] + r['steps']}")
    if c := r.get("calibration"):
        lines.append(f"calibration: shapes ran {c['ratio']:.2f}x the recorded time here; predictions scaled "
                     f"(uncalibrated: predicted graph {r['uncalibrated_predicted_step_time_s']['mean']:.3f} s, "
                     f"{r['uncalibrated_prediction_error']:+.1%})")
    lines += arm("dflop", r, "") + [f"          {x}" for x in _fewer_microbatches(r["scheduler"])]
    lines += arm("baseline", b, f"{b['space']}: ")
    lines.append(f"speedup   {r['speedup']:.2f}x {'measured' if trained else 'simulated'}"
                 + (f" = plan gain {d['plan_gain']:.2f}x x balance gain {d['balance_gain']:.2f}x" if d else "")
                 + " (" + (f"{r['predicted_speedup']:.2f}x predicted; " if trained else "")
                 + f"the optimizer expected {r['expected']['speedup']:.2f}x)")
    e = r["prediction_error"]
    if e:
        lines.append(f"          {e['speedup']:.2f}x expected at {e['sigma']:.0%} per-sample prediction error "
                     f"({e['source']})")
    lines += [f"warning: {w}" for w in r["warnings"]]
    lines.append(f"timeline  {r['artifacts']['timeline']}")
    return "\n".join(lines)


@cli.group()
def plot() -> None:
    """Draw pictures from traces."""


def _step_choice(ctx: click.Context, param: click.Parameter, value: str | None) -> int | str | None:
    """--step: a step number from 1, or 'all'."""
    if value is None:
        return None
    if value.lower() == "all":
        return "all"
    if not value.isdigit() or int(value) < 1:
        raise click.BadParameter(f"{value!r} is neither a step number (1, 2, ...) nor 'all'")
    return int(value)


@plot.command("timeline")
@click.argument("trace", type=click.Path(path_type=Path))
@click.option("--out", type=Output(suffixes=IMAGE_SUFFIXES), required=True,
              help=f"Picture to write ({', '.join(IMAGE_SUFFIXES)}).")
@click.option("--compare", type=click.Path(path_type=Path), help="A second trace, drawn below on the same axis.")
@click.option("--step", callback=_step_choice, metavar="K|all",
              help="Draw step K (1 = the first) or all steps (default: the first step).")
@click.option("--window", type=(float, float), metavar="START END",
              help="Zoom to this time window, in seconds from the drawn step's start (from the trace's start "
                   "with --step all).")
@json_option
def plot_timeline(trace: Path, out: Path, compare: Path | None, step: int | str | None,
                  window: tuple[float, float] | None, as_json: bool) -> None:
    """Bubble timeline of a trace: one row per rank, compute and communication apart."""
    from dflop.trace.chrome import load_trace
    from dflop.trace.metrics import metrics
    from dflop.viz.timeline import draw, layout

    doc = load_trace(trace)
    other = load_trace(compare) if compare is not None else None
    labels = (trace.stem, compare.stem) if compare is not None else ("", "")
    drawn = layout(doc, compare=other, labels=labels, step=step, window=window)
    path = draw(drawn, out)
    data = {"out": str(path), "metrics": metrics(doc).as_dict(), "step": step or 1, "window": list(drawn.window),
            "panels": [{"title": p.title, "rows": len(p.rows), "bars": p.counts()} for p in drawn.panels]}
    emit(data, as_json, lambda r: f"timeline -> {r['out']} ({r['panels'][0]['title'].splitlines()[-1]})")


class ExportForms(click.Group):
    """`dflop export PLAN ...` (the plan form, whose first word is a file) and `dflop export checkpoint
    RUN_DIR ...`: a first word that names no form is the plan form's PLAN."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = ["plan", *args]
        return super().parse_args(ctx, args)


@cli.group("export", cls=ExportForms)
def export_forms() -> None:
    """Write a plan, or a run's trained weights, in another framework's terms.

    \b
    dflop export PLAN --to megatron|torchtitan   the plan as launch arguments (same as `export plan`)
    dflop export checkpoint RUN_DIR --to hf --out DIR
                                                 a torch run's last checkpoint as a Hugging Face folder
    """


@export_forms.command("plan")
@click.argument("plan_path", metavar="PLAN", type=click.Path(path_type=Path))
@click.option("--to", "target", type=click.Choice(["megatron", "torchtitan"], case_sensitive=False), required=True,
              help="megatron: Megatron-LM launch flags; torchtitan: its config overrides (see --torchtitan-version).")
@click.option("--torchtitan-version", type=click.Choice(["0.3", "0.2"]), default="0.3", show_default=True,
              help="With --to torchtitan: 0.3 prints one --section.field value override per line; 0.2 (and "
                   "earlier) a job config TOML fragment.")
@click.option("--config", type=click.Path(path_type=Path),
              help="Run config giving the model and the training settings (default: the embedded one).")
@click.option("--global-batch", type=click.IntRange(1, MAX_GLOBAL_BATCH),
              help="Samples per step (default: the config's).")
@json_option
def export(plan_path: Path, target: str, torchtitan_version: str, config: Path | None, global_batch: int | None,
           as_json: bool) -> None:
    """Write a plan as another framework's launch arguments; say what that framework cannot express."""
    from dflop.jobs.export import export_plan
    from dflop.jobs.setup import check_plan, load_config
    from dflop.specs.hardware import ClusterSpec

    planned = plan_file(plan_path)
    plan = planned.plan
    run_config = load_config(config)
    if planned.cluster is not None:
        cluster = planned.cluster.cluster(run_config.cluster.hardware, planned.where)
    else:  # the plan's own GPU count, in nodes of the config's hardware
        per_node = run_config.cluster.gpus_per_node
        cluster = ClusterSpec(hardware=run_config.cluster.hardware, nodes=-(-plan.gpus // per_node),
                              gpus_per_node=per_node)
    check_plan(plan, f"{plan_path}:", run_config, cluster, global_batch)
    result = export_plan(plan, run_config.model, target, training=run_config.training, cluster=cluster,
                         global_batch=global_batch or run_config.training.global_batch,
                         torchtitan_version=torchtitan_version)
    emit(result.as_dict(), as_json, lambda r: r["text"])


@export_forms.command("checkpoint")
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path(path_type=Path))
@click.option("--to", "target", required=True, metavar="hf",
              help="hf: a Hugging Face folder (safetensors, config.json, the tokenizer and processor files of the "
                   "checkpoint the run started from) that transformers' from_pretrained loads.")
@click.option("--out", type=Output(folder=True), required=True, help="Folder to write (new or empty).")
@json_option
def export_checkpoint(run_dir: Path, target: str, out: Path, as_json: bool) -> None:
    """Write the last checkpoint of a `dflop run --backend torch` (its dflop arm) as a Hugging Face folder."""
    from dflop.jobs.export_checkpoint import export_checkpoint as export_run

    result = export_run(run_dir, target, out)
    emit(result, as_json, lambda r: f"step {r['step']} of {r['run']} -> {r['out']} ({', '.join(r['files'])})")


# ---- entry point -----------------------------------------------------------------------------

_LINE_BREAK = re.compile("[\n\r\x0b\x0c\x1c-\x1e\x85\u2028\u2029]")


def _one_line(message: object) -> str:
    """The message on one line: line breaks it quotes from the input are shown escaped."""
    return _LINE_BREAK.sub(lambda m: repr(m.group())[1:-1], str(message))


def _one_line_warning(message, category, filename, lineno, line=None) -> str:  # noqa: ANN001
    return f"dflop: warning: {_one_line(message)}\n"


def _without_debug(args: list[str]) -> tuple[list[str], bool]:
    """The command line without its ``--debug`` flags (accepted anywhere before a ``--``)."""
    end = args.index("--") if "--" in args else len(args)
    kept = [a for a in args[:end] if a != "--debug"] + args[end:]
    return kept, len(kept) < len(args)


def main(argv: list[str] | None = None) -> int:
    args, debug = _without_debug(list(sys.argv[1:] if argv is None else argv))
    if not debug:
        import warnings

        warnings.formatwarning = _one_line_warning
    try:
        cli.main(args=args, prog_name="dflop", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.Abort as exc:  # click's answer to Ctrl-C; an interrupted run's says how to go on
        cause = exc.__cause__
        log(f"dflop: interrupted: {_one_line(cause)}" if isinstance(cause, KeyboardInterrupt) and str(cause)
            else "dflop: aborted")
        return 130
    except click.ClickException as exc:
        if debug:
            raise
        log(f"dflop: error: {_one_line(exc.format_message())}")
        return 2
    except DflopError as exc:
        if debug:
            details = getattr(exc, "details", "")
            if details:
                log(details)
            raise
        log(f"dflop: error: {_one_line(exc)}")
        return 2
    except KeyboardInterrupt:
        log("dflop: interrupted")
        return 130
    except Exception as exc:  # a bug: say so in one line, the traceback under --debug
        if debug:
            raise
        log(f"dflop: internal error: {type(exc).__name__}: {_one_line(exc)} (rerun with --debug for the traceback)")
        return 1
    return 0


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
