"""Shared fixtures. Hypothesis runs without deadlines: CI machines are shared and noisy.

The fast tier (`make test-fast`: ``DFLOP_TEST_TIER=fast``, tests not marked ``processes``) keeps
its promise by itself: there, a test that starts a process fails at once, naming the marker it
lacks, so a slow test cannot slip into the tier a developer runs while working."""

import multiprocessing.process
import os
import subprocess

import pytest
from hypothesis import HealthCheck, settings

FAST_TIER = os.environ.get("DFLOP_TEST_TIER") == "fast"

settings.register_profile(
    "dflop", deadline=None, max_examples=int(os.environ.get("DFLOP_HYPOTHESIS_EXAMPLES", "60")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("dflop")


@pytest.fixture(scope="session")
def model():
    from dflop.specs import presets

    return presets.model("siglip-so400m", "qwen2.5-7b")


@pytest.fixture(scope="session")
def h100():
    from dflop.specs import presets

    return presets.hardware("h100")


@pytest.fixture(scope="session")
def training():
    from dflop.specs import TrainingSpec

    return TrainingSpec(global_batch=256)


@pytest.fixture(scope="session")
def cluster(h100):
    from dflop.specs import ClusterSpec

    return ClusterSpec(hardware=h100, nodes=4, gpus_per_node=8)


@pytest.fixture(autouse=True)
def _in_process_only(request, monkeypatch):
    """In the fast tier, starting a process (a subprocess, a multiprocessing or torch launcher child)
    fails the test unless it is marked ``processes``."""
    if FAST_TIER and request.node.get_closest_marker("processes") is None:
        def refuse(*args, **kwargs):
            raise RuntimeError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.processes "
                               "(make test-fast runs only tests that start none)")

        monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    yield
