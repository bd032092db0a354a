"""Past one machine, tested on one: two torchrun agents on 127.0.0.1 stand for two nodes of two
"GPUs" each (c10d rendezvous on a port the OS picked, gloo, one thread a process, tiny models).

The plan, llm pp2 x dp2 colocated on a cluster of 2 nodes x 2, puts pipeline stage 0 on node 0 and
stage 1 on node 1 (``place``: data-parallel replicas side by side, stages furthest apart), so every
activation and gradient between the stages, and the tied embedding's reduction, crosses the node
boundary. The run must end with the parameters one launch of the same plan and schedules ends
with (fp64: 1e-9 leaves no room for a wrong gradient), refuse a launch whose nodes are not the
plan's, and, when one node's agent is killed, stop the other node's ranks with one line each naming
the lost rank and its node.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from media_files import image, turns

import dflop
import dflop.backends
from dflop.backends.base import ScheduledBatch
from dflop.backends.torch_runtime.backend import TorchBackend, check_launch
from dflop.backends.torch_runtime.model import whole_model_name
from dflop.backends.torch_runtime.progress import WARMUP, read_progress
from dflop.backends.torch_runtime.worker import TorchOptions
from dflop.errors import DflopError
from dflop.jobs import setup as jobs_setup
from dflop.timing.steps import CostedPlan
from dflop.specs import ClusterSpec, presets
from dflop.specs.plan import Module, Strategy, place
from dflop.specs.plan_file import load_plan
from dflop.workload.sample import SampleTable

pytestmark = pytest.mark.processes

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
PLAN = {"encoder": {"dp": 2}, "llm": {"pp": 2, "dp": 2}, "placement": "colocated", "microbatches": 2}
SETTLE_S = 90
"""How long the surviving node may take to stop after the other is killed: gloo sees the closed
connections at once; the rest is process teardown on a busy machine (timeout_s is the backstop)."""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    """A run config of the plan above on 8 small samples (text, and images of 2 tiles), so a step
    takes little time even on a shared CPU."""
    folder = tmp_path_factory.mktemp("two-nodes")
    items = []
    for i in range(8):
        item = {"id": f"s{i}", "conversations": turns("<image>\nwhat is it?" if i % 2 else "hello " * (4 + 3 * i),
                                                     "fine " * (2 + i))}
        if i % 2:
            item["image"] = str(image(folder / f"img{i}.png", (32 + 16 * i, 32)))
        items.append(item)
    (folder / "data.json").write_text(json.dumps(items))

    def write(name, steps=2, checkpoint_every=0):
        body = {"encoder": "tiny-vit", "llm": "tiny-llm",
                "cluster": {"hardware": "cpu", "nodes": 2, "gpus_per_node": 2},
                "training": {"global_batch": 8}, "data": {"dataset": str(folder / "data.json")},
                "scheduler": {"solver": "lpt"}, "seed": 5, "plan": PLAN, "steps": steps,
                "execution": {"dtype": "float64", "lr": 1e-2, "timeout_s": 60, "checkpoint_every": checkpoint_every}}
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(body))
        return path

    return write


def agent(config_path, out, port, *, host, tmp=None):
    """One node's torchrun agent (its own process group); ``host``: it serves the rendezvous."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if tmp is not None:
        tmp.mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = str(tmp)
    return subprocess.Popen(
        [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
         f"127.0.0.1:{port}", "--rdzv-conf", f"is_host={int(host)}", "--max-restarts", "0",
         "-m", "dflop", "run", "--backend", "torch", "--config", str(config_path), "--out", str(out), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def stop(*agents):
    for a in agents:
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGKILL)
        a.communicate()


def children(pid):
    """The processes whose parent is ``pid`` (Linux's /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields_after_name = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields_after_name[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def saved_steps(out):
    """The dflop arm's schedules as the run saved them."""
    steps = []
    for path in sorted((out / "schedules" / "dflop").glob("step-*.json")):
        data = json.loads(path.read_text())
        steps.append(ScheduledBatch(SampleTable.from_columns(data["batch"], str(path)),
                                    np.array(data["assignment"], dtype=np.int64)))
    return steps


def checkpoint_parameters(folder, tmp_path):
    """The model tensors of a torch.distributed.checkpoint folder, read back in one process."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder), str(tmp_path / "params.pt"))
    return torch.load(tmp_path / "params.pt")["model"]


def test_two_nodes_end_with_the_parameters_of_one_launch(config, tmp_path):
    path = config("two-nodes", checkpoint_every=2)  # its last checkpoint: the final parameters
    out, port = tmp_path / "run", free_port()
    agents = [agent(path, out, port, host=True), agent(path, out, port, host=False)]
    try:
        outputs = [a.communicate(timeout=900) for a in agents]
    finally:
        stop(*agents)
    for a, (_, err) in zip(agents, outputs):
        assert a.returncode == 0, err[-3000:]
    reports = [line for o, _ in outputs for line in o.splitlines() if line.strip()]
    assert len(reports) == 1  # rank 0 alone reports, on its node
    report = json.loads(reports[0])
    assert report["gpus"] == 4 and report["steps"] == 2

    two_nodes = checkpoint_parameters(out / "checkpoints" / "dflop" / "step-000002", tmp_path)
    s = jobs_setup.setup(path, backend="torch", log=lambda *_: None)
    spec = s.config.execution
    options = TorchOptions(**{f.name: getattr(spec, f.name) for f in fields(spec)}, seed=s.config.seed)
    plan = load_plan(out / "dflop.plan.yaml").plan
    for replica in range(2):  # the premise: the planner's nodes split the pipeline between them
        stages = [place(plan).gpus(Module.LLM, stage, replica) for stage in (0, 1)]
        assert [{s.system.cluster.node_of(g) for g in gpus} for gpus in stages] == [{0}, {1}]
    one = TorchBackend(options=options, keep_parameters=True, predict=False).run(CostedPlan(plan, s.system),
                                                                                  saved_steps(out))
    tied = s.config.model.llm.tie_embeddings  # the checkpoint keys parameters by their whole-model names
    params = {whole_model_name(n, tied): t for n, t in one.extra["parameters"].items()}
    assert set(params) == set(two_nodes) and params
    assert max(float((params[n] - two_nodes[n]).abs().max()) for n in params) < 1e-9
    assert report["losses"] == pytest.approx(one.extra["losses"], rel=1e-12)


def test_a_launch_on_other_nodes_than_the_plan_s_is_refused_by_every_rank(config, tmp_path):
    """One node of 4 processes has the plan's 4 ranks but not its nodes: rank 2 would sit next to
    rank 0 where the plan (and its prices) put it on another node."""
    path = config("one-node-of-four")
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "4", "-m", "dflop", "run", "--backend",
                           "torch", "--config", str(path), "--out", str(tmp_path / "run"), "--json"],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0 and proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dflop: error: ")]
    assert len(errors) == 4 and len(set(errors)) == 1, proc.stderr[-3000:]
    assert "rank 2 on node 0 where the plan has it on node 1" in errors[0]
    assert errors[0].endswith("launch it with torchrun --nnodes 2 --nproc-per-node 2")
    assert not (tmp_path / "run" / "dflop.trace.json").exists()


def progress_of(tmp):
    """{rank: step} of the ranks whose agent's TMPDIR is ``tmp`` (each rank keeps a progress file there;
    -1 before it has written one, or while it warms up on a later step's graph)."""
    out = {}
    for path in tmp.glob("dflop-progress-*/rank-*.progress"):
        rank = int(path.stem.split("-")[1])
        step, label = read_progress(path.parent, rank) or (-1, "")
        out[rank] = -1 if label.startswith(WARMUP) else step
    return out


def test_killing_one_node_s_agent_stops_the_other_node_naming_the_lost_rank(config, tmp_path):
    """kill -9 of the agent of node 1 (its process group) in the middle of step 1 or later: its ranks
    go with it, and node 0's ranks each stop with one line naming the ranks of node 1 they lost (not
    a sibling of node 0 whose exit closed their link), inside the step graph or between steps."""
    path = config("killed", steps=30)
    out, port = tmp_path / "run", free_port()
    tmps = [tmp_path / "tmp0", tmp_path / "tmp1"]
    agents = [agent(path, out, port, host=True, tmp=tmps[0]), agent(path, out, port, host=False, tmp=tmps[1])]
    try:
        deadline = time.monotonic() + 900
        while not any(step >= 1 for tmp in tmps for rank, step in progress_of(tmp).items() if rank >= 2):
            assert all(a.poll() is None for a in agents), "the run ended before step 1"
            assert time.monotonic() < deadline, "no rank of node 1 reached step 1"
            time.sleep(0.02)
        node1 = next(i for i, tmp in enumerate(tmps) if set(progress_of(tmp)) == {2, 3})  # torchrun's node 1
        doomed, survivor = agents[node1], agents[1 - node1]
        its_ranks = children(doomed.pid)
        assert len(its_ranks) == 2
        os.killpg(doomed.pid, signal.SIGKILL)  # torchrun starts each rank in a session of its own: not in it
        killed = time.monotonic()
        _, err = survivor.communicate(timeout=SETTLE_S)
        took = time.monotonic() - killed
    finally:
        stop(*agents)
    assert survivor.returncode != 0 and took < SETTLE_S
    assert not any(alive(pid) for pid in its_ranks)  # node 1's ranks went with their agent
    errors = [line for line in err.splitlines() if line.startswith("dflop: error: ")]
    assert errors, err[-3000:]
    for line in errors:
        assert re.search(r"^dflop: error: rank [01] \(w\d\) failed at step \d+, (node|in) \S+, "
                         r"lost rank [23] \(node 1\)(, rank [23] \(node 1\))?: ", line), err[-3000:]
    ours = [str(Path(m.__file__).parent) for m in (dflop, dflop.backends)]
    frames = [line for line in err.splitlines() if line.strip().startswith("File ")]
    assert not any(root in f for f in frames for root in ours), err[-3000:]  # no traceback of a rank


def torchrun_numbering(processes_per_node):
    """Per rank, (node, local rank) as torchrun numbers a launch: node after node, in order."""
    return [(node, local) for node, count in enumerate(processes_per_node) for local in range(count)]


@given(per_node=st.integers(1, 8), nodes=st.integers(1, 4), data=st.data())
def test_a_torchrun_launch_runs_exactly_when_every_rank_is_on_its_planned_node(per_node, nodes, data):
    """Accepted if and only if torchrun puts every rank on the node the planner placed it on
    (``ClusterSpec.node_of``) and starts no rank the plan lacks; a refusal is one line whose
    suggested launch is accepted."""
    cluster = ClusterSpec(hardware=presets.hardware("cpu"), nodes=nodes, gpus_per_node=per_node)
    gpus = data.draw(st.integers(1, cluster.gpus), label="gpus")
    planned = [min(per_node, gpus - k * per_node) for k in range(-(-gpus // per_node))]
    counts = data.draw(st.one_of(st.just(planned), st.lists(st.integers(1, 9), min_size=1, max_size=5)), label="launch")
    placed = torchrun_numbering(counts)
    if [node for node, _ in placed] == [cluster.node_of(g) for g in range(gpus)]:
        check_launch(cluster, gpus, placed)
        return
    with pytest.raises(DflopError) as refused:
        check_launch(cluster, gpus, placed)
    line = str(refused.value)
    assert "\n" not in line and f"torchrun started {len(placed)} processes" in line
    suggested = re.search(r"torchrun --nnodes (\d+) --nproc-per-node (\d+)(?: \((\d+) on the last node\))?$", line)
    n, each, last = int(suggested[1]), int(suggested[2]), int(suggested[3] or suggested[2])
    check_launch(cluster, gpus, torchrun_numbering([each] * (n - 1) + [last]))


def test_a_failed_exchange_names_the_peer_rank_and_its_planned_node():
    """Rank 0 (stage 0, node 0) exchanges with rank 2 (stage 1, node 1): a send, and a backward
    waiting for the gradient rank 2 sends, that fail name rank 2 and its node; 'lost' when gloo
    says the connection broke. A failure of the computation itself names no peer."""
    import torch

    from dflop.backends.torch_runtime.parallel import RankLayout
    from dflop.backends.torch_runtime.runtime import Clock, RankStep, RankState
    from dflop.backends.torch_runtime.shapes import StepData
    from dflop.program.lowering import lower
    from dflop.program.stepgraph import build_workers
    from dflop.program.template import build_template
    from dflop.specs import ModulePlan, Plan

    plan = Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(pp=2, dp=2), placement="colocated", microbatches=2)
    template = build_template(plan)
    graph = lower(template)
    layout = RankLayout.of(build_workers(template), 0)
    worker = RankState(layout.worker, layout, {}, None, None, torch.device("cpu"), 0, 64, 1024, Strategy(zero=1))
    batch = SampleTable.build([f"t{i}" for i in range(8)], [0] * 8, [0] * 8, [16] * 8, [0] * 8)
    run = RankStep(worker, graph, StepData(plan, batch, np.arange(8) % 4), 3, Clock(torch.device("cpu")),
                  gpus_per_node=2)
    node = graph.labels.index
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:13726")
    assert str(run.failure(node("0SEND_F0"), lost)).startswith(
        "rank 0 (w0) failed at step 3, node 0SEND_F0, lost rank 2 (node 1): RuntimeError: [gloo")
    run.recv_marks[node("0RECV_B0")] = 0  # posted; 0B0 waits for it
    assert ", node 0B0, lost rank 2 (node 1): RuntimeError" in str(run.failure(node("0B0"), lost))
    assert ", node 0B0, with rank 2 (node 1): ValueError: 3 != 4" in str(run.failure(node("0B0"), ValueError("3 != 4")))
    del run.recv_marks[node("0RECV_B0")]  # received: what fails now is the backward itself
    assert ", node 0B0: ValueError" in str(run.failure(node("0B0"), ValueError("3 != 4")))
    many = str(run.failed("in optimizer", list(range(1, 20)), lost))  # a large job's lost node: a line still
    assert ", lost rank 1 (node 0), rank 2 (node 1)," in many and ", rank 8 (node 4) and 11 more: RuntimeError" in many


def test_a_lost_link_to_a_sibling_that_failed_first_names_the_rank_the_sibling_lost(tmp_path):
    """On node 0, rank 1 lost rank 2 and exited; rank 0 then finds its link to rank 1 closed. Rank 0
    names rank 2 (rank 1's record, followed), not rank 1; a sibling still running without a record
    is not named; a sibling gone without a record, or a peer of another node, is."""
    import subprocess

    from dflop.backends.torch_runtime.progress import ProgressFile, lost_ranks

    me, sibling = ProgressFile(tmp_path, 0), ProgressFile(tmp_path, 1)  # both this process: alive
    assert lost_ranks(tmp_path, [1, 2]) == [2]  # rank 1 runs and recorded nothing: not lost
    assert lost_ranks(tmp_path, [1]) == [1]  # nothing better to name: the peers as given
    sibling.record_lost([2, 3])
    assert lost_ranks(tmp_path, [1]) == [2, 3]
    sibling.record_lost([0])  # a record pointing back at the asking rank leads nowhere
    assert lost_ranks(tmp_path, [1]) == [1]
    (tmp_path / "rank-1.lost").unlink()
    gone = subprocess.Popen(["true"])  # noqa: S607
    gone.wait()  # reaped: its pid names no process
    (tmp_path / "rank-1.pid").write_text(str(gone.pid))
    assert lost_ranks(tmp_path, [1, 3]) == [1, 3]
    me.close()
    sibling.close()
    failed = ProgressFile(tmp_path, 0)
    failed.record_lost([5])
    failed.close()
    ProgressFile(tmp_path, 0).close()  # a restarted attempt: the earlier attempt's losses are not its own
    assert not (tmp_path / "rank-0.lost").exists()
