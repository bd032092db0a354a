"""A profile measured on another machine: runs and planning say so, naming what differs, and a run
calibrates its predictions to this machine by the ratios a quick check of the profile's shapes found."""

import json

import numpy as np
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from dflop.cost.calibration import Calibration, calibrated, scale_records
from dflop.errors import DflopError
from dflop.cost.select import select_cost_model
from dflop.cost.store import MACHINE_FIELDS, ProfileStore, machine_difference, profile_machine
from dflop.cost.protocol import StageSpec, WorkShape
from dflop.specs import presets
from dflop.specs.hardware import TrainingSpec
from dflop.specs.models import MLLMSpec
from dflop.specs.plan import Module

XEON = {"cpu": "Intel Xeon Platinum 8480", "capability": "AVX512", "cores": 8, "threads": 1, "memory_gib": 64.0,
        "torch": "2.13.0+cpu", "python": "3.11.7"}
EPYC = {**XEON, "cpu": "AMD EPYC", "capability": "AVX2", "cores": 2}


def test_a_difference_names_the_fields_that_differ_and_only_those():
    assert machine_difference(XEON, EPYC) == ("profile measured on <Intel Xeon Platinum 8480, AVX512, 8 cores>, "
                                              "this is <AMD EPYC, AVX2, 2 cores>")
    assert machine_difference(XEON, dict(XEON)) == ""
    assert machine_difference(None, EPYC) == ("profile measured on an unknown machine (its records do not say), "
                                              "this is <AMD EPYC, AVX2, 2 cores>")
    assert machine_difference({**XEON, "gpu": "NVIDIA H100 80GB HBM3"}, {**XEON, "gpu": "NVIDIA H100 PCIe"}) == \
        "profile measured on <NVIDIA H100 80GB HBM3>, this is <NVIDIA H100 PCIe>"


values = st.one_of(st.none(), st.integers(1, 512), st.sampled_from(["AVX2", "AVX512", "2.13.0", "x"]))


@given(st.dictionaries(st.sampled_from(sorted(MACHINE_FIELDS)), values),
       st.dictionaries(st.sampled_from(sorted(MACHINE_FIELDS)), values))
def test_two_machines_are_the_same_exactly_when_no_field_both_name_differs(a, b):
    same = all(a[k] == b[k] for k in MACHINE_FIELDS if a.get(k) is not None and b.get(k) is not None)
    line = machine_difference(a, b)
    assert (line == "") == same
    if not same:  # naming only what both know
        assert "None" not in line and "?" not in line


def test_a_gpu_s_clocks_are_part_of_its_identity_where_nvml_reads_them(monkeypatch):
    """One GPU name comes at more than one clock; the card is found by CUDA's UUID (NVML numbers
    cards in PCI order, not as CUDA_VISIBLE_DEVICES does). A profile from before the clocks were
    read, or a machine whose NVML cannot say, is not told apart by them."""
    import sys
    import types

    from dflop.profile.profiler import gpu_clocks

    cards = {"GPU-5e1f": {1: 1980, 2: 2619}}
    nvml = types.SimpleNamespace(NVML_CLOCK_SM=1, NVML_CLOCK_MEM=2, nvmlInit=lambda: None,
                                 nvmlDeviceGetHandleByUUID=lambda uuid: cards[uuid],
                                 nvmlDeviceGetMaxClockInfo=lambda card, kind: card[kind])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert gpu_clocks("5e1f") == gpu_clocks("GPU-5e1f") == {"sm_clock_mhz": 1980, "memory_clock_mhz": 2619}
    assert gpu_clocks("0000") == {}  # a card NVML does not know
    full = {**XEON, "gpu": "NVIDIA H100", **gpu_clocks("5e1f")}
    assert machine_difference(full, {**full, "sm_clock_mhz": 1755}) == \
        "profile measured on <SM clock 1980 MHz>, this is <SM clock 1755 MHz>"
    assert machine_difference({**XEON, "gpu": "NVIDIA H100"}, full) == ""  # recorded before clocks were read

    def no_driver():
        raise RuntimeError("NVML: driver not loaded")

    monkeypatch.setattr(nvml, "nvmlInit", no_driver)
    assert gpu_clocks("5e1f") == {}


