import json
import re

import pytest
from PIL import Image

from cli_helpers import assert_only_error, dflop_here
from dflop.errors import DflopError
from dflop.sim import simulate_pipeline
from dflop.trace.chrome import TraceBuilder, load_trace, save_trace
from dflop.trace.metrics import metrics
from dflop.viz.timeline import plot_timeline


def hand_trace():
    """Two ranks (rank 1 a TP group of 2 GPUs), one 10 ms step, compute until 8 ms."""
    t = TraceBuilder(meta={"peak_flops": 1e12})
    t.set_workers([{"name": "a", "module": "llm", "rank": 0, "replica": 0, "gpus": [0]},
                   {"name": "b", "module": "llm", "rank": 1, "replica": 0, "gpus": [1, 2]}])
    t.op(0, 0, "0F0", "F", 0, 2_000_000, {"flops": 1e9})
    t.op(0, 0, "0B0", "B", 6_000_000, 8_000_000, {"flops": 2e9})
    t.op(1, 0, "1F0", "F", 2_000_000, 4_000_000, {"flops": 1e9})
    t.op(1, 0, "1B0", "B", 4_000_000, 6_000_000, {"flops": 2e9})
    t.op(1, 1, "allreduce", "allreduce", 8_000_000, 10_000_000)
    t.counter(0, "memory", 0, 2**30)
    t.counter(0, "memory", 1_000_000, 3 * 2**30)
    t.step(0, 0, 8_000_000, 10_000_000)
    return t.document()


def test_metrics_by_hand():
    m = metrics(hand_trace())
    assert m.step_time_s == [pytest.approx(0.010)]
    assert m.busy_s == [pytest.approx(0.004), pytest.approx(0.004)]
    # GPU-weighted: rank 0 (1 GPU) and rank 1 (2 GPUs) each busy 4 of 8 ms of compute span.
    assert m.bubble_fraction == pytest.approx(1 - (4 * 1 + 4 * 2) / (3 * 8))
    assert m.idle_fraction == pytest.approx(1 - (4 * 1 + 4 * 2) / (3 * 10))
    assert m.utilisation == pytest.approx(1 - m.idle_fraction)
    assert m.mfu == pytest.approx((3e9 * 1 + 3e9 * 2) / (3 * 1e12 * 0.010))
    assert m.peak_memory_gib[0] == pytest.approx(3.0)


def test_an_optimizer_step_after_the_graph_is_busy_but_outside_the_bubble():
    doc = hand_trace()  # compute until 8 ms, the step ends at 10 ms: an optimizer step 8-9 ms on rank 0
    doc["traceEvents"].append({"ph": "X", "name": "OPTIMIZER", "cat": "optimizer", "pid": 0, "tid": 0,
                               "ts": 8000, "dur": 1000})
    m = metrics(doc)
    assert m.bubble_fraction == pytest.approx(1 - (4 * 1 + 4 * 2) / (3 * 8))  # as without it, never negative
    assert m.idle_fraction == pytest.approx(1 - (5 * 1 + 4 * 2) / (3 * 10))


def test_idle_by_module_says_which_module_waits():
    # colocated (no encoder worker): rank 0 runs the encoder too; busy 4 of 10 ms on 1 GPU, rank 1 4 of 10 on 2
    m = metrics(hand_trace())
    assert m.idle_by_module == {"llm+encoder": pytest.approx(0.6), "llm": pytest.approx(0.6)}
    doc = hand_trace()
    doc["otherData"]["workers"][0]["module"] = "encoder"  # disaggregated: the encoder has its own GPU
    doc["traceEvents"].append({"ph": "X", "name": "0F1", "cat": "F", "pid": 0, "tid": 0, "ts": 8000, "dur": 1000})
    m = metrics(doc)
    assert m.idle_by_module == {"encoder": pytest.approx(0.5), "llm": pytest.approx(0.6)}
    gpus = 3
    assert sum(v * (1 if k == "encoder" else 2) for k, v in m.idle_by_module.items()) / gpus == pytest.approx(
        m.idle_fraction)


