"""Inputs of the second adversarial pass (issue 31): extreme sizes and values, mismatched profiles,
unbounded data sets and misbehaving sampler solvers. Each gets the right answer, or one line
naming the input, never a hang or an internal error."""

from __future__ import annotations

import json
import math
import re
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from cli_helpers import assert_one_line_error, assert_only_error, dflop_here
from dflop.cost import AnalyticalCostModel, System
from dflop.cost.profiled import ProfiledCostModel
from dflop.cost.select import select_cost_model
from dflop.cost.store import FILENAME, ProfileStore, architecture, shipped_records
from dflop.errors import DflopError
from dflop.plan.evaluate import PlanningProblem
from dflop.plan.space import SpaceBuilder
from dflop.plan.split import first_last_split
from dflop.schedule import sampler as sampler_module
from dflop.schedule.background import SchedulerError
from dflop.schedule.sampler import BalancedBatchSampler
from dflop.specs import ClusterSpec, LLMSpec, MLLMSpec, ModulePlan, Plan, TrainingSpec, presets, to_mapping
from dflop.specs.limits import MAX_GPUS, MAX_SAMPLES, MAX_SIZE
from dflop.specs.loading import read_regular
from dflop.specs.plan import even_split
from dflop.workload import profile_mix
from dflop.workload.data_profile import DataProfile


# ---- layer splits of deep models ---------------------------------------------------------------

def scanned_first_last_split(layers, per_layer, extra):
    """The split as it was first written: every (first, last) pair, quadratic in the layers."""
    stages = len(extra)
    best, best_cost = even_split(layers, stages), float("inf")
    middle = stages - 2
    for first in range(1, layers - middle):
        for last in range(1, layers - first - middle + 1):
            rest = layers - first - last
            if (middle == 0 and rest) or (middle and (rest < middle or rest % middle)):
                continue
            split = (first,) + (rest // middle,) * middle + (last,) if middle else (first, last)
            cost = max(n * per_layer + e for n, e in zip(split, extra))
            if cost < best_cost:
                best, best_cost = split, cost
    return best


costs = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 3.0]), st.floats(0, 50))


@given(layers=st.integers(2, 60), per_layer=costs, extra=st.lists(costs, min_size=2, max_size=9))
def test_first_last_split_is_the_scan_s_split(layers, per_layer, extra):
    """Same split, ties included, as the exhaustive scan, wherever that scan finished."""
    extra = extra[:layers]
    assert first_last_split(layers, per_layer, extra) == scanned_first_last_split(layers, per_layer, extra)


class CountingCost(float):
    """A per-layer cost that counts how often a stage's cost is computed from it."""

    count = 0

    def __rmul__(self, layers):
        CountingCost.count += 1
        return float(self) * layers


def test_a_deep_model_splits_with_bounded_work():
    """2048 layers: the scan computed millions of stage costs for each split optimize asked for;
    the bisection computes O(layers x log layers) at most, for any number of stages."""
    layers = 2048
    for stages in (2, 3, 4, 16):
        extra = [0.0] * stages
        extra[0], extra[-1] = 30.0, 7.0
        CountingCost.count = 0
        split = first_last_split(layers, CountingCost(1.3), extra)
        assert sum(split) == layers and min(split) >= 1
        assert CountingCost.count <= 8 * layers * math.log2(layers), (stages, CountingCost.count)


def test_one_node_of_a_million_gpus_gives_the_encoder_a_few_gpu_counts_to_try():
    """Every count from 1 to 999,999 was a choice to bound: optimize never ended."""
    model = presets.model("tiny-vit", "tiny-llm")
    cluster = ClusterSpec(hardware=presets.hardware("cpu"), nodes=1, gpus_per_node=10**6)
    training = TrainingSpec(global_batch=8)
    data = profile_mix("llava-ov", 100, model.encoder, seed=1).samples
    builder = SpaceBuilder(PlanningProblem(System(model, cluster, training,
                                                  AnalyticalCostModel(model, cluster.hardware, training)), data), 8)
    for tp in builder.llm_tp:
        options = builder.encoder_gpu_options(tp)
        assert 0 < len(options) <= 32 and all(0 < e < 10**6 and e % tp == 0 for e in options)


