"""`dflop run` is one job for every backend of the registry: a backend registered there runs through
the same command, plans and arms, and reports the same JSON as the simulator."""

import json
from dataclasses import dataclass, field

import yaml
from cli_helpers import dflop_here

from dflop.backends import base
from dflop.backends.sim import SimBackend

CONFIG = {"encoder": "tiny-vit", "llm": "tiny-llm", "cluster": {"hardware": "cpu", "nodes": 1, "gpus_per_node": 2},
          "training": {"global_batch": 4}, "data": {"preset": "llava-ov", "samples": 300}, "steps": 2,
          "scheduler": {"solver": "lpt"}}
"""No plan: dflop's search against the baselines, on a cluster small enough to plan in seconds."""


@dataclass
class Recording(SimBackend):
    """The simulator under another name, remembering which arms it ran."""

    name = "recording"
    ran: list[str] = field(default_factory=list)

    def run(self, runner, steps, *, observe=None, meta=None, steps_run=None):
        self.ran.append(meta["name"])
        return super().run(runner, steps, observe=observe, meta=meta)


def run_json(backend, config, out):
    ran = dflop_here("run", "--backend", backend, "--config", config, "--out", out, "--json")
    assert ran.returncode == 0, ran.stderr
    return json.loads(ran.stdout)


def keys(report):
    """Every key of the report, nested ones as dotted paths (the values of 'baselines' and
    'search' aside: they describe the search, not the run)."""
    def walk(value, path):
        if isinstance(value, dict) and path.split(".")[-1] not in ("search", "pruning", "scheduler"):
            for k, v in value.items():
                yield from walk(v, f"{path}.{k}" if path else k)
        else:
            yield path
    return set(walk(report, ""))


def test_a_backend_registered_by_name_runs_every_arm_and_reports_what_the_simulator_reports(tmp_path, monkeypatch):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    sim = run_json("sim", config, tmp_path / "sim")
    made = []

    def recording(**options):
        made.append(Recording(**options))
        return made[-1]

    monkeypatch.setitem(base.BACKENDS, "recording", recording)
    r = run_json("recording", config, tmp_path / "recording")
    assert r["backend"] == "recording" and sim["backend"] == "sim"
    assert keys(r) == keys(sim)
    arms = ["dflop", "baseline"] + (["baseline_balanced"] if (tmp_path / "sim" / "baseline_balanced.trace.json").exists()
                                    else [])
    assert len(made) == 1 and made[0].ran == arms
    for name in arms:  # each arm's trace is the registered backend's (the simulator's, under its name)
        trace = json.loads((tmp_path / "recording" / f"{name}.trace.json").read_text())
        assert trace["otherData"]["name"] == name
    assert r["step_time_s"] == sim["step_time_s"] and r["speedup"] == sim["speedup"]
