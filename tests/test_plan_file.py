"""Plan files carry the cluster they were made for: optimize -> simulate / run / export round trips."""

import json

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from cli_helpers import assert_one_line_error, dflop, dflop_json
from dflop.errors import SpecError
from dflop.specs import ClusterSpec, presets
from dflop.specs.plan_file import PlannedCluster, load_plan, save_plan
from test_cli_commands import small_config
from test_specs import plans

clusters = st.builds(ClusterSpec, hardware=st.sampled_from(["h100", "a100-80gb", "cpu"]).map(presets.hardware),
                     nodes=st.integers(1, 128), gpus_per_node=st.sampled_from([1, 2, 4, 8]))
TWO_TP2 = {"encoder": {"tp": 2, "dp": 2}, "llm": {"tp": 2, "dp": 2}, "placement": "colocated", "microbatches": 2}


@given(plan=plans, cluster=clusters)
def test_a_plan_file_gives_back_the_plan_and_its_cluster(tmp_path_factory, plan, cluster):
    path = save_plan(plan, tmp_path_factory.mktemp("plan") / "plan.yaml", cluster)
    read = load_plan(path)
    assert read.plan == plan
    assert read.cluster == PlannedCluster.of(cluster)
    assert read.cluster.cluster(cluster.hardware, read.where) == cluster


def test_a_plan_file_without_a_cluster_still_loads(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(TWO_TP2))
    assert load_plan(path).cluster is None and load_plan(path).plan.gpus == 4


def test_the_recorded_hardware_is_the_configs_or_a_preset():
    h100, h200 = presets.hardware("h100"), presets.hardware("h200")
    planned = PlannedCluster(hardware="H200-SXM-141GB", nodes=2, gpus_per_node=8)
    assert planned.cluster(h100, "p.yaml: cluster").hardware == h200
    assert PlannedCluster(hardware="h200", nodes=1, gpus_per_node=8).cluster(h100, "w").hardware == h200
    with pytest.raises(SpecError, match="p.yaml: cluster: hardware 'TPU-v5' is neither the config's"):
        PlannedCluster(hardware="TPU-v5", nodes=1, gpus_per_node=8).cluster(h100, "p.yaml: cluster")


def test_gpus_and_nodes_resize_a_cluster():
    cluster = ClusterSpec(hardware=presets.hardware("h100"), nodes=4, gpus_per_node=8)
    assert cluster.resized() == cluster
    assert (cluster.resized(gpus=64).nodes, cluster.resized(gpus=64).gpus_per_node) == (8, 8)
    assert (cluster.resized(gpus=4).nodes, cluster.resized(gpus=4).gpus_per_node) == (1, 4)
    assert (cluster.resized(nodes=2).nodes, cluster.resized(nodes=2).gpus_per_node) == (2, 8)
    assert (cluster.resized(gpus=12, nodes=3).nodes, cluster.resized(gpus=12, nodes=3).gpus_per_node) == (3, 4)
    with pytest.raises(SpecError, match="10 GPUs do not split evenly over 3 nodes"):
        cluster.resized(gpus=10, nodes=3)


@pytest.mark.processes
@pytest.mark.parametrize("gpus", [8, 64])
def test_optimize_then_simulate_and_export_the_same_plan_file(tmp_path, gpus):
    plan_file = tmp_path / "plan.yaml"
    config = ["--config", small_config(tmp_path)] if gpus == 8 else []  # 64: the default config has 32
    chosen = dflop_json("optimize", *config, "--gpus", gpus, "--out", plan_file)
    assert yaml.safe_load(plan_file.read_text())["cluster"]["nodes"] * 8 == gpus
    proc = dflop("simulate", *config, "--plan", plan_file, "--steps", 1, "--out", tmp_path / "sim", "--json")
    assert proc.returncode == 0, proc.stderr
    sim = json.loads(proc.stdout)
    assert sim["gpus"] == gpus and sim["plan"]["describe"] == chosen["plan"]["describe"]
    assert sim["note"] == (f"the plan uses {sim['plan_gpus']} of {gpus} GPUs" if sim["plan_gpus"] < gpus else None)
    if gpus == 64:
        assert "was made for 8 x 8 H100-SXM5-80GB: using that cluster" in proc.stderr
    exported = dflop_json("export", plan_file, "--to", "megatron")
    assert "--tensor-model-parallel-size" in exported["text"]