# ---- --prediction-error ------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["nan", "inf", "1e6", "3.5", "-1"])
@pytest.mark.parametrize("command", ["optimize", "run"])
def test_a_prediction_error_is_a_finite_sigma_of_at_most_three(tmp_path, command, value):
    ran = dflop_here(command, "--prediction-error", value, "--out", tmp_path / "out.yaml")
    assert_only_error(ran, "'--prediction-error'")
    assert ("nan is not a number" if value == "nan" else "0.0<=x<=3.0") in ran.stderr


@pytest.mark.parametrize("value", ["nan", "0", "-1", "soon"])
def test_a_search_deadline_is_a_number_of_seconds_above_zero(tmp_path, value):
    ran = dflop_here("optimize", "--max-seconds", value, "--out", tmp_path / "out.yaml")
    assert_only_error(ran, "'--max-seconds'")
    assert not (tmp_path / "out.yaml").exists()


@pytest.mark.parametrize("value", ["0", "-1", "many", "1.5"])
def test_search_workers_are_a_whole_number_of_at_least_one(tmp_path, value):
    ran = dflop_here("optimize", "--workers", value, "--out", tmp_path / "out.yaml")
    assert_only_error(ran, "'--workers'")
    assert not (tmp_path / "out.yaml").exists()


def test_search_workers_reach_the_search_one_per_usable_core_by_default(tmp_path, monkeypatch):
    """That N workers give the plan of one is the optimizer's test (test_optimizer.py); here, that
    the option gets there. The search runs in this process: it is the number that is checked."""
    from dflop.plan import search

    asked = []
    in_process = search.Optimizer._units

    def recorded(self, units):
        asked.append(self.workers)
        self.workers = 1
        return in_process(self, units)

    monkeypatch.setattr(search.Optimizer, "_units", recorded)
    for given in (["--workers", "3"], []):
        ran = dflop_here("optimize", *given, "--max-seconds", "0.01", "--out", tmp_path / "out.yaml")  # soon over
        assert ran.returncode == 0, ran.stderr
    assert asked == [3, search.usable_cores()]


# ---- profiles of another model of the same name --------------------------------------------------

CPU = presets.hardware("cpu")
WIDE = LLMSpec(name="tiny-llm", layers=4, hidden=4096, heads=32, kv_heads=8, ffn=11008, vocab=1024)


def test_a_model_that_only_shares_a_profiled_model_s_name_is_not_priced_with_its_profile():
    """A 4096-wide LLM named tiny-llm was priced with the shipped 128-wide profile (MFU 3347%)."""
    training = TrainingSpec(global_batch=8)
    cost, _ = select_cost_model(presets.model("tiny-vit", "tiny-llm"), CPU, training)
    assert isinstance(cost, ProfiledCostModel)
    cost, note = select_cost_model(MLLMSpec(encoder=presets.encoder("tiny-vit"), llm=WIDE), CPU, training)
    assert not isinstance(cost, ProfiledCostModel)
    assert "dflop/cost/profiles" in note and "hidden 128, the model's 4096" in note


def test_a_profile_folder_measured_on_another_architecture_is_not_used(tmp_path):
    """Records say what they measured (``arch``): a folder's records of tiny-llm at another width
    (which win over the shipped ones) are set aside, naming the folder and the field."""
    other = {**architecture("llm", presets.llm("tiny-llm")), "hidden": 256}
    records = [{**r, "arch": other} for r in shipped_records() if r["model"] == "tiny-llm"]
    (tmp_path / FILENAME).write_text("".join(json.dumps(r) + "\n" for r in records))
    cost, note = select_cost_model(presets.model("tiny-vit", "tiny-llm"), CPU, TrainingSpec(global_batch=8),
                                   [tmp_path])
    assert not isinstance(cost, ProfiledCostModel)
    assert str(tmp_path) in note and "hidden 256, the model's 128" in note