def test_a_profile_is_of_the_machine_most_of_its_records_name_and_unknown_when_none_does(tmp_path):
    assert profile_machine([{"model": "m"}, {"model": "m"}]) is None
    assert profile_machine([{"machine": EPYC}, {"machine": XEON}, {"machine": XEON}, {}]) == XEON
    store = ProfileStore.in_dir(tmp_path)
    record = next(r for r in _shipped() if r["phase"] == "block")
    store.append({**record, "machine": XEON})
    assert store.read()[0]["machine"] == XEON
    with pytest.raises(ValueError, match="field 'machine'"):
        store.append({**record, "machine": ["AVX512"]})


def _shipped():
    from dflop.cost.store import shipped_records

    return [r for r in shipped_records() if r["device"] == "cpu"]


def _cost(records=None):
    model = MLLMSpec(encoder=presets.encoder("tiny-vit"), llm=presets.llm("tiny-llm"))
    hardware = presets.hardware("cpu")
    if records is None:
        cost, _ = select_cost_model(model, hardware, TrainingSpec(global_batch=8))
        return cost
    from dflop.cost.profiled import ProfiledCostModel

    return ProfiledCostModel(model, hardware, TrainingSpec(global_batch=8), records, device="cpu", dtype="float32")


def _shape(module, tokens):
    return WorkShape(tokens=np.array([tokens]), tiles=np.array([tokens // 64]), sum_sq=np.array([tokens * 256]),
                     samples=np.array([tokens // 256]))


def shapes(parts):
    """One measured shape per (module, part, then_ms, now_ms)."""
    return [{"model": "m", "module": m, "tp": 1, "part": p, "shape": {"tokens": 1}, "then_ms": then, "now_ms": now}
            for m, p, then, now in parts]


def test_a_calibration_is_each_parts_time_now_over_then_summed_and_the_rest_moves_by_the_whole():
    c = Calibration.of(shapes([("llm", "block", 10, 30), ("llm", "block", 30, 50), ("llm", "head", 5, 20)]), 1.5)
    assert c.ratios == {"llm block": pytest.approx(80 / 40), "llm head": pytest.approx(4.0)}
    assert c.ratio == pytest.approx(100 / 45) and c.ratio_of("encoder", "projector") == c.ratio
    scaled = scale_records([{"module": "llm", "phase": "head", "fwd_ms": 1.0, "bwd_ms": 2.0, "memory_bytes": 7.0}], c)
    assert scaled == [{"module": "llm", "phase": "head", "fwd_ms": 4.0, "bwd_ms": 8.0, "memory_bytes": 7.0}]


@given(st.floats(0.2, 8.0), st.floats(0.2, 8.0))
def test_a_calibrated_cost_model_prices_each_part_by_its_ratio(block, head):
    cost = _cost(_shipped_tiny())
    c = Calibration.of(shapes([("llm", "block", 1.0, block), ("llm", "head", 1.0, head),
                               ("llm", "embed", 1.0, 1.0)]), 0.0)
    mine = calibrated(cost, c)
    shape = _shape(Module.LLM, 1024)
    middle = StageSpec(Module.LLM, layers=2, tp=1, first=False, last=False)
    for name in ("fwd", "bwd_input", "bwd_weight"):
        assert getattr(mine.stage_cost(middle, shape), name) == pytest.approx(
            block * getattr(cost.stage_cost(middle, shape), name), rel=1e-6)
    last = StageSpec(Module.LLM, layers=2, tp=1, first=False, last=True)
    blocks, with_head = cost.stage_cost(middle, shape).fwd, cost.stage_cost(last, shape).fwd
    assert mine.stage_cost(last, shape).fwd == pytest.approx(block * blocks + head * (with_head - blocks), rel=1e-6)
    assert mine.stage_cost(last, shape).act_bytes == pytest.approx(cost.stage_cost(last, shape).act_bytes)


_TINY = None


def _shipped_tiny():
    global _TINY
    if _TINY is None:
        _TINY = [r for r in _shipped() if r["model"] in ("tiny-vit", "tiny-llm") and r["dtype"] == "float32"]
    return _TINY


def test_a_profile_of_another_machine_is_said_and_calibrated_when_asked(monkeypatch):
    from dflop.jobs import calibrate as job
    from dflop.jobs.setup import setup
    from dflop.profile import drift
    from dflop.profile.profiler import machine_identity

    here = machine_identity("cpu", 1)
    there = {**here, "cpu": "Some Other CPU", "capability": "AVX512" if here["capability"] != "AVX512" else "AVX2"}
    measured_on = [there]
    monkeypatch.setattr(job, "profile_machine", lambda records: measured_on[0])
    asked = []

    def measure(records, sizes, **options):
        asked.append(sizes)
        return Calibration.of(shapes([("llm", "block", 1.0, 2.0), ("encoder", "block", 1.0, 3.0)]), 0.5)

    monkeypatch.setattr(drift, "calibrate", measure)
    plain = setup(None, backend="torch", log=lambda _: None)
    lines = []
    s = job.planning_setup(None, True, lines.append, backend="torch")
    assert lines[0].startswith(f"dflop: warning: profile measured on <Some Other CPU, {there['capability']}>, "
                               f"this is <{here['cpu']}, {here['capability']}>: `dflop profile check`")
    assert "dflop profile model" in lines[0] and "--calibrate" not in lines[0]
    assert "cost model: profiled" in lines[1] and "shapes ran 2.50x the recorded time here" in lines[2]
    assert asked == [{"tiny-vit": None, "tiny-llm": None}]
    shape, stage = _shape(Module.LLM, 512), StageSpec(Module.LLM, layers=2, tp=1, first=False, last=False)
    assert s.system.cost.stage_cost(stage, shape).fwd == pytest.approx(
        2.0 * plain.system.cost.stage_cost(stage, shape).fwd, rel=1e-6)
    lines.clear()  # without --calibrate: said, pointing to it, and nothing measured
    s = job.planning_setup(None, False, lines.append, backend="torch")
    assert lines[0].endswith("(--calibrate scales it to this machine)") and len(asked) == 1
    assert s.system.cost.stage_cost(stage, shape).fwd == plain.system.cost.stage_cost(stage, shape).fwd
    lines.clear()  # the same machine: nothing to say
    measured_on[0] = here
    job.planning_setup(None, False, lines.append, backend="torch")
    assert not any("warning: profile measured" in line for line in lines) and len(asked) == 1


def test_the_machine_warning_is_a_job_s_first_line_before_what_setup_says(tmp_path):
    """A profile measured elsewhere moves every time the job reports: the user reads it first, before
    the line naming the cost model (and a plan file's cluster), and a job on this machine's own
    profile says nothing of it."""
    from dflop.jobs.setup import setup

    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"encoder": {"dp": 4}, "llm": {"dp": 4}, "placement": "colocated",
                                    "microbatches": 1, "cluster": {"hardware": "cpu", "nodes": 1, "gpus_per_node": 4}}))
    from dflop.specs.plan_file import load_plan

    said = []
    for machine in (lambda cost: "dflop: warning: elsewhere", lambda cost: ""):
        lines = []
        setup(None, backend="torch", log=lines.append, machine=machine, plan_file=load_plan(plan))
        said.append(lines)
    elsewhere, here = said
    assert elsewhere == ["dflop: warning: elsewhere"] + here
    assert "was made for" in here[0] and "cost model: profiled" in here[1]
    # a plan file refused after setup has spoken: what it said is still said, in order, then the error
    plan.write_text(plan.read_text().replace("dp: 4", "dp: 3", 1))
    lines = []
    with pytest.raises(DflopError, match="plan.yaml"):
        setup(None, backend="torch", log=lines.append, machine=lambda cost: "dflop: warning: elsewhere",
              plan_file=load_plan(plan))
    assert len(lines) == 1 and "was made for" in lines[0]


def test_a_gpu_profile_on_a_machine_without_that_gpu_is_not_calibrated():
    from dflop.jobs.calibrate import calibrate_cost

    cost = _cost(_shipped_tiny())
    cost.device = "NVIDIA H100 80GB HBM3"
    lines = []
    assert calibrate_cost(cost, lines.append) == (cost, None)
    assert lines == ["dflop: cannot calibrate: the profile was measured on NVIDIA H100 80GB HBM3, which this machine "
                     "does not have"]


@pytest.mark.alone  # a torch run: 2 processes
def test_a_torch_run_calibrates_and_reports_predictions_scaled_by_the_ratios_it_found(tmp_path):
    from dflop.backends.base import get_backend
    from dflop.jobs.resume import load_arm, read_run
    from dflop.jobs.run import run
    from dflop.jobs.setup import setup
    from dflop.timing.steps import CostedPlan

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "encoder": "tiny-vit", "llm": "tiny-llm", "cluster": {"hardware": "cpu", "nodes": 1, "gpus_per_node": 2},
        "training": {"global_batch": 4}, "data": {"preset": "llava-ov", "samples": 200}, "steps": 2,
        "scheduler": {"solver": "lpt"}, "execution": {"device": "cpu"},
        "plan": {"encoder": {"dp": 2}, "llm": {"dp": 2}, "placement": "colocated", "microbatches": 1}}))
    lines = []
    data = run(get_backend("torch"), config, steps=2, out=tmp_path / "out", log=lines.append)
    assert lines[0].startswith("dflop: warning: profile measured on an unknown machine") and "calibrating" in lines[0]
    c = data["calibration"]
    assert set(c["ratios"]) == {"encoder block", "encoder embed", "encoder projector", "llm block", "llm embed",
                                "llm head"}
    assert c["seconds"] > 0 and {s["tp"] for s in c["shapes"]} == {1}
    assert all(s["now_ms"] > 0 and s["then_ms"] > 0 for s in c["shapes"])
    now, then = (sum(s[k] for s in c["shapes"]) for k in ("now_ms", "then_ms"))
    assert c["ratio"] == pytest.approx(now / then)
    # the reported prediction is the simulator's on the profile scaled by the ratios found; the
    # uncalibrated one, on the profile as recorded
    s = setup(config, backend="torch", log=lambda _: None)
    found = Calibration(c["ratios"], c["ratio"], c["seconds"], tuple(c["shapes"]))
    arm = load_arm("dflop", tmp_path / "out", s, read_run(tmp_path / "out"))
    sim = get_backend("sim", memory=False)
    for cost, key in ((calibrated(s.system.cost, found), "predicted_step_time_s"),
                      (s.system.cost, "uncalibrated_predicted_step_time_s")):
        from dataclasses import replace

        predicted = [x["step_s"] for x in sim.run(CostedPlan(arm.plan, replace(s.system, cost=cost)), arm.steps).steps]
        assert data[key]["each"] == pytest.approx(predicted, rel=1e-9), key
    low, high = min(c["ratios"].values()), max(c["ratios"].values())
    scaled = data["predicted_step_time_s"]["mean"] / data["uncalibrated_predicted_step_time_s"]["mean"]
    assert min(low, 1.0) <= scaled <= max(high, 1.0)  # communication is priced as it was
    assert json.loads(json.dumps(data))["calibration"] == c