def test_chrome_format_and_round_trip(tmp_path):
    doc = hand_trace()
    path = save_trace(doc, tmp_path / "t.json")
    again = load_trace(path)
    assert again == json.loads(json.dumps(doc))
    complete = [e for e in again["traceEvents"] if e["ph"] == "X"]
    assert all({"name", "ts", "dur", "pid", "tid"} <= set(e) for e in complete)
    names = {e["args"]["name"] for e in again["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"a", "b"}


def test_load_trace_errors(tmp_path):
    from dflop.errors import DflopError

    bad = tmp_path / "bad.json"
    bad.write_text('{"events": []}')
    with pytest.raises(DflopError, match="not a Chrome trace"):
        load_trace(bad)


def test_timelines_small_large_and_side_by_side(tmp_path):
    small = simulate_pipeline([1.0] * 4, [2.0] * 4, schedule="1F1B", microbatches=6)
    large = simulate_pipeline([1.0] * 16, [2.0] * 16, schedule="GPipe", microbatches=64)
    for doc, name in ((small.trace, "small.png"), (large.trace, "large.png")):
        png = plot_timeline(doc, tmp_path / name, max_rows=8)
        assert Image.open(png).size[0] > 500
    both = plot_timeline(small.trace, tmp_path / "both.png", compare=large.trace, labels=("a", "b"))
    assert Image.open(both).size[1] > Image.open(tmp_path / "small.png").size[1]


def test_an_empty_trace_has_no_steps_and_no_utilisation(tmp_path):
    for doc in ({"traceEvents": []}, TraceBuilder().document(),
                {"traceEvents": [{"ph": "C", "pid": 0, "ts": 5, "args": {"GiB": 1.0}}]}):
        m = metrics(doc)
        assert m.steps == 0 and m.step_time_s == [] and m.step_time_mean is None and m.step_time_p50 is None
        assert m.utilisation is None and m.idle_fraction is None and m.bubble_fraction is None and m.mfu is None
        assert m.as_dict()["utilisation"] is None
    path = save_trace({"traceEvents": []}, tmp_path / "empty.json")
    out = dflop_here("plot", "timeline", path, "--out", tmp_path / "empty.png", "--json")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    reported = json.loads(out.stdout)["metrics"]
    assert reported["steps"] == 0 and reported["utilisation"] is None and reported["step_time_s"]["mean"] is None
    human = dflop_here("plot", "timeline", path, "--out", tmp_path / "empty.png")
    assert "(no steps in the trace |" in human.stdout


BAD_EVENTS = [
    ({"ph": "X", "ts": 0, "dur": 1, "tid": 0}, "traceEvents[1]: a 'X' event needs 'pid'"),
    ({"ph": "X", "pid": 0, "ts": "soon", "dur": 1}, "traceEvents[1]: 'ts': expected a number, got 'soon'"),
    ({"ph": "X", "pid": 0, "ts": None, "dur": 1}, "traceEvents[1]: 'ts': expected a number, got None"),
    ({"ph": "X", "pid": 0, "ts": 0}, "traceEvents[1]: a 'X' event needs 'dur'"),
    ({"ph": "X", "pid": 0, "ts": 0, "dur": -1}, "traceEvents[1]: 'dur': must be at least 0, got -1"),
    ({"ph": "X", "pid": 0, "ts": 1e308, "dur": 1e308}, "traceEvents[1]: 'ts': must be at most 1e+30"),
    ({"ph": "X", "pid": -1, "ts": 0, "dur": 1}, "traceEvents[1]: 'pid' must be an integer >= 0, got -1"),
    ({"ph": "X", "pid": "a", "ts": 0, "dur": 1}, "traceEvents[1]: 'pid' must be an integer >= 0, got 'a'"),
    ({"ph": "C", "ts": 0, "args": {"GiB": 1}}, "traceEvents[1]: a 'C' event needs 'pid'"),
    ({"ph": "C", "pid": 0, "ts": 0, "args": {"GiB": "lots"}}, "traceEvents[1]: args.GiB: expected a number"),
    ({"ph": "X", "pid": 0, "ts": 0, "dur": 1, "args": [1]}, "traceEvents[1]: 'args' must be a mapping"),
    ("event", "traceEvents[1]: expected an event object, got str"),
]


@pytest.mark.parametrize("event,message", BAD_EVENTS)
def test_bad_events_are_named_by_index(tmp_path, event, message):
    path = tmp_path / "t.json"
    good = {"ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 1}
    path.write_text(json.dumps({"traceEvents": [good, event]}))
    with pytest.raises(DflopError, match=f"^{re.escape(f'{path}: {message}')}"):
        load_trace(path)
    assert_only_error(dflop_here("plot", "timeline", path, "--out", tmp_path / "t.png"), message)


@pytest.mark.parametrize("other,message", [
    ([], "otherData: expected a mapping"),
    ({"workers": [{"name": "a"}]}, "otherData.workers[0]: expected a mapping with 'name', 'module', 'rank', 'gpus'"),
    ({"workers": [{"name": "a", "module": "llm", "rank": 0, "gpus": []}]}, "otherData.workers[0]: 'gpus' must be"),
    ({"steps": [{"start_us": 0}]}, "otherData.steps[0]: expected a mapping with 'start_us', 'end_us'"),
    ({"steps": [{"start_us": 0, "end_us": "x"}]}, "otherData.steps[0]: 'end_us': expected a number"),
    ({"peak_flops": "fast"}, "otherData: 'peak_flops': expected a number"),
    ({"workers": [{"name": "a", "module": "llm", "rank": 0, "gpus": [0]}]},
     "traceEvents[0]: pid 3 is not one of the 1 workers in otherData"),
])
def test_bad_other_data_is_named(tmp_path, other, message):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "pid": 3, "tid": 0, "ts": 0, "dur": 1}],
                                "otherData": other}))
    with pytest.raises(DflopError, match=f"^{re.escape(f'{path}: {message}')}"):
        load_trace(path)


def test_one_record_loop_takes_the_workers_once_and_ends_compute_at_the_last_compute_node():
    """The loop every runtime records a step through: a ZeRO-1 step ends with its gradient reduction,
    after the last compute node; the step's span is what the runtime says it took."""
    import numpy as np

    from dflop.program.lowering import lower
    from dflop.program.template import build_template
    from dflop.specs import ModulePlan, Plan
    from dflop.trace.record import record_graph_step

    graph = lower(build_template(Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(dp=2), placement="colocated",
                                      microbatches=2)))
    start = np.arange(len(graph), dtype=np.int64) * 10
    end = start + 5
    compute = graph.compute_nodes
    assert int(end.argmax()) not in compute  # the reduction ends last
    trace = TraceBuilder()
    ends = [record_graph_step(trace, graph, start, end, step=i, offset_ns=1000 * i, step_ns=900, samples=4)
            for i in range(2)]
    assert ends == [int(end[compute].max())] * 2
    assert [w["name"] for w in trace.workers] == [w.name for w in graph.workers]
    assert trace.steps[1] == {"step": 1, "start_us": 1.0, "compute_end_us": (1000 + ends[0]) / 1000,
                              "end_us": 1.9, "samples": 4}
    assert len(trace.events) == 2 * len(graph)