def test_a_record_whose_architecture_is_not_a_mapping_is_skipped_naming_the_field(tmp_path):
    good = next(r for r in shipped_records() if r["phase"] == "head")
    store = tmp_path / FILENAME
    store.write_text(json.dumps({**good, "arch": "wide"}) + "\n")
    seen = []
    assert ProfileStore(store).read(seen.append) == []
    assert seen and "field 'arch'" in seen[0]


# ---- unbounded data sets ---------------------------------------------------------------------

TURNS = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]


def write_lines(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_an_absurd_repeat_time_is_refused_naming_the_key(tmp_path):
    write_lines(tmp_path / "a.jsonl", [{"conversations": TURNS}])
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"src": {"annotation": "a.jsonl", "repeat_time": 10**12}}))
    ran = dflop_here("profile", "data", "--dataset", meta, "--samples", 10, "--out", tmp_path / "p.json")
    assert_only_error(ran, f"{meta}: src.repeat_time", str(MAX_SAMPLES))


def test_repeats_are_read_only_as_far_as_the_samples_asked_for(tmp_path):
    """The index was tiled before --samples applied: 1000 entries x 10^7 repeats, a MemoryError."""
    write_lines(tmp_path / "a.jsonl", [{"conversations": TURNS}] * 1000)
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"src": {"annotation": "a.jsonl", "repeat_time": MAX_SAMPLES}}))
    out = tmp_path / "p.json"
    ran = dflop_here("profile", "data", "--dataset", meta, "--samples", 10, "--out", out, "--json")
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["samples"] == 10
    ran = dflop_here("profile", "data", "--dataset", meta, "--out", out)
    assert_only_error(ran, f"{meta}: src.annotation", "repeat_time", str(MAX_SAMPLES), "--samples")


def test_repeats_of_entries_that_are_all_skipped_stop_after_one_pass(tmp_path):
    """Ten million repeats of three bad lines were thirty million parse failures before --samples."""
    (tmp_path / "bad.jsonl").write_text("not json\n" * 3)
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"src": {"annotation": "bad.jsonl", "repeat_time": MAX_SAMPLES}}))
    ran = dflop_here("profile", "data", "--dataset", meta, "--samples", 10, "--skip-bad", "--out", tmp_path / "p.json")
    assert_only_error(ran, f"{meta}: no readable entries (3 skipped")


@pytest.mark.parametrize("option", ["--dataset", "--config"])
def test_a_device_is_not_read_as_an_input_file(tmp_path, option):
    """/dev/zero never ends: reading it ended in a MemoryError."""
    if option == "--dataset":
        ran = dflop_here("profile", "data", "--dataset", "/dev/zero", "--out", tmp_path / "p.json")
    else:
        ran = dflop_here("optimize", "--config", "/dev/zero", "--out", tmp_path / "p.yaml")
    assert_only_error(ran, "/dev/zero", "not a regular file")


def test_a_file_over_the_size_limit_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_bytes(b"x" * 11)
    with pytest.raises(ValueError, match="larger than 10 bytes"):
        read_regular(path, limit=10)
    assert read_regular(path, limit=11) == b"x" * 11


def test_a_sample_larger_than_any_command_takes_is_refused_where_it_is_read(tmp_path):
    """profile data wrote a 5-million-token sample that every later command refused, naming no entry."""
    rows = [{"id": f"s{i}", "conversations": TURNS} for i in range(20)]
    rows[7] = {"id": "s7", "conversations": [TURNS[0], {"from": "gpt", "value": "x" * (4 * MAX_SIZE + 8)}]}
    data = write_lines(tmp_path / "big.jsonl", rows)
    out = tmp_path / "p.json"
    ran = dflop_here("profile", "data", "--dataset", data, "--out", out)
    assert_only_error(ran, f"{data}:8: entry 7", "text tokens", str(MAX_SIZE))
    assert not out.exists()
    ran = dflop_here("profile", "data", "--dataset", data, "--out", out, "--skip-bad", "--json")
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["samples"] == 19
    assert len(DataProfile.load(out).samples) == 19  # and later commands read it back


# ---- errors that name their input ---------------------------------------------------------------