@pytest.mark.processes
def test_a_1024_gpu_plan_file_simulates_on_its_cluster(tmp_path):
    plan = load_plan_from({"encoder": {"tp": 2, "dp": 128}, "llm": {"tp": 2, "dp": 128}, "placement": "colocated",
                           "microbatches": 2, "cluster": {"hardware": "H100-SXM5-80GB", "nodes": 128,
                                                          "gpus_per_node": 8}}, tmp_path)
    sim = dflop_json("simulate", "--plan", plan, "--steps", 1, "--out", tmp_path / "sim")
    assert sim["gpus"] == 1024 and sim["note"] == "the plan uses 256 of 1024 GPUs"
    assert "data_parallel_shard_degree" in dflop_json("export", plan, "--to", "torchtitan")["text"]


def load_plan_from(data, tmp_path, name="plan.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.processes
def test_a_plan_smaller_than_the_cluster_is_named(tmp_path):
    plan = load_plan_from(TWO_TP2, tmp_path)
    proc = dflop("simulate", "--config", small_config(tmp_path), "--plan", plan, "--steps", 1, "--out", tmp_path / "s")
    assert proc.returncode == 0, proc.stderr
    assert "(the plan uses 4 of 8 GPUs)" in proc.stdout.splitlines()[0]


@pytest.mark.processes
def test_gpus_and_nodes_override_the_plans_cluster(tmp_path):
    plan = load_plan_from({**TWO_TP2, "cluster": {"hardware": "h100", "nodes": 1, "gpus_per_node": 4}}, tmp_path)
    config = small_config(tmp_path)
    args = ("simulate", "--config", config, "--plan", plan, "--steps", 1, "--out", tmp_path / "s")
    assert dflop_json(*args)["gpus"] == 4
    wider = dflop_json(*args, "--gpus", 16)
    assert wider["gpus"] == 16 and wider["note"] == "the plan uses 4 of 16 GPUs"
    assert dflop_json(*args, "--nodes", 2)["gpus"] == 8
    assert_one_line_error(dflop(*args, "--gpus", 10, "--nodes", 3), "10 GPUs do not split evenly over 3 nodes")


@pytest.mark.processes
def test_a_plan_for_other_hardware_runs_on_that_hardware(tmp_path):
    plan = load_plan_from({**TWO_TP2, "cluster": {"hardware": "H200-SXM-141GB", "nodes": 1, "gpus_per_node": 4}},
                          tmp_path)
    proc = dflop("simulate", "--config", small_config(tmp_path), "--plan", plan, "--steps", 1,
                 "--out", tmp_path / "s")
    assert proc.returncode == 0, proc.stderr
    assert "on 4 x H200-SXM-141GB" in proc.stderr


@pytest.mark.parametrize("cluster, message", [
    ({"hardware": "TPU-v5", "nodes": 1, "gpus_per_node": 4}, "plan.yaml: cluster: hardware 'TPU-v5' is neither"),
    ({"hardware": "h100", "gpus": 4}, "plan.yaml: cluster: unknown key 'gpus'"),
    ({"hardware": "h100", "nodes": 0, "gpus_per_node": 4}, "plan.yaml: cluster.nodes: must be at least 1"),
])
@pytest.mark.processes
def test_a_bad_recorded_cluster_is_a_one_line_error(tmp_path, cluster, message):
    plan = load_plan_from({**TWO_TP2, "cluster": cluster}, tmp_path)
    assert_one_line_error(dflop("simulate", "--plan", plan, "--out", tmp_path / "s"), message)


@pytest.mark.processes
def test_run_takes_a_plan_file_and_compares_it_with_itself_on_arrival_order(tmp_path):
    plan = load_plan_from({**TWO_TP2, "cluster": {"hardware": "h100", "nodes": 1, "gpus_per_node": 8}}, tmp_path)
    proc = dflop("run", "--config", small_config(tmp_path), "--plan", plan, "--steps", 1, "--out", tmp_path / "run",
                 "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["plan"]["describe"] == r["baseline"]["plan"]["describe"] == load_plan(plan).plan.describe()
    assert r["gpus"] == 8 and r["plan_gpus"] == 4 and "dflop: the plan uses 4 of 8 GPUs" in proc.stderr
    assert "searching plans" not in proc.stderr
    assert load_plan(r["artifacts"]["plan"]).cluster == PlannedCluster(hardware="H100-SXM5-80GB", nodes=1,
                                                                       gpus_per_node=8)


@pytest.mark.processes
def test_help_texts_say_what_the_commands_do():
    from dflop.specs.scheduling import Solver

    schedule = dflop("schedule", "--help").stdout
    assert all(s.value in schedule for s in Solver)
    run = " ".join(dflop("run", "--help").stdout.split())
    assert "trains the models for real" in run and "--plan" in run and "--gpus" in run and "--nodes" in run
    assert "--gpus" in dflop("simulate", "--help").stdout and "--nodes" in dflop("optimize", "--help").stdout
