"""Bad input of every kind fed to every command, in process.

Whatever the input (bytes that are not UTF-8, nesting thousands deep, numbers beyond any range,
values of the wrong type, documents of the wrong shape, missing files, outputs that cannot be
written), a command exits with status 2 and exactly one ``dflop: error:`` line, the last on
stderr, naming the input; prints nothing on stdout and no traceback; and answers within a time
bound.

The data files of ``profile data --dataset`` and ``schedule --items`` are read by their own
packages past the shared reading path (decoding and nesting): only bytes, nesting, integers too
long to convert and missing files are generated for them here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli_helpers import dflop_here
from dflop.specs import ModulePlan, Plan, TrainingSpec, presets, to_mapping
from dflop.specs.execution import ExecutionSpec
from dflop.specs.limits import MAX_DEPTH, MAX_SAMPLES
from dflop.trace.chrome import TraceBuilder

SECONDS = 20.0
"""Time bound for one command on bad input (the first call of a command pays for its imports)."""
FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck))
"""Examples per test: the test profile's (DFLOP_HYPOTHESIS_EXAMPLES, 60 by default)."""
MARK = "@@bad@@"


def assert_refused(ran, name: str) -> None:
    errors = [line for line in ran.stderr.splitlines() if line.startswith("dflop: error: ")]
    assert ran.returncode == 2, (ran.returncode, ran.stderr[-3000:])
    assert len(errors) == 1 and ran.stderr.strip().splitlines()[-1] == errors[0], ran.stderr[-3000:]
    assert "Traceback" not in ran.stderr and "internal error" not in ran.stderr
    assert name in errors[0], (name, errors[0])
    assert ran.stdout == ""
    assert ran.seconds < SECONDS


# ---- generated documents ---------------------------------------------------------------------

def leaves(tree, path=()):
    """(path, value) of every leaf of a tree of mappings and lists."""
    if isinstance(tree, dict) and tree:
        for key, value in tree.items():
            yield from leaves(value, path + (key,))
    elif isinstance(tree, list) and tree:
        for i, value in enumerate(tree):
            yield from leaves(value, path + (i,))
    else:
        yield path, tree


def replaced(tree, path, value):
    if not path:
        return value
    copy = dict(tree) if isinstance(tree, dict) else list(tree)
    copy[path[0]] = value if len(path) == 1 else replaced(tree[path[0]], path[1:], value)
    return copy


def removed(tree, path):
    copy = dict(tree) if isinstance(tree, dict) else list(tree)
    if len(path) == 1:
        del copy[path[0]]
    else:
        copy[path[0]] = removed(tree[path[0]], path[1:])
    return copy


def kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


