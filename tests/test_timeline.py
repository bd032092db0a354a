"""Timelines: what is drawn (rows, bars per category, labels, titles), checked through `layout`,
on hand-made traces whose content is known exactly and on the simulator's own traces."""

import numpy as np
import pytest
from PIL import Image

from cli_helpers import assert_one_line_error, dflop, dflop_json
from dflop.cost import AnalyticalCostModel, System
from dflop.errors import DflopError
from dflop.timing.steps import CostedPlan
from dflop.sim.simulate import simulate_steps
from dflop.specs import ModulePlan, Plan, TrainingSpec
from dflop.trace.chrome import COMM, COMPUTE, TraceBuilder, save_trace
from dflop.viz.timeline import LABEL_LIMIT, layout, plot_timeline
from dflop.workload import profile_mix

MS = 1_000_000  # ns


def steps_trace(steps=8, microbatches=2, colocated=False, step_ms=10):
    """An encoder rank feeding an LLM rank (or, colocated, one LLM rank running both), ``steps`` steps of
    ``step_ms`` each: per microbatch a forward and a backward, a bridge send and its arrival marker;
    per step a gradient reduction and an FSDP gather on every rank."""
    t = TraceBuilder(meta={"plan": "a test plan", "peak_flops": 1e12})
    workers = [{"name": "llm pp0", "module": "llm", "rank": 0, "replica": 0, "gpus": [0]}]
    if not colocated:
        workers.insert(0, {"name": "encoder pp0", "module": "encoder", "rank": 0, "replica": 0, "gpus": [1]})
    t.set_workers(workers)
    llm = len(workers) - 1
    for s in range(steps):
        base = s * step_ms * MS
        for k in range(microbatches):
            at = base + k * MS
            args = {"step": s, "microbatch": k, "stage": 0, "tiles": 4}
            if not colocated:
                t.op(0, COMPUTE, f"0F{k}", "F", at, at + MS // 2, {**args, "module": "encoder"})
                t.op(0, COMM, f"BRIDGE{k}", "bridge", at + MS // 2, at + MS, {**args, "module": "encoder"})
                t.op(llm, COMM, f"RECV{k}", "recv", at + MS, at + MS, {**args, "module": "llm"})
                t.op(0, COMPUTE, f"0B{k}", "B", base + 6 * MS + k * MS, base + 6 * MS + k * MS + MS // 2,
                     {**args, "module": "encoder"})
            t.op(llm, COMPUTE, f"1F{k}", "F", at + MS, at + 2 * MS, {**args, "module": "llm"})
            t.op(llm, COMPUTE, f"1B{k}", "B", at + 3 * MS, at + 4 * MS, {**args, "module": "llm"})
        for w in range(len(workers)):
            t.op(w, COMM, "UNSHARD", "unshard", base, base + MS // 4, {"step": s})
            t.op(w, COMM, "REDUCE_GRAD", "reduce_grad", base + 8 * MS, base + 9 * MS, {"step": s})
        t.step(s, base, base + 8 * MS, base + step_ms * MS)
    return t.document()


def test_one_step_by_default_with_plan_and_step_time_in_the_title():
    tl = layout(steps_trace())
    (panel,) = tl.panels
    assert panel.rows == ("encoder pp0", "llm pp0")
    assert panel.counts() == {"encoder F": 2, "encoder B": 2, "bridge": 2, "llm F": 2, "llm B": 2,
                              "unshard": 2, "reduce_grad": 2}  # receives are arrival markers, not bars
    assert panel.title.splitlines()[0] == "a test plan"
    assert panel.title.splitlines()[1].startswith("first step of 8: 0.01 s, mean 0.01 s | bubble")
    assert tl.window == (0.0, pytest.approx(0.010)) and tl.unit == (1e-3, "ms")
    assert all(b.comm == (b.category in {"bridge", "unshard", "reduce_grad"}) for b in panel.bars)


def test_step_k_all_steps_and_window():
    doc = steps_trace()
    third = layout(doc, step=3).panels[0]
    assert third.counts() == layout(doc).panels[0].counts()
    assert min(b.start for b in third.bars) == 0.0 and max(b.start + b.width for b in third.bars) <= 0.010
    assert third.title.splitlines()[1].startswith("step 3 of 8:")
    every = layout(doc, step="all")
    assert every.panels[0].counts() == {k: 8 * v for k, v in third.counts().items()}
    assert every.panels[0].step_starts == pytest.approx([0.010 * k for k in range(1, 8)])
    assert every.panels[0].title.splitlines()[1].startswith("8 steps, mean 0.01 s")
    zoom = layout(doc, step=2, window=(0.0015, 0.0025)).panels[0]
    assert all(0.0015 <= b.start and b.start + b.width <= 0.0025 + 1e-12 for b in zoom.bars)
    assert zoom.counts() == {"bridge": 1, "llm F": 2}  # what overlaps the window, clipped to it
    with pytest.raises(DflopError, match=r"step 9 is out of range: the trace has 8 steps"):
        layout(doc, step=9)
    with pytest.raises(DflopError, match="START < END"):
        layout(doc, window=(2.0, 1.0))
    with pytest.raises(DflopError, match="after the end"):
        layout(doc, window=(1.0, 2.0))


def test_microbatch_labels_only_where_they_help():
    assert layout(steps_trace(microbatches=1)).panels[0].labels == []  # every bar would say 0
    two = layout(steps_trace(microbatches=2)).panels[0]
    assert sorted(two.labels) == ["0", "0", "0", "0", "1", "1", "1", "1"]  # compute bars only
    assert layout(steps_trace(microbatches=2), step="all").panels[0].labels != []
    crowded = steps_trace(steps=1, microbatches=LABEL_LIMIT, step_ms=3 * LABEL_LIMIT)
    assert layout(crowded).panels[0].labels == []  # too many to read


def test_colocated_first_stage_is_told_apart():
    panel = layout(steps_trace(colocated=True)).panels[0]
    assert panel.counts() == {"llm+encoder F": 2, "llm+encoder B": 2, "unshard": 1, "reduce_grad": 1}


def test_side_by_side_on_one_time_axis(tmp_path):
    short, long = steps_trace(step_ms=10), steps_trace(step_ms=20)
    tl = layout(short, compare=long, labels=("measured", "predicted"), step=2)
    assert [p.title.splitlines()[0] for p in tl.panels] == ["measured | a test plan", "predicted | a test plan"]
    assert tl.window == (0.0, pytest.approx(0.020))
    with pytest.raises(DflopError, match="predicted has 3 steps"):
        layout(short, compare=steps_trace(steps=3), labels=("measured", "predicted"), step=5)
    png = plot_timeline(short, tmp_path / "both.png", compare=long, labels=("a", "b"), step="all")
    assert Image.open(png).size[1] > Image.open(plot_timeline(short, tmp_path / "one.png")).size[1]


@pytest.fixture(scope="module")
def system(model, cluster):
    training = TrainingSpec(global_batch=32)
    return System(model, cluster, training, AnalyticalCostModel(model, cluster.hardware, training))


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_simulated_traces_colour_modules_apart(system, model, placement):
    if placement == "colocated":
        plan = Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(pp=2, dp=2), placement="colocated", microbatches=2)
    else:
        plan = Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(pp=2, dp=2), microbatches=2)
    batches = [profile_mix("llava-ov", 32, model.encoder, seed).samples for seed in range(2)]
    sim = simulate_steps(CostedPlan(plan, system), batches, lambda i, b: np.arange(len(b)) % plan.bins)
    counts = layout(sim.trace).panels[0].counts()
    compute = {c for c in counts if c.split()[-1] in "FBIW"}
    if placement == "colocated":  # stage 0 runs the encoder too; stage 1 only the LLM
        assert compute == {"llm+encoder F", "llm+encoder B", "llm F", "llm B"}
        assert counts["llm+encoder F"] == counts["llm F"] == 2 * 2
    else:
        assert compute == {"encoder F", "encoder B", "llm F", "llm B"} and counts["bridge"] > 0
    assert counts["p2p"] > 0 and counts["reduce_grad"] > 0 and "recv" not in counts


@pytest.mark.processes
def test_plot_timeline_command(tmp_path):
    trace = save_trace(steps_trace(), tmp_path / "t.json")
    out = dflop_json("plot", "timeline", trace, "--out", tmp_path / "t.png", "--step", "2", "--window", "0", "0.005")
    assert out["step"] == 2 and out["window"] == [0.0, 0.005]
    assert out["panels"][0]["bars"]["llm F"] == 2 and "step 2 of 8" in out["panels"][0]["title"]
    assert Image.open(out["out"]).size[0] > 500
    assert_one_line_error(dflop("plot", "timeline", trace, "--out", tmp_path / "x.png", "--step", "9"),
                          "step 9", "8 steps")
    assert_one_line_error(dflop("plot", "timeline", trace, "--out", tmp_path / "x.png", "--step", "first"),
                          "--step")
