"""`dflop run --backend torch` on a folder used before, with --resume or --init-from, and when it cannot
run or is stopped: a resume continues exactly the run the folder records or refuses in one line naming
what contradicts it; a new run from another run's checkpoint, on another plan, continues that run
exactly or refuses a checkpoint it would not continue; a damaged checkpoint is one line naming it; a
signal stops every process and ends with one line, exit 130. Runs that train are few and tiny (2
processes, 4 steps); most checks stop before any process starts."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from cli_helpers import assert_one_line_error, assert_only_error, dflop_here

from dflop.backends.torch_runtime import backend as torch_backend
from dflop.backends.torch_runtime.progress import WARMUP

pytestmark = pytest.mark.processes

TINY = {"encoder": "tiny-vit", "llm": "tiny-llm", "cluster": {"hardware": "cpu", "nodes": 1, "gpus_per_node": 2},
        "training": {"global_batch": 4}, "data": {"preset": "llava-ov", "samples": 300}, "steps": 4,
        "scheduler": {"solver": "lpt"}, "execution": {"checkpoint_every": 2, "calibrate": False},
        "plan": {"encoder": {"dp": 2}, "llm": {"dp": 2}, "placement": "colocated", "microbatches": 1}}
"""Checkpoints after steps 2 and 4 of each arm (dflop's bins, then arrival order on the same plan);
uncalibrated (a calibrated torch run is ``test_calibration``'s)."""


def write_config(path, **changes):
    config = json.loads(json.dumps(TINY))
    for dotted, value in changes.items():
        *parents, key = dotted.split(".")
        node = config
        for name in parents:
            node = node.setdefault(name, {})
        node[key] = value
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run, made in a folder where an earlier run of more steps left its record, a schedule
    and a checkpoint, beside a file of the user's; in this process, with one CPU core said to be
    free, so that its 2 processes outnumber the cores."""
    folder = tmp_path_factory.mktemp("torch-run")
    config = write_config(folder / "tiny.yaml")
    out = folder / "run"
    (out / "schedules" / "dflop").mkdir(parents=True)
    (out / "schedules" / "dflop" / "step-000007.json").write_text("{}")
    (out / "checkpoints" / "baseline" / "step-000008").mkdir(parents=True)
    (out / "checkpoints" / "baseline" / "step-000008" / "meta.json").write_text('{"step": 8}')
    (out / "run.json").write_text('{"steps": 8}')
    (out / "notes.txt").write_text("the user's")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_backend, "cpu_cores", lambda: 1)
        ran = dflop_here("run", "--backend", "torch", "--config", config, "--out", out, "--json")
    assert ran.returncode == 0, ran.stderr
    return SimpleNamespace(config=config, out=out, stderr=ran.stderr, report=json.loads(ran.stdout))


def unfinished(finished, tmp_path, *, data=False):
    """A copy of the finished run as if it had stopped in dflop's arm (whose newest checkpoint before
    the last step is step 2); the checkpoints' tensor files only when ``data``."""
    out = tmp_path / "run"
    shutil.copytree(finished.out, out, ignore=None if data else shutil.ignore_patterns("*.distcp"))
    (out / "dflop.result.json").unlink()
    return out


def test_a_new_run_into_a_used_folder_clears_the_earlier_run_and_nothing_else(finished):
    out = finished.out
    assert "removed what an earlier run left there" in finished.stderr
    for arm in ("dflop", "baseline"):
        assert sorted(p.name for p in (out / "schedules" / arm).iterdir()) == [f"step-00000{i}.json" for i in range(4)]
        assert sorted(p.name for p in (out / "checkpoints" / arm).iterdir()) == ["step-000002", "step-000004"]
    assert json.loads((out / "run.json").read_text())["steps"] == 4
    assert (out / "notes.txt").read_text() == "the user's"


def test_more_processes_than_cores_are_warned_of_in_one_line(finished):
    warnings = [line for line in finished.stderr.splitlines() if line.startswith("dflop: warning: ")]
    crowded = [line for line in warnings if "processes on" in line]
    assert len(crowded) == 1 and "2 processes on 1 CPU core:" in crowded[0]


def test_progress_moves_on_from_the_search_to_the_steps(finished):
    """Off a terminal, progress lines: once the plan is chosen none says it is still searching, and the
    last says the arms' steps are done."""
    lines = finished.stderr.splitlines()
    chosen = next(i for i, line in enumerate(lines) if line.startswith("dflop: plan ["))
    assert not any(line.startswith("dflop: searching") for line in lines[chosen:])
    assert re.fullmatch(r"dflop: done: \d+ parts in [\d:]+, the last running (baseline|baseline_balanced) "
                        r"\((\d+)/\2 steps\)", lines[-1])


def test_ranks_outnumbering_the_cores_are_predicted_taking_turns_on_them(finished):
    """With one core for 2 processes, both arms' predictions were made with the ranks sharing it (the
    sharing itself: ``test_simulator``)."""
    for report in (finished.report, finished.report["baseline"]):
        assert report["shared_cores"] == 1



def test_each_arm_warms_up_on_a_step_it_runs_unless_told_not_to(finished, continued):
    """The warm-up (its effect on training: none, ``test_torch_backend``) is reported per arm, and
    --no-warmup (the continued run's) leaves it out."""
    for report in (finished.report, finished.report["baseline"]):
        assert report["warmup"]["step"] in range(4) and report["warmup"]["seconds"] > 0
    for report in (continued.report, continued.report["baseline"]):
        assert report["warmup"] is None


def test_resuming_a_finished_run_says_it_is_finished(finished):
    ran = dflop_here("run", "--backend", "torch", "--config", finished.config, "--resume", finished.out)
    assert_only_error(ran, str(finished.out), "this run is finished (4 of 4 steps)", "nothing to resume")


def _edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _checkpoint_past_the_schedules(out):
    past = out / "checkpoints" / "dflop" / "step-000009"
    shutil.copytree(out / "checkpoints" / "dflop" / "step-000004", past)
    _edit_json(past / "meta.json", step=9)


def _other_layout(out):
    path = out / "dflop.plan.yaml"
    plan = yaml.safe_load(path.read_text())
    plan["microbatches"] = 2
    path.write_text(yaml.safe_dump(plan))


def _other_plan_file(out):
    path = out.parent / "other.plan.yaml"
    path.write_text(yaml.safe_dump({**TINY["plan"], "microbatches": 2, "cluster": TINY["cluster"]}))
    return ["--plan", path]


WIDER_LLM = {"name": "tiny-llm", "layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 352, "vocab": 1024}

CONTRADICTIONS = {  # id: (config changes, folder edit returning extra arguments, fragments of the error)
    "another seed": ({"seed": 1}, None, ["run.json: seed: the run was made with 0", "says 1"]),
    "another global batch": ({"training.global_batch": 8}, None, ["training.global_batch", "made with 4", "says 8"]),
    "no checkpoints": ({"execution.checkpoint_every": 0}, None, ["execution.checkpoint_every", "made with 2"]),
    "a model of another width": ({"llm": WIDER_LLM}, None, ["llm.hidden: the run was made with 128", "says 256"]),
    "--steps": ({}, lambda out: ["--steps", "3"], ["steps: the run was made with 4", "--steps says 3"]),
    "--plan": ({}, _other_plan_file, ["plans.dflop.microbatches", "--plan", "other.plan.yaml says 2"]),
    "a plan file edited to another layout": ({}, _other_layout,
                                             ["plans.dflop.microbatches", "dflop.plan.yaml says 2"]),
    "another dflop": ({}, lambda out: _edit_json(out / "run.json", dflop_version="0.0.1"),
                      ["dflop_version: the run was made with '0.0.1'", "this dflop is"]),
    "meta.json step -1": ({}, lambda out: _edit_json(out / "checkpoints/dflop/step-000002/meta.json", step=-1),
                          ["step-000002/meta.json: 'step': expected 2", "got -1"]),
    "a string step in meta.json": ({}, lambda out: _edit_json(out / "checkpoints/dflop/step-000002/meta.json",
                                                              step="2"), ["meta.json: 'step'", "got '2'"]),
    "a meta.json step past the schedules": ({}, lambda out: _edit_json(
        out / "checkpoints/dflop/step-000004/meta.json", step=99), ["dflop/step-000004/meta.json", "got 99"]),
    "a checkpoint past the schedules": ({}, _checkpoint_past_the_schedules,
                                        ["step-000009: a checkpoint after step 9", "the run has 4 steps"]),
}


@pytest.mark.parametrize("case", list(CONTRADICTIONS))
def test_a_resume_that_contradicts_the_run_is_refused_naming_the_field(finished, tmp_path, case):
    changes, edit, fragments = CONTRADICTIONS[case]
    out = unfinished(finished, tmp_path)
    extra = (edit(out) if edit else None) or []
    config = write_config(tmp_path / "resume.yaml", **changes)
    ran = dflop_here("run", "--backend", "torch", "--config", config, "--resume", out, *extra)
    assert_one_line_error(ran, *fragments)
    assert not (out / "dflop.result.json").exists()  # nothing ran


def _cut(path, size):
    path.write_bytes(path.read_bytes()[:size])


DAMAGE = {  # id: (file of dflop's step-2 checkpoint, how it is damaged, fragment of the error)
    "a truncated .distcp": ("__0_0.distcp", lambda p: _cut(p, 1000), "__0_0.distcp: truncated: 1000 bytes"),
    "an empty .distcp": ("__1_0.distcp", lambda p: _cut(p, 0), "__1_0.distcp: truncated: 0 bytes"),
    "a missing .metadata": (".metadata", Path.unlink, ".metadata: missing"),
    "a truncated .metadata": (".metadata", lambda p: _cut(p, 100), ".metadata: unreadable"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_checkpoint_is_one_line_naming_its_file_before_any_process_starts(finished, tmp_path, case):
    name, damage, fragment = DAMAGE[case]
    out = unfinished(finished, tmp_path, data=True)
    damage(out / "checkpoints" / "dflop" / "step-000002" / name)
    ran = dflop_here("run", "--backend", "torch", "--config", finished.config, "--resume", out)
    assert_one_line_error(ran, str(out / "checkpoints" / "dflop" / "step-000002" / name), fragment)


def test_a_checkpoint_the_ranks_cannot_load_is_one_line_naming_it(finished, tmp_path):
    """Whole files of zeros pass every check of sizes; torch's load fails on every rank, raising a
    CheckpointException (a BaseException), which must still be one line, not the ranks' tracebacks."""
    out = unfinished(finished, tmp_path, data=True)
    data = out / "checkpoints" / "dflop" / "step-000002" / "__0_0.distcp"
    data.write_bytes(bytes(data.stat().st_size))
    ran = dflop_here("run", "--backend", "torch", "--config", finished.config, "--resume", out)
    assert_one_line_error(ran, f"{data.parent}: cannot resume from this checkpoint (")
    assert "died" not in ran.stderr


def test_a_crash_in_the_baseline_arm_resumes_that_arm_alone_from_its_own_checkpoint(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished.out, out)
    (out / "baseline.result.json").unlink()
    shutil.rmtree(out / "checkpoints" / "baseline" / "step-000004")  # it stopped in step 3
    kept = {p: p.read_bytes() for p in [out / "dflop.trace.json", *(out / "checkpoints" / "dflop").glob("*/*")]}
    ran = dflop_here("run", "--backend", "torch", "--config", finished.config, "--resume", out, "--json")
    assert ran.returncode == 0, ran.stderr
    r, before = json.loads(ran.stdout), finished.report
    assert r["losses"] == before["losses"] and r["step_time_s"] == before["step_time_s"]  # dflop's arm left as it was
    assert all(p.read_bytes() == data for p, data in kept.items())
    assert r["baseline"]["steps"] == 2  # steps 2 and 3, from its step-2 checkpoint
    assert r["baseline"]["losses"] == pytest.approx(before["baseline"]["losses"][2:], rel=1e-6)
    assert (out / "checkpoints" / "baseline" / "step-000004" / "meta.json").exists()


TP2 = {"encoder": {"tp": 2}, "llm": {"tp": 2}, "placement": "colocated", "microbatches": 1}
"""Another plan than the finished run's dp2 on the same 2 processes: every tensor split another way."""


def _step_2(out):
    return (out / "checkpoints" / "dflop" / "step-000002").resolve()


@pytest.fixture(scope="module")
def continued(finished, tmp_path_factory):
    """A new run on TP2 started with --init-from at the finished dp2 run's step-2 checkpoint."""
    folder = tmp_path_factory.mktemp("init-from")
    config = write_config(folder / "tp2.yaml", plan=TP2)
    out = folder / "run"
    ran = dflop_here("run", "--backend", "torch", "--config", config, "--init-from", _step_2(finished.out),
                     "--no-warmup", "--out", out, "--json")
    assert ran.returncode == 0, ran.stderr
    return SimpleNamespace(config=config, out=out, report=json.loads(ran.stdout))


def test_a_new_run_on_another_plan_continues_another_runs_checkpoint(finished, continued):
    """Both arms start at step 2 with the dp2 run's weights and optimizer states, resharded onto tp2,
    and train steps 2 and 3 on the samples the dp2 run drew, to its losses (float32: the two plans
    round apart, far less than a lost optimizer state or a step from the seed would change)."""
    r, before = continued.report, finished.report
    assert r["init_from"] == {"checkpoint": str(_step_2(finished.out)), "step": 2}
    assert r["plan"]["describe"] != before["plan"]["describe"] and r["steps"] == 2
    for mine, theirs in ((r, before), (r["baseline"], before["baseline"])):
        assert [t["step"] for t in mine["trained"]] == [2, 3]
        assert [t["sample_ids"] for t in mine["trained"]] == [t["sample_ids"] for t in theirs["trained"][2:]]
        assert mine["losses"] == pytest.approx(theirs["losses"][2:], rel=1e-5, abs=0)
    run = json.loads((continued.out / "run.json").read_text())
    assert run["execution"]["init_from"] == str(_step_2(finished.out))


def test_a_resumed_arm_without_a_checkpoint_of_its_own_starts_again_from_init_from(finished, continued, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(continued.out, out)
    (out / "baseline.result.json").unlink()
    shutil.rmtree(out / "checkpoints" / "baseline" / "step-000004")  # it stopped in step 3, before saving
    args = ["run", "--backend", "torch", "--config", continued.config, "--resume", out]
    refused = dflop_here(*args)
    assert_one_line_error(refused, "execution.init_from: the run was made with", "says ''")
    ran = dflop_here(*args, "--init-from", _step_2(finished.out), "--json")
    assert ran.returncode == 0, ran.stderr
    r = json.loads(ran.stdout)
    assert r["init_from"]["step"] == 2 and [t["step"] for t in r["baseline"]["trained"]] == [2, 3]
    assert r["baseline"]["losses"] == pytest.approx(continued.report["baseline"]["losses"], rel=1e-6, abs=0)


def _incomplete(finished, tmp_path):
    path = tmp_path / "step-000002"
    shutil.copytree(_step_2(finished.out), path, ignore=shutil.ignore_patterns("meta.json"))
    return path


INIT_REFUSALS = {  # id: (config changes, the --init-from and other arguments, fragments of the error)
    "another seed": ({"seed": 1}, lambda f, tmp: [_step_2(f.out)],
                     ["step-000002/meta.json: 'seed': this checkpoint was saved with 0, the run has 1"]),
    "a model of another width": ({"llm": WIDER_LLM}, lambda f, tmp: [_step_2(f.out)],
                                 ["meta.json: 'model.llm.hidden': this checkpoint was saved with 128, the run has 256"]),
    "another data pool": ({"data.samples": 400}, lambda f, tmp: [_step_2(f.out)],
                          ["step-000002/meta.json: 'batches': this checkpoint was trained on other global batches "
                           "than this run's first 2"]),
    "another global batch": ({"training.global_batch": 8}, lambda f, tmp: [_step_2(f.out)],
                             ["meta.json: 'batches': this checkpoint was trained on other global batches"]),
    "no step left after it": ({}, lambda f, tmp: [f.out],  # the run folder: its dflop arm's newest, step 4
                              ["dflop/step-000004: a checkpoint after step 4, but this run has 4 steps"]),
    "the simulator": ({}, lambda f, tmp: [_step_2(f.out), "--backend", "sim"],
                      ["--init-from: the sim backend trains no weights to start from a checkpoint"]),
    "no such folder": ({}, lambda f, tmp: [tmp / "nothing"], ["--init-from: ", "nothing: no such folder"]),
    "a folder without checkpoints": ({}, lambda f, tmp: [tmp], ["--init-from: ", "no complete checkpoint"]),
    "a checkpoint without its meta.json": ({}, lambda f, tmp: [_incomplete(f, tmp)],
                                           ["step-000002: not a complete checkpoint (no meta.json"]),
}


@pytest.mark.parametrize("case", list(INIT_REFUSALS))
def test_a_checkpoint_a_new_run_would_not_continue_is_refused_before_any_work(finished, tmp_path, case):
    changes, arguments, fragments = INIT_REFUSALS[case]
    config = write_config(tmp_path / "new.yaml", **changes)
    start, *extra = arguments(finished, tmp_path)
    out = tmp_path / "run"
    ran = dflop_here("run", "--backend", "torch", "--config", config, "--out", out, "--init-from", start, *extra)
    assert_one_line_error(ran, *fragments)
    assert not (out / "run.json").exists()  # nothing planned


def test_init_from_in_a_config_is_relative_to_its_folder(finished, tmp_path):
    """The checkpoint folder named from the config's folder (its newest checkpoint, after step 4: refused
    for a run of 4 steps, by its absolute path, before any work)."""
    (tmp_path / "configs").mkdir()
    named = os.path.relpath(_step_2(finished.out).parent, tmp_path / "configs")
    config = write_config(tmp_path / "configs" / "new.yaml", **{"execution.init_from": named})
    ran = dflop_here("run", "--backend", "torch", "--config", config, "--out", tmp_path / "run")
    assert_one_line_error(ran, f"{_step_2(finished.out).parent}/step-000004: a checkpoint after step 4")


def test_a_checkpoint_of_the_output_folder_is_refused_not_cleared(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished.out, out, ignore=shutil.ignore_patterns("*.distcp"))
    ran = dflop_here("run", "--backend", "torch", "--config", finished.config, "--out", out,
                     "--init-from", _step_2(out))
    assert_one_line_error(ran, "execution.init_from: ", f"is a checkpoint of --out {out}, which this run clears")
    assert (out / "checkpoints" / "dflop" / "step-000002" / "meta.json").exists()


def test_cuda_on_a_machine_without_it_is_one_line_before_any_work(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = write_config(tmp_path / "cuda.yaml", **{"execution.device": "cuda"})
    ran = dflop_here("run", "--backend", "torch", "--config", config, "--out", tmp_path / "run")
    assert_only_error(ran, f"{config}: execution.device: cuda: ")


def test_a_timeout_too_short_to_form_a_process_group_is_refused_naming_the_key(tmp_path):
    config = write_config(tmp_path / "t.yaml", **{"execution.timeout_s": 0.001})
    ran = dflop_here("run", "--backend", "torch", "--config", config, "--out", tmp_path / "run")
    assert_only_error(ran, "execution.timeout_s: must be at least 10, got 0.001")


def _descendants(pid):
    """Processes below ``pid`` (read from /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children + [d for c in children for d in _descendants(c)]


def _alive(pid):
    try:  # a zombie has stopped; only its exit status is left for a parent that is gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _steps_running(tmp):
    """Whether a rank has reached its second step (its progress file, under the run's TMPDIR), the
    warm-up before the first aside."""
    for path in tmp.glob("dflop-progress-*/rank-*.progress"):
        text = path.read_bytes().decode(errors="replace").split()
        if len(text) > 1 and text[0].isdigit() and int(text[0]) >= 1 and text[1] != WARMUP:
            return True
    return False


@pytest.mark.parametrize("how", ["SIGTERM to dflop", "Ctrl-C (SIGINT to the process group)"])
def test_a_signal_stops_every_process_and_ends_in_one_line_with_exit_130(tmp_path, how):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    config = write_config(tmp_path / "long.yaml", steps=40, **{"execution.checkpoint_every": 1})
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "dflop.cli.main", "run", "--backend", "torch", "--config",
                             str(config), "--out", str(out)], env={**os.environ, "TMPDIR": str(tmp)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while not _steps_running(tmp) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None and _steps_running(tmp)
        ranks = _descendants(proc.pid)
        if how.startswith("SIGTERM"):
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines[-1].startswith("dflop: interrupted: the torch run was stopped by SIG"), err
    assert f"its checkpoints are in {out / 'checkpoints'}" in lines[-1] and f"--resume {out}" in lines[-1]
    assert all(line.startswith("dflop: ") for line in lines), err  # nothing from the ranks or the launcher
    deadline = time.monotonic() + 30
    while any(map(_alive, ranks)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(ranks) >= 2 and not any(map(_alive, ranks))