def test_a_plan_file_s_cluster_beyond_the_gpu_limit_is_named(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({**to_mapping(Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(dp=2),
                                                      placement="colocated", microbatches=1)),
                                    "cluster": {"hardware": "cpu", "nodes": 10**6, "gpus_per_node": 10**6}}))
    assert_only_error(dflop_here("export", plan, "--to", "megatron"), f"{plan}: cluster", str(MAX_GPUS))


TINY = {"encoder": "tiny-vit", "llm": "tiny-llm", "cluster": {"hardware": "cpu", "nodes": 1, "gpus_per_node": 2},
        "training": {"global_batch": 4}, "data": {"preset": "llava-ov", "samples": 300}, "steps": 1}
ONE_STAGE = {"encoder": {"dp": 2}, "llm": {"dp": 2}, "placement": "colocated", "microbatches": 1}
TWO_STAGES = {"encoder": {"dp": 1}, "llm": {"pp": 2}, "placement": "colocated", "microbatches": 2}
APART = {"encoder": {"dp": 1}, "llm": {"dp": 1}, "placement": "disaggregated", "microbatches": 2}


@pytest.mark.parametrize("plan,schedule,message", [
    (ONE_STAGE, "GPipe", "one pipeline rank runs GPipe as plain gradient accumulation"),
    (TWO_STAGES, "DualPipeV", "DualPipeV needs at least as many microbatches as stages"),
    (TWO_STAGES, "Interleaved1F1B", "Interleaved1F1B with one virtual stage is not interleaved"),
    (APART, "ZBVZeroBubble", "2 stages per rank (ZBVZeroBubble) need colocated or heterogeneous placement"),
])
def test_a_schedule_override_that_does_not_fit_the_plan_names_the_option(tmp_path, plan, schedule, message):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({**TINY, "plan": plan}))
    ran = dflop_here("simulate", "--config", config, "--schedule", schedule, "--out", tmp_path / "sim")
    assert_one_line_error(ran, f"--schedule {schedule}: ", message)
    assert not (tmp_path / "sim").exists()


# ---- the sampler API ---------------------------------------------------------------------------

SHAPES = profile_mix("llava-ov", 40, presets.encoder("siglip-so400m"), seed=3)


def sampler(**kwargs):
    return BalancedBatchSampler(SHAPES, **{"global_batch": 40, "dp_size": 2, "dp_rank": 0, "microbatches": 4,
                                           **kwargs})


def test_a_solver_answer_outside_the_bins_is_an_error_not_lost_samples(monkeypatch):
    """Samples in bin 8 of 0..7 were dropped: 35 of 40 handed out."""
    real = sampler_module.partition

    def off_by_one(problem, *args, **kwargs):
        result = real(problem, *args, **kwargs)
        return replace(result, assignment=np.where(result.assignment == 0, problem.bins, result.assignment))

    monkeypatch.setattr(sampler_module, "partition", off_by_one)
    with pytest.raises(SchedulerError, match=r"solver 'lpt': .*bin 8, bins 0\.\.7"):
        list(sampler())


def test_a_solver_that_never_answers_is_given_up_at_the_deadline(monkeypatch):
    release = threading.Event()

    def hang(*args, **kwargs):
        release.wait()

    monkeypatch.setattr(sampler_module, "partition", hang)
    try:
        with pytest.raises(SchedulerError, match="solver 'lpt': no partition after the deadline of 0.2 s"):
            list(sampler(deadline=0.2))
    finally:
        release.set()
    with pytest.raises(DflopError, match="deadline"):
        sampler(deadline=float("inf"))


@pytest.mark.parametrize("costs,shape", [(lambda b: np.ones(len(b) - 1), "(39,)"),
                                         (lambda b: np.ones((len(b) + 3, 2)), "(43, 2)"),
                                         (lambda b: np.ones((len(b), 2, 2)), "(40, 2, 2)")])
def test_costs_of_the_wrong_length_are_named(costs, shape):
    with pytest.raises(DflopError, match=re.escape(f"costs: returned an array of shape {shape} for a global "
                                                   "batch of 40 samples")):
        list(sampler(costs=costs))