WRONG_TYPES = [["x", 1], {"unexpected": 1}, "x", 7, 2.5, True]
DIGITS = "9" * 5000
"""An integer of more digits than Python converts from text."""
EXTREMES = [float("inf"), float("-inf"), float("nan"), 1e300, -1e300, 10**31, -(10**31), DIGITS]
NOT_UTF8 = [b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80", b"\xf8\x88\x80\x80\x80"]


HOWS = ("type", "extreme", "depth", "bytes", "missing key", "unknown key", "top")


@st.composite
def mutation(draw, tree, required, hows=HOWS):
    """(how, tree, raw): ``tree`` made wrong in one place, and raw text for the marked place or
    bytes to put in somewhere (see :func:`write`)."""
    how = draw(st.sampled_from(hows))
    paths = [(p, v) for p, v in leaves(tree) if p]
    numbers = [(p, v) for p, v in paths if kind(v) == "number"]
    if how == "extreme" and numbers:
        path, _ = draw(st.sampled_from(numbers))
        extreme = draw(st.sampled_from(EXTREMES))
        if extreme == DIGITS:
            return how, replaced(tree, path, MARK), DIGITS
        return how, replaced(tree, path, extreme), None
    if how in ("type", "extreme"):  # an extreme where there is no number: a wrong type
        path, value = draw(st.sampled_from(paths))
        wrong = draw(st.sampled_from([w for w in WRONG_TYPES if kind(w) != kind(value)]))
        return how, replaced(tree, path, wrong), None
    if how == "depth":
        path, _ = draw(st.sampled_from(paths))
        depth = draw(st.integers(MAX_DEPTH + 1, 3000))
        return how, replaced(tree, path, MARK), "[" * depth + "]" * depth
    if how == "bytes":
        return how, tree, draw(st.sampled_from(NOT_UTF8))
    if how == "missing key":
        return how, removed(tree, draw(st.sampled_from(required))), None
    if how == "unknown key":
        mappings = [p[:-1] for p, _ in paths if isinstance(p[-1], str)]
        where = draw(st.sampled_from(mappings))
        return how, replaced(tree, where + ("no_such_key",), 1), None
    return how, draw(st.sampled_from([[1, 2], "text", 42, None])), None


def write(path: Path, tree, raw, dump, data) -> Path:
    """The document as ``dump`` writes it, with ``raw`` put in at the marked place (or, for bytes,
    at a drawn position)."""
    text = dump(tree)
    if isinstance(raw, bytes):
        body = text.encode()
        at = data.draw(st.integers(0, len(body)))
        path.write_bytes(body[:at] + raw + body[at:])
    else:
        path.write_text(text.replace(f"'{MARK}'", raw or "").replace(f'"{MARK}"', raw or "")
                        .replace(MARK, raw or ""))
    return path


def dump_yaml(tree) -> str:
    return yaml.safe_dump(tree, sort_keys=False) if tree is not None else ""


def dump_json(tree) -> str:
    return json.dumps(tree)


def config_tree() -> dict:
    plan = Plan(encoder=ModulePlan(dp=8), llm=ModulePlan(dp=8), placement="colocated", microbatches=2)
    return {"encoder": to_mapping(presets.encoder("siglip-so400m")), "llm": to_mapping(presets.llm("qwen2.5-7b")),
            "cluster": {"hardware": to_mapping(presets.hardware("h100")), "nodes": 1, "gpus_per_node": 8},
            "training": to_mapping(TrainingSpec(global_batch=16)),
            "data": {"preset": "llava-ov", "samples": 200, "seed": 0},
            "scheduler": {"solver": "lpt", "time_limit": 0.2, "ilp_backend": "cbc"},
            "steps": 1, "seed": 0, "plan": to_mapping(plan), "profiles": [],
            "execution": to_mapping(ExecutionSpec())}


CONFIG_REQUIRED = [("encoder",), ("llm",), ("cluster",), ("training",), ("cluster", "nodes"),
                   ("cluster", "hardware", "peak_flops"), ("training", "global_batch"), ("plan", "microbatches"),
                   ("encoder", "tiling"), ("encoder", "tiling", "tile_tokens"), ("llm", "layers")]
PLAN_REQUIRED = [("encoder",), ("llm",), ("microbatches",)]


def plan_tree() -> dict:
    """A plan file as `dflop optimize` writes it: the plan and the cluster it was made for."""
    plan = Plan(encoder=ModulePlan(dp=8), llm=ModulePlan(dp=8), placement="colocated", microbatches=2)
    return {**to_mapping(plan), "cluster": {"hardware": "h100", "nodes": 1, "gpus_per_node": 8}}


def trace_tree() -> dict:
    t = TraceBuilder(meta={"peak_flops": 1e12})
    t.set_workers([{"name": f"r{r}", "module": "llm", "rank": r, "replica": 0, "gpus": [r]} for r in range(2)])
    for r in range(2):
        t.op(r, 0, f"{r}F0", "F", 1000 * r, 1000 * r + 1000, {"flops": 1e9, "microbatch": 0})
        t.op(r, 1, "p2p", "p2p", 1000 * r + 1000, 1000 * r + 1100)
        t.counter(r, "memory", 1000 * r, 2**30)
    t.step(0, 0, 2000, 2100)
    return t.document()


def test_the_documents_the_fuzz_starts_from_are_valid(tmp_path):
    from dflop.jobs.setup import check_run_config
    from dflop.specs.loading import from_mapping
    from dflop.specs.plan_file import load_plan
    from dflop.specs.resolve import named_spec
    from dflop.specs.run import RunConfig
    from dflop.trace.chrome import check_trace

    check_run_config(from_mapping(RunConfig, config_tree(), "c:", named_spec), "c")
    check_trace(trace_tree(), "t")
    (tmp_path / "plan.yaml").write_text(dump_yaml(plan_tree()))
    assert load_plan(tmp_path / "plan.yaml").cluster.gpus == 8
    path = tmp_path / "t.json"
    path.write_text(dump_json(trace_tree()))
    ran = dflop_here("plot", "timeline", path, "--out", tmp_path / "t.png", "--json")
    assert ran.returncode == 0 and json.loads(ran.stdout)["metrics"]["steps"] == 1


# ---- the commands ----------------------------------------------------------------------------

@FUZZ
@given(data=st.data(), command=st.sampled_from(["optimize", "simulate", "run"]))
def test_bad_run_configs(tmp_path_factory, data, command):
    folder = tmp_path_factory.mktemp("config")
    how, tree, raw = data.draw(mutation(config_tree(), CONFIG_REQUIRED))
    path = write(folder / "run.yaml", tree, raw, dump_yaml, data)
    out = folder / ("plan.yaml" if command == "optimize" else "out")
    assert_refused(dflop_here(command, "--config", path, "--out", out), str(path))


@FUZZ
@given(data=st.data())
def test_bad_plans(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("plan")
    how, tree, raw = data.draw(mutation(plan_tree(), PLAN_REQUIRED))
    path = write(folder / "plan.yaml", tree, raw, dump_yaml, data)
    config = write(folder / "run.yaml", {k: v for k, v in config_tree().items() if k != "plan"}, None, dump_yaml, data)
    assert_refused(dflop_here("simulate", "--config", config, "--plan", path, "--out", folder / "out"), str(path))


WRONG = [None, "x", [1], {"a": 1}, True, "missing"]
BAD_EVENT_FIELDS = {"pid": WRONG + [-1, 2, 1.5], "ts": WRONG + [float("nan"), float("inf"), 1e308],
                    "dur": WRONG + [float("nan"), float("-inf"), 1e308, -1]}


@st.composite
def event_mutation(draw):
    """A trace with one complete or counter event made wrong in a field metrics use."""
    doc = trace_tree()
    events = [i for i, e in enumerate(doc["traceEvents"]) if e.get("ph") in ("X", "C")]
    i = draw(st.sampled_from(events))
    event = dict(doc["traceEvents"][i])
    field = draw(st.sampled_from(["pid", "ts"] + (["dur"] if event["ph"] == "X" else [])))
    bad = draw(st.sampled_from(BAD_EVENT_FIELDS[field]))
    if bad == "missing":
        del event[field]
    else:
        event[field] = bad
    return "event", replaced(doc, ("traceEvents", i), event), None


@FUZZ
@given(data=st.data(), compare=st.booleans())
def test_bad_traces(tmp_path_factory, data, compare):
    folder = tmp_path_factory.mktemp("trace")
    document = mutation(trace_tree(), [("traceEvents",)], hows=("depth", "bytes", "missing key", "top"))
    how, tree, raw = data.draw(st.one_of(event_mutation(), document))
    bad = write(folder / "bad.json", tree, raw, dump_json, data)
    good = write(folder / "good.json", trace_tree(), None, dump_json, data)
    args = (good, "--compare", bad) if compare else (bad,)
    assert_refused(dflop_here("plot", "timeline", *args, "--out", folder / "t.png"), str(bad))


@st.composite
def unreadable(draw, folder: Path, name: str):
    """A file only the shared reading path has to refuse: bad bytes, deep nesting, or none at all."""
    path = folder / name
    how = draw(st.sampled_from(["bytes", "depth", "digits", "missing", "folder"]))
    if how == "bytes":
        body = b'{"items": [{"id": "a", "cost": [1, 2]}]}'
        at = draw(st.integers(0, len(body)))
        path.write_bytes(body[:at] + draw(st.sampled_from(NOT_UTF8)) + body[at:])
    elif how == "depth":
        depth = draw(st.integers(MAX_DEPTH + 1, 20000))
        path.write_text('{"items": ' + "[" * depth + "]" * depth + "}")
    elif how == "digits":
        path.write_text('{"items": [{"id": "a", "cost": [1, ' + DIGITS + ']}]}')
    elif how == "folder":
        path.mkdir()
    return path


@FUZZ
@given(data=st.data())
def test_unreadable_items(tmp_path_factory, data):
    items = data.draw(unreadable(tmp_path_factory.mktemp("items"), "items.json"))
    assert_refused(dflop_here("schedule", "--items", items, "--bins", 2, "--solver", "lpt"), str(items))


@FUZZ
@given(data=st.data(), name=st.sampled_from(["manifest.json", "manifest.jsonl", "data.yaml", "meta.json"]))
def test_unreadable_datasets(tmp_path_factory, data, name):
    dataset = data.draw(unreadable(tmp_path_factory.mktemp("dataset"), name))
    out = dataset.parent / "p.json"
    assert_refused(dflop_here("profile", "data", "--dataset", dataset, "--out", out), str(dataset))
    assert not out.exists()


def test_a_dataset_list_with_a_key_given_twice_is_refused(tmp_path):
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text('[{"id": "x", "conversations": [{"from": "human", "value": "hi"}]}]')
    listed = tmp_path / "data.yaml"
    listed.write_text("datasets:\n  - json_path: a.json\ndatasets:\n  - json_path: b.json\n")
    assert_refused(dflop_here("profile", "data", "--dataset", listed, "--out", tmp_path / "p.json"),
                   f"{listed}:3: not valid YAML (duplicate key 'datasets' (first given on line 1))")


NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=1, max_size=20)


@st.composite
def bad_profile_data(draw, folder: Path):
    """(argv, what the error must name) for `profile data`."""
    out = folder / "p.json"
    blocker = folder / "file"
    blocker.write_text("x")
    preset = ("--preset", "llava-ov")
    case = draw(st.sampled_from(["samples", "seed", "preset", "encoder", "dataset", "out", "plot"]))
    if case == "samples":
        n = draw(st.sampled_from([0, -1, MAX_SAMPLES + 1, 10**30]))
        return (*preset, "--samples", n, "--out", out), "--samples"
    if case == "seed":
        return (*preset, "--seed", draw(st.integers(max_value=-1)), "--out", out), "--seed"
    if case == "preset":
        name = draw(NAMES.filter(lambda n: n not in ("llava-ov", "image-heavy", "video-heavy", "text-only")))
        return ("--preset", name, "--out", out), f"'{name}'"
    if case == "encoder":
        name = draw(NAMES.filter(lambda n: n.lower() not in presets.names("encoders")))
        return (*preset, "--encoder", name, "--out", out), "--encoder"
    if case == "dataset":
        return ("--dataset", folder / "none.jsonl", "--out", out), str(folder / "none.jsonl")
    if case == "out":
        bad = draw(st.sampled_from([folder, blocker / "p.json"]))
        return (*preset, "--out", bad), "--out"
    bad = draw(st.sampled_from([folder / "p.xyz", folder / "p", folder, blocker / "p.png"]))
    return (*preset, "--out", out, "--plot", bad), "--plot"


@FUZZ
@given(data=st.data())
def test_bad_profile_data(tmp_path_factory, data):
    argv, name = data.draw(bad_profile_data(tmp_path_factory.mktemp("data")))
    assert_refused(dflop_here("profile", "data", *argv), name)


@st.composite
def bad_profile_model(draw, folder: Path):
    """(argv, what the error must name) for `profile model`: never a valid line, so nothing runs."""
    blocker = folder / "file"
    blocker.write_text("x")
    model = ("--model", "tiny-llm")
    case = draw(st.sampled_from(["model", "dtype", "tp", "repeats", "grid", "llm-on-llm", "llm", "out"]))
    if case == "model":
        name = draw(NAMES.filter(lambda n: n.lower() not in presets.names("encoders") + presets.names("llms")))
        return ("--model", name, "--out", folder), f"'{name}'"
    if case == "dtype":
        dtype = draw(NAMES.filter(lambda n: n not in ("float32", "bfloat16")))
        return (*model, "--dtype", dtype, "--out", folder), "--dtype"
    if case in ("tp", "repeats"):
        return (*model, f"--{case}", draw(st.integers(max_value=0)), "--out", folder), f"--{case}"
    if case == "grid":
        return (*model, "--grid", draw(NAMES.filter(lambda n: n not in ("cpu", "gpu", "quick"))),
                "--out", folder), "--grid"
    if case == "llm-on-llm":
        return (*model, "--llm", draw(st.sampled_from(presets.names("llms"))), "--out", folder), "--llm"
    if case == "llm":
        name = draw(NAMES.filter(lambda n: n.lower() not in presets.names("llms")))
        return ("--model", "tiny-vit", "--llm", name, "--out", folder), "--llm"
    return (*model, "--out", draw(st.sampled_from([blocker, blocker / "store"]))), "--out"


@FUZZ
@given(data=st.data())
def test_bad_profile_model(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("model")
    argv, name = data.draw(bad_profile_model(folder))
    assert_refused(dflop_here("profile", "model", *argv), name)
    assert not (folder / "profile.jsonl").exists()


@FUZZ
@given(data=st.data(), command=st.sampled_from(["optimize", "simulate", "run"]))
def test_missing_inputs_and_unwritable_outputs(tmp_path_factory, data, command):
    folder = tmp_path_factory.mktemp("paths")
    blocker = folder / "file"
    blocker.write_text("x")
    config = write(folder / "run.yaml", config_tree(), None, dump_yaml, data)
    case = data.draw(st.sampled_from(["config", "profiles", "out"]))
    if case == "config":
        missing = data.draw(st.sampled_from([folder / "none.yaml", folder, blocker / "run.yaml"]))
        argv, name = ("--config", missing), str(missing)
    elif case == "profiles":
        store = data.draw(st.sampled_from([folder / "no-such-folder", folder]))
        write(config, {**config_tree(), "profiles": [str(store)]}, None, dump_yaml, data)
        argv, name = ("--config", config), f"{config}: profiles[0]"
    else:
        bad = blocker / "x" if command != "optimize" else data.draw(st.sampled_from([folder, blocker / "p.yaml"]))
        argv, name = ("--config", config, "--out", bad), "--out"
    if "--out" not in argv:
        argv += ("--out", folder / ("p.yaml" if command == "optimize" else "out"))
    assert_refused(dflop_here(command, *argv), name)


# ---- dflop run --backend torch: the config's execution section and --resume ------------------

TINY = {"encoder": "tiny-vit", "llm": "tiny-llm", "cluster": {"hardware": "cpu", "nodes": 1, "gpus_per_node": 2},
        "training": {"global_batch": 4}, "data": {"preset": "llava-ov", "samples": 300}, "steps": 2,
        "plan": {"encoder": {"dp": 2}, "llm": {"dp": 2}, "placement": "colocated", "microbatches": 1}}
STEP = {"solver": "lpt", "batch": {"id": ["a", "b", "c", "d"], "modality": ["text"] * 4, "tiles": [0] * 4,
                                   "text_tokens": [9] * 4, "image_tokens": [0] * 4}, "assignment": [0, 1, 0, 1]}


def resume_folder(folder: Path, plan=TINY["plan"], steps=(STEP,)) -> Path:
    """A folder as a run of TINY leaves it (its record, run.json), with ``plan`` as dflop's plan file
    and ``steps`` as its saved schedules (a resume reads dflop's arm first)."""
    from dflop.jobs.resume import RUN_FILE, plain, run_record
    from dflop.jobs.setup import setup

    config = folder / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    s = setup(config, backend="torch", log=lambda _: None)
    record = {**run_record(s, TINY["steps"]), "planning": {},
              "plans": {"dflop": plain(s.config.plan), "baseline": plain(s.config.plan)}}
    (folder / RUN_FILE).write_text(json.dumps(record))
    (folder / "dflop.plan.yaml").write_text(yaml.safe_dump(plan))
    (folder / "schedules" / "dflop").mkdir(parents=True)
    for i, step in enumerate(steps):
        path = folder / "schedules" / "dflop" / f"step-{i:06d}.json"
        path.write_bytes(step if isinstance(step, bytes) else json.dumps(step).encode())
    return folder


BAD_RESUMES = [
    ({"plan": {**TINY["plan"], "llm": {"dp": 4}}}, "dflop.plan.yaml: "),
    ({"steps": ()}, "schedules/dflop: no saved schedules"),
    ({"steps": (b"{\"solver\": \"\xff\"}",)}, "step-000000.json:1: not UTF-8 text"),
    ({"steps": ([STEP],)}, "step-000000.json: not a saved schedule"),
    ({"steps": ({**STEP, "batch": [1, 2]},)}, "step-000000.json: samples: expected a mapping of columns"),
    ({"steps": ({**STEP, "batch": {**STEP["batch"], "tiles": ["x"] * 4}},)}, "step-000000.json: samples: "),
    ({"steps": ({**STEP, "batch": {**STEP["batch"], "tiles": [[1]] * 4}},)}, "column 'tiles' must be a flat list"),
    ({"steps": ({**STEP, "batch": {**STEP["batch"], "tiles": [10**30] * 4}},)}, "step-000000.json: samples: "),
    ({"steps": ({**STEP, "assignment": [0, 1, 0, 2]},)}, "'assignment': expected a bin from 0 to 1 for each of"),
    ({"steps": ({**STEP, "assignment": [0, 1]},)}, "'assignment': expected a bin"),
]


def test_bad_resume_folders_are_refused_before_any_process_starts(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    for i, (how, message) in enumerate(BAD_RESUMES):
        folder = tmp_path / f"r{i}"
        folder.mkdir()
        resume_folder(folder, **how)
        ran = dflop_here("run", "--backend", "torch", "--config", config, "--resume", folder)
        assert_refused(ran, str(folder))
        assert message in ran.stderr, (message, ran.stderr)
        assert not (folder / "checkpoints").exists()
    assert_refused(dflop_here("run", "--backend", "torch", "--resume", tmp_path / "none"), "'--resume'")
    assert_refused(dflop_here("run", "--resume", tmp_path / "r0", "--out", tmp_path / "o"), "--resume")


@pytest.mark.parametrize("change, message", [
    ({"plans": "dflop"}, "not the record of a run"),
    ({"drop_baseline": True}, "not the record of a run"),
    ({"plans_extra": "other"}, "not the record of a run"),
    ({"planning": None}, "'planning': missing"),
])
def test_a_run_record_without_its_arms_or_planning_is_refused_before_any_arm_is_read(tmp_path, change, message):
    from dflop.errors import DflopError
    from dflop.jobs.resume import RUN_FILE, read_run

    folder = resume_folder(tmp_path, steps=())  # dflop's arm has no schedules: read first, it would fail
    record = json.loads((folder / RUN_FILE).read_text())
    if "plans" in change:
        record["plans"] = change["plans"]
    if change.get("drop_baseline"):
        del record["plans"]["baseline"]
    if "plans_extra" in change:
        record["plans"][change["plans_extra"]] = record["plans"]["dflop"]
    if "planning" in change:
        del record["planning"]
    (folder / RUN_FILE).write_text(json.dumps(record))
    with pytest.raises(DflopError, match=message):
        read_run(folder)


def test_a_saved_arm_reads_back_as_it_was_written(tmp_path):
    from dflop.jobs.resume import load_arm, read_run
    from dflop.jobs.setup import setup
    from dflop.jobs.run import plan_arms

    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    s = setup(config, backend="torch", log=lambda _: None)
    saved = plan_arms(s, 2, tmp_path, lambda _: None)[0][0]
    loaded = load_arm("dflop", tmp_path, s, read_run(tmp_path))
    assert loaded.plan == saved.plan and loaded.solver == saved.solver and len(loaded.steps) == 2
    for a, b in zip(saved.steps, loaded.steps):
        assert a.batch.columns() == b.batch.columns() and a.assignment.tolist() == b.assignment.tolist()


@pytest.mark.parametrize("plan,extra,message", [
    ({"encoder": {}, "llm": {"tp": 3}, "microbatches": 1}, (), "does not divide the 28 attention heads"),
    ({"encoder": {}, "llm": {"dp": 64}, "microbatches": 8}, ("--global-batch", 16), "512 bins, more than the 16"),
    ({"encoder": {}, "llm": {}, "microbatches": 1, "schedule": "2F2B"}, (), "schedule: unknown pipeline schedule"),
    ({"encoder": {}, "llm": {"pp": 2}, "placement": "colocated", "microbatches": 2, "schedule": "DualPipeV",
      "virtual_stages": 2}, (), "schedule: DualPipeV needs at least as many microbatches as stages"),
    ({"encoder": {}, "llm": {"pp": 2}, "placement": "colocated", "microbatches": 4, "schedule": "ZBVZeroBubble"}, (),
     "schedule: ZBVZeroBubble runs exactly 2 stages per rank"),
    ({"encoder": {}, "llm": {}, "microbatches": 1}, ("--global-batch", 10**12), "Invalid value for '--global-batch'"),
])
def test_export_refuses_a_plan_that_cannot_run(tmp_path, plan, extra, message):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    ran = dflop_here("export", path, "--to", "megatron", *extra)
    assert_refused(ran, message)
    if not message.startswith("Invalid"):
        assert f"dflop: error: {path}:" in ran.stderr


def test_a_saved_schedule_with_an_empty_bin_is_read_back_as_saved(tmp_path):
    """Megatron's dp_balanced packing leaves bins empty and the torch backend runs them as nothing, so a
    resume reads such a schedule back as it was saved (only a sample outside every bin is refused)."""
    from dflop.jobs.resume import load_arm, read_run
    from dflop.jobs.setup import setup

    second = {**STEP, "assignment": [0, 0, 0, 0]}  # bin 1 empty
    folder = resume_folder(tmp_path, steps=(STEP, second))
    s = setup(tmp_path / "tiny.yaml", backend="torch", log=lambda _: None)
    arm = load_arm("dflop", folder, s, read_run(folder))
    assert [list(step.assignment) for step in arm.steps] == [[0, 1, 0, 1], [0, 0, 0, 0]]
