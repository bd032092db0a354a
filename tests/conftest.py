"""Shared fixtures. Hypothesis runs without deadlines: CI machines are shared and noisy."""

import os

import pytest
from hypothesis import HealthCheck, settings

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
