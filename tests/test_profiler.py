import json
import subprocess
import sys
import time
import warnings
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cli_helpers import assert_one_line_error, dflop, dflop_json
from dflop.cost import StageSpec, WorkShape
from dflop.cost.profiled import ProfiledCostModel, _shape_x, holdout_error, off_their_neighbours
from dflop.cost.select import select_cost_model
from dflop.cost.store import ProfileStore, architecture, shipped_records
from dflop.specs import TrainingSpec, presets

TINY = presets.model("tiny-vit", "tiny-llm")
CPU = presets.hardware("cpu")


def cpu_records() -> list[dict]:
    """The shipped CPU profile (the tiny models measured as the torch backend's CPU ranks run)."""
    return [r for r in shipped_records() if r["device"] == "cpu"]


@pytest.mark.processes
def test_quick_profile_and_rerun(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the backend's ranks run one thread whatever this says
    first = dflop_json("profile", "model", "--model", "tiny-llm", "--grid", "quick", "--repeats", 2,
                       "--out", tmp_path)
    assert first["measured"] == first["records"] > 0 and first["reused"] == 0
    records = ProfileStore.in_dir(tmp_path).read()
    assert {r["phase"] for r in records} == {"block", "embed", "head"}
    assert all(r["fwd_ms"] > 0 and r["memory_bytes"] >= 0 and r["device"] == "cpu" for r in records)
    assert {r["threads"] for r in records} == {1}
    assert {r["freed_memory"] for r in records} == {"kept"}  # as the backend's ranks run
    assert all(r["arch"] == architecture("llm", presets.llm("tiny-llm")) for r in records)  # what was measured
    again = dflop_json("profile", "model", "--model", "tiny-llm", "--grid", "quick", "--out", tmp_path)
    assert again["measured"] == 0 and again["reused"] == first["records"]


@pytest.mark.processes
def test_lock_step_processes_measure_alongside_and_a_dead_twin_stops_the_run(tmp_path):
    out = dflop_json("profile", "model", "--model", "tiny-vit", "--grid", "quick", "--repeats", 1,
                     "--processes", 2, "--fsdp", "--out", tmp_path)
    records = ProfileStore.in_dir(tmp_path).read()
    assert out["measured"] == len(records) > 0 and {r["processes"] for r in records} == {2}  # one writer
    assert {r["threads"] for r in records} == {1}
    # FSDP2's units, each sharded over both processes: the block and each fixed part, whole
    units = {r["shape"]["params"]: r for r in records if r["phase"] == "fsdp_unit"}
    spec = TINY.encoder
    from dflop.models.vit import PatchEmbed, Projector, VisionBlock

    sizes = [sum(p.numel() for p in m.parameters()) for m in (VisionBlock(spec), PatchEmbed(spec), Projector(TINY))]
    assert sorted(units) == sorted(sizes)
    # what FSDP2 adds is a difference of two timings, never below 0; a small unit's can be lost in a
    # 1-repeat measurement's noise (measured 0 once on a busy machine), the block's is its weights' all-gather
    assert all(r["shape"]["shards"] == 2 and r["fwd_ms"] >= 0 and r["bwd_ms"] >= 0 for r in units.values())
    block = units[sizes[0]]
    assert block["fwd_ms"] + block["bwd_ms"] > 0
    assert holdout_error(records)["shapes"] == holdout_error([r for r in records if r["phase"] != "fsdp_unit"])["shapes"]
    assert_one_line_error(dflop("profile", "model", "--model", "tiny-vit", "--fsdp", "--out", tmp_path / "alone"),
                          "--fsdp: FSDP2's collectives are measured in a real data-parallel group")
    assert_one_line_error(dflop("profile", "model", "--model", "tiny-vit", "--device", "cuda", "--processes", 2,
                                "--out", tmp_path / "gpu"), "--processes 2: lock-step processes share one device only on cpu")
    from dflop.errors import DflopError
    from dflop.profile.profiler import _lock_step

    # a twin that cannot start (an unknown model) breaks the barrier instead of leaving this process waiting
    with pytest.raises(DflopError, match=r"a lock-step profiling process stopped \(exit code 1\).*kept in"):
        with _lock_step(2, "no-such-model", str(tmp_path), {"device": "cpu", "dtype": None, "grid": "quick",
                                                           "llm": None}, (1,), [0], 0, 1, None) as (barrier, _):
            barrier.wait(120)


@pytest.mark.processes
def test_tensor_parallelism_runs_in_real_groups_of_lock_step_processes(tmp_path):
    def records(folder):
        return {(r["tp"], r["phase"], tuple(r["shape"].values())): r for r in ProfileStore.in_dir(folder).read()}

    dflop_json("profile", "model", "--model", "tiny-llm", "--grid", "quick", "--repeats", 1, "--tp", 1, "--tp", 2,
               "--processes", 2, "--out", tmp_path)
    grouped = records(tmp_path)
    tp2 = [r for (tp, *_), r in grouped.items() if tp == 2]
    assert len(tp2) == 10 and {r["tp_comm"] for r in tp2} == {"measured"}
    for (tp, phase, shape), r in grouped.items():
        if tp == 2 and phase == "head":  # the backend keeps the head whole on every TP rank: full-vocabulary logits
            assert r["memory_bytes"] == grouped[(1, "head", shape)]["memory_bytes"]
        if tp == 2 and phase == "block":  # split over the group: each rank keeps its heads' and channels' share
            assert r["memory_bytes"] < 0.8 * grouped[(1, "block", shape)]["memory_bytes"]
    # alone, TP 2 is one shard (half the vocabulary) measured again, its collectives left to the cost model
    again = dflop_json("profile", "model", "--model", "tiny-llm", "--grid", "quick", "--repeats", 1, "--tp", 1,
                       "--tp", 2, "--out", tmp_path)
    assert again["reused"] == 10 and again["measured"] == 10
    alone = records(tmp_path)
    for (tp, phase, shape), r in alone.items():
        if tp == 2:
            assert r["tp_comm"] == "modelled"
        if tp == 2 and phase == "head":
            assert r["memory_bytes"] < 0.7 * alone[(1, "head", shape)]["memory_bytes"]
    assert_one_line_error(dflop("profile", "model", "--model", "tiny-llm", "--tp", 2, "--processes", 3, "--out",
                                tmp_path), "--tp 2: lock-step processes run TP 2 in real groups of 2, so --processes "
                          "must be a multiple of it (got 3)")
    from dflop.errors import DflopError
    from dflop.profile.profiler import _lock_step

    # a twin that dies before the group forms stops the run instead of leaving this process waiting to join
    with pytest.raises(DflopError, match=r"a lock-step profiling process stopped \(exit code 1\)"):
        with _lock_step(2, "no-such-model", str(tmp_path), {"device": "cpu", "dtype": None, "grid": "quick",
                                                           "llm": None}, (1, 2), [0], 0, 1, None):
            pass


@pytest.mark.processes
def test_killed_run_resumes_with_only_what_is_missing(tmp_path):
    # Many repeats make each of the quick grid's 10 records slow enough to kill between them.
    store = tmp_path / "profile.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "dflop.cli.main", "profile", "model", "--model", "tiny-llm",
                             "--grid", "quick", "--repeats", "100", "--out", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600  # a bound only: on a loaded machine one record can take a minute
    while time.monotonic() < deadline and (not store.exists() or store.read_text().count("\n") < 2):  # whole lines
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    kept = ProfileStore(store).read()
    assert 2 <= len(kept) < 10  # stopped part-way, with what it measured on disk
    before = {json.dumps(r, sort_keys=True) for r in kept}
    rerun = dflop_json("profile", "model", "--model", "tiny-llm", "--grid", "quick", "--repeats", "1",
                       "--out", tmp_path)
    assert rerun["reused"] == len(kept) and rerun["measured"] == 10 - len(kept)
    after = {json.dumps(r, sort_keys=True) for r in ProfileStore(store).read()}
    assert before <= after and len(after) == 10  # nothing measured was lost or measured again


@pytest.mark.processes
def test_bad_input(tmp_path):
    assert_one_line_error(dflop("profile", "model", "--model", "gpt-5", "--out", tmp_path),
                          "unknown model 'gpt-5' (known: siglip-so400m")
    assert_one_line_error(dflop("profile", "model", "--model", "tiny-llm", "--dtype", "float16", "--out", tmp_path),
                          "float16 is not supported for training on cpu")
    assert_one_line_error(dflop("profile", "model", "--model", "tiny-llm", "--dtype", "fp8", "--out", tmp_path),
                          "--dtype fp8: unknown")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_one_line_error(dflop("profile", "model", "--model", "tiny-llm", "--out", blocker / "store"),
                          "store: cannot be written", "file is not a folder")
    cuda = dflop("profile", "model", "--model", "tiny-llm", "--device", "cuda", "--grid", "quick",
                 "--repeats", "1", "--out", tmp_path / "gpu")
    if torch.cuda.is_available():
        assert cuda.returncode == 0
    else:
        assert_one_line_error(cuda, "--device cuda: this machine has no CUDA device")


@pytest.mark.processes
def test_corrupt_record_is_skipped_with_a_warning_naming_the_line(tmp_path):
    dflop_json("profile", "model", "--model", "tiny-llm", "--grid", "quick", "--repeats", 1, "--out", tmp_path)
    store = tmp_path / "profile.jsonl"
    lines = store.read_text().splitlines()
    lines[1] = lines[1][: len(lines[1]) // 2]  # a half-written line
    store.write_text("\n".join(lines) + "\n")
    seen = []
    assert len(ProfileStore(store).read(seen.append)) == len(lines) - 1
    assert len(seen) == 1 and seen[0].startswith(f"{store}:2: skipped a corrupt profile record (not valid JSON")
    proc = dflop("profile", "model", "--model", "tiny-llm", "--grid", "quick", "--repeats", "1", "--out", tmp_path,
                 "--json")
    assert proc.returncode == 0 and f"{store}:2: skipped a corrupt profile record" in proc.stderr
    assert json.loads(proc.stdout)["measured"] == 1  # only the lost shape is measured again


@pytest.mark.parametrize("field,value", [("threads", 0), ("threads", "two"), ("processes", 1.5), ("threads", True)])
def test_a_record_that_says_it_was_measured_impossibly_is_skipped_naming_the_field(tmp_path, field, value):
    good = next(r for r in shipped_records() if r["phase"] == "head")
    store = tmp_path / "profile.jsonl"
    store.write_text(json.dumps(good) + "\n" + json.dumps({**good, field: value}) + "\n")
    seen = []
    assert ProfileStore(store).read(seen.append) == [good]
    assert seen == [f"{store}:2: skipped a corrupt profile record (field '{field}' must be an integer >= 1)"]


def test_an_fsdp_unit_record_without_its_size_is_skipped_naming_the_field(tmp_path):
    good = next(r for r in shipped_records() if r["phase"] == "fsdp_unit")
    store = tmp_path / "profile.jsonl"
    bad = {**good, "shape": {"shards": 2}}
    store.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    seen = []
    assert ProfileStore(store).read(seen.append) == [good]
    assert seen == [f"{store}:2: skipped a corrupt profile record (field 'shape' of an fsdp_unit record must give "
                    "'params' and 'shards' as integers >= 1)"]


def test_shipped_profile_predicts_held_out_shapes():
    records = cpu_records()
    assert {r["model"] for r in records} >= {"tiny-llm", "tiny-vit"}
    error = holdout_error(records)
    assert error["shapes"] >= 10 and error["median"] < 0.10


def test_a_grid_record_far_off_its_neighbours_is_found_and_only_such_a_one():
    records = cpu_records()
    assert off_their_neighbours(records) == []  # the shipped profile has none
    grid = [r for r in records if not r["holdout"]]
    for module, phase in (("llm", "block"), ("encoder", "block"), ("encoder", "embed")):
        group = [r for r in grid if (r["module"], r["phase"], r["tp"]) == (module, phase, 1)]
        xs = sorted({_shape_x(r)[0] for r in group})
        for x, name, factor in ((xs[len(xs) // 2], "fwd_ms", 2.0), (xs[1], "bwd_ms", 0.5)):
            bad = next(r for r in group if _shape_x(r)[0] == x)
            bent = {**bad, name: bad[name] * factor}
            assert off_their_neighbours([bent if r is bad else r for r in records]) == [bent]
        end = next(r for r in group if _shape_x(r)[0] == xs[-1])
        held = next(r for r in records if r["holdout"] and (r["module"], r["phase"], r["tp"]) == (module, phase, 1))
        changed = {id(end): {**end, "fwd_ms": end["fwd_ms"] * 2}, id(held): {**held, "fwd_ms": held["fwd_ms"] * 2}}
        assert off_their_neighbours([changed.get(id(r), r) for r in records]) == []  # no neighbour past the end; held out as measured


def test_a_shape_disturbed_while_measured_is_measured_once_more(tmp_path, monkeypatch):
    from dflop.profile import profiler

    grid = profiler.Grid(tokens=(64, 128, 256, 512), seq=(64,), tiles=(1,), holdout_llm=(), holdout_tiles=())
    calls = []

    def disturbed(module, make_inputs, *args):  # times that grow with the tokens, as measured on a quiet machine
        tokens = make_inputs()[0].shape[0]
        calls.append((type(module).__name__, tokens))
        slow = 3 if calls.count(("DecoderBlock", 256)) == 1 and calls[-1] == ("DecoderBlock", 256) else 1
        return {"fwd_ms": 0.01 * tokens * slow, "bwd_ms": 0.02 * tokens, "fwd_spread": 0.0, "bwd_spread": 0.0,
                "memory_bytes": 1000.0 * tokens, "inner": 1}

    monkeypatch.setattr(profiler, "measure", disturbed)
    monkeypatch.setattr(profiler, "set_up_cpu_process", lambda threads: True)  # keep pytest's process as it is
    report = profiler.profile_model("tiny-llm", tmp_path, grid=grid, repeats=2, warmup=1)
    assert report.again == [{"tokens": 256, "seq": 64, "tp": 1, "phase": "block"}]
    block = {r["shape"]["tokens"]: r for r in ProfileStore.in_dir(tmp_path).read() if r["phase"] == "block"}
    assert off_their_neighbours(list(block.values())) == []  # the second measurement is the one kept
    assert len(ProfileStore.in_dir(tmp_path).path.read_text().splitlines()) == report.measured + 1
    calls.clear()
    checked = profiler.profile_model("tiny-llm", tmp_path / "check", grid=grid, repeats=2, warmup=1, again=False)
    assert checked.again == [] and calls.count(("DecoderBlock", 256)) == 1  # a check keeps its first figures


def test_collectives_are_added_only_to_tp_shards_measured_alone():
    records = [{k: v for k, v in r.items() if k != "tp_comm"}  # as records from before the field
               for r in cpu_records() if r["model"] == "tiny-llm"]
    stage, work = StageSpec("llm", 2, tp=2), WorkShape(2, 0, 1024, 2 * 512**2)

    def cost(comm):
        marked = [{**r, "tp_comm": comm} if r["tp"] == 2 and comm else r for r in records]
        return ProfiledCostModel(TINY, CPU, TrainingSpec(global_batch=8), marked, "cpu", "float32")

    alone, grouped, before = cost("modelled"), cost("measured"), cost(None)
    comm = float(alone.analytical.tp_comm(stage, work))
    assert comm > 0
    a, g, b = (c.stage_cost(stage, work) for c in (alone, grouped, before))
    assert float(a.fwd) == pytest.approx(float(g.fwd) + comm) and float(a.bwd_input) == pytest.approx(
        float(g.bwd_input) + comm)
    assert float(b.fwd) == float(a.fwd)  # records from before the field are shards measured alone
    mixed = [{**r, "tp_comm": "measured"} if r["tp"] == 2 and r["shape"]["tokens"] < 1024 else r for r in records]
    from dflop.errors import DflopError
    with pytest.raises(DflopError, match="llm tp2 mixes records measured in a real TP group with shards"):
        ProfiledCostModel(TINY, CPU, TrainingSpec(global_batch=8), mixed, "cpu", "float32")


@pytest.fixture(scope="module")
def profiled():
    cost, note = select_cost_model(TINY, CPU, TrainingSpec(global_batch=8))
    assert isinstance(cost, ProfiledCostModel) and note.startswith("cost model: profiled (cpu")
    return cost


shape = st.tuples(st.integers(1, 2048), st.integers(1, 2048), st.integers(0, 16))


def test_the_last_stage_prices_the_head_on_the_rows_it_runs(profiled):
    """The backend computes logits only at the positions that predict text, and the head records
    measure the head on that many rows: a bin of 4096 tokens of which 512 predict text adds the
    head of 512 rows, not of 4096."""
    heads = {r["shape"]["tokens"]: r for r in cpu_records()
             if r["model"] == "tiny-llm" and r["phase"] == "head" and r["tp"] == 1}
    tokens, rows = 4096, 512
    shape = WorkShape(1, 0, tokens, tokens * 256, rows)
    last, inner = (profiled.stage_cost(StageSpec("llm", 1, last=last), shape) for last in (True, False))
    assert float(last.fwd - inner.fwd) * 1e3 == pytest.approx(heads[rows]["fwd_ms"], rel=0.1)
    assert float(last.bwd - inner.bwd) * 1e3 == pytest.approx(heads[rows]["bwd_ms"], rel=0.1)
    every_row = profiled.stage_cost(StageSpec("llm", 1, last=True), replace(shape, targets=None))
    assert float(every_row.fwd - inner.fwd) * 1e3 == pytest.approx(heads[tokens]["fwd_ms"], rel=0.1)


def test_profiled_inputs_take_a_gradient_where_the_backend_s_do():
    """A stage's backward computes its input's gradient only where that input needs one: not the
    pixels a patch embedding reads (the first stage's input; computing it would more than triple
    that backward) nor token ids; the hidden states of blocks, projector and head do."""
    from dflop.profile.profiler import GRIDS, jobs

    seen = set()
    for kind, spec in (("encoder", TINY.encoder), ("llm", TINY.llm)):
        for phase, _, _, _, make_inputs in jobs(kind, spec, TINY, 1, GRIDS["quick"], torch.float32, "cpu"):
            if (kind, phase) not in seen:
                seen.add((kind, phase))
                assert make_inputs()[0].requires_grad == (phase != "embed"), (kind, phase)
    assert len(seen) == 6


@pytest.mark.filterwarnings("ignore:profiled cost model")  # sums may pass the grid: extrapolation is fine here
@given(a=shape, b=shape, layers=st.integers(1, 4))
def test_profiled_times_grow_with_work_and_are_subadditive(profiled, a, b, layers):
    def work(s):
        tokens, longest, tiles = s
        longest = min(longest, tokens)
        return WorkShape(1, tiles, tokens, longest * longest)

    both = WorkShape(2, a[2] + b[2], a[0] + b[0], work(a).sum_sq + work(b).sum_sq)
    for module in ("llm", "encoder"):
        stage = StageSpec(module, layers, first=True, last=True)
        x, y, z = (profiled.stage_cost(stage, s) for s in (work(a), work(b), both))
        for field in ("fwd", "bwd_input", "bwd_weight"):
            fx, fy, fz = (float(getattr(c, field)) for c in (x, y, z))
            assert max(fx, fy) * (1 - 1e-9) <= fz <= (fx + fy) * (1 + 1e-9)


def test_profiled_model_warns_beyond_its_grid():
    fresh, _ = select_cost_model(TINY, CPU, TrainingSpec(global_batch=8))  # it warns once per model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.stage_cost(StageSpec("llm", 2), WorkShape(1, 0, 100_000, 100_000**2))
        fresh.stage_cost(StageSpec("llm", 2), WorkShape(1, 0, 200_000, 200_000**2))
    beyond = [w for w in caught if "beyond the profiled range" in str(w.message)]
    assert len(beyond) == 1 and "llm block at 100000" in str(beyond[0].message)


def test_selection_falls_back_to_the_analytical_model():
    cost, note = select_cost_model(presets.model("siglip-so400m", "qwen2.5-7b"), presets.hardware("h100"),
                                   TrainingSpec(global_batch=8))
    assert note.startswith("cost model: analytical") and not isinstance(cost, ProfiledCostModel)


@pytest.mark.processes
def test_optimize_uses_the_profiled_model_for_the_tiny_pair(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text("encoder: tiny-vit\nllm: tiny-llm\ncluster: {hardware: cpu, nodes: 1, gpus_per_node: 4}\n"
                      "training: {global_batch: 32}\ndata: {preset: llava-ov, samples: 2000}\n")
    proc = dflop("optimize", "--config", config, "--out", tmp_path / "plan.yaml", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "cost model: profiled (cpu, float32" in proc.stderr
    assert json.loads(proc.stdout)["plan"]["step_time_s"] > 0