def test_a_model_the_profiler_cannot_build_leaves_the_cost_model_as_recorded_and_says_why():
    from dataclasses import replace

    from dflop.jobs.calibrate import calibrate_cost

    cost = _cost(_shipped_tiny())
    cost.model = replace(cost.model, llm=replace(cost.model.llm, name="my-llm"))
    lines = []
    assert calibrate_cost(cost, lines.append, {"tiny-vit": 8.0, "my-llm": 512.0}) == (cost, None)
    assert lines == ["dflop: cannot calibrate: my-llm is not a model the profiler builds (a preset); predictions use "
                     "the profile as recorded"]


def test_a_run_calibrates_an_llm_s_blocks_at_its_microbatch_size_and_its_samples_length():
    """Attention's share of a block grows with the samples' length, and on another CPU it moves
    apart from the GEMMs': the block measured is the grid's nearest to the run's microbatch (LLM
    tokens) and to the length of the sample its median token is in, not the grid's middle."""
    from dflop.backends.base import ScheduledBatch
    from dflop.jobs.calibrate import sample_lengths
    from dflop.profile.drift import probe_grid
    from dflop.specs import ModulePlan, Plan
    from dflop.workload.sample import SampleTable

    llm = [r for r in _shipped_tiny() if r["model"] == "tiny-llm" and r["tp"] == 1]
    seqs = sorted({r["shape"]["seq"] for r in llm if r["phase"] == "block" and r["shape"]["tokens"] == 4096})
    assert len(seqs) >= 3
    assert probe_grid(Module.LLM, llm, near=4000, points=1).seq == (seqs[(len(seqs) - 1) // 2],)
    assert probe_grid(Module.LLM, llm, near=4000, points=1, length=seqs[-1] - 1).seq == (seqs[-1],)
    assert probe_grid(Module.LLM, llm, near=4000, points=1, length=1).seq == (seqs[0],)
    assert probe_grid(Module.LLM, llm, near=4000, points=1, length=1).tokens == (4096,)
    # 30 texts of 40 tokens and one video of 1500: most samples are short, most tokens are the video's
    batch = SampleTable.build([f"s{i}" for i in range(31)], [0] * 30 + [3], [0] * 30 + [4], [40] * 30 + [1436],
                              [0] * 30 + [64])
    plan = Plan(encoder=ModulePlan(), llm=ModulePlan(dp=2), placement="colocated", microbatches=1)
    cost = _cost(_shipped_tiny())
    assert sample_lengths(cost, [(plan, [ScheduledBatch(batch, np.arange(31) % 2)])]) == {"tiny-llm": 1500.0}
