"""A frozen encoder on the torch backend: every placement trains what one process trains with the
encoder's weights untouched, and runs the simulator's nodes, which have no encoder backward."""

from dataclasses import replace

import numpy as np
import pytest

from dflop.backends import get_backend
from dflop.backends.torch_runtime.backend import TorchBackend
from dflop.backends.torch_runtime.model import build_stage, whole_model_name
from dflop.backends.torch_runtime.reference import reference_training
from dflop.backends.torch_runtime.worker import TorchOptions
from dflop.specs import ModulePlan, Plan
from dflop.specs.plan import Module
from dflop.timing.steps import CostedPlan
from test_torch_backend import MODEL, max_difference, node_sequences, scheduled, small_samples, system_of  # noqa: F401

pytestmark = pytest.mark.processes

PLANS = {  # every placement, a pipeline and data parallelism, ZeRO 1 and FSDP2's ZeRO-3
    "colocated pp2 x dp2": Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(pp=2, dp=2), placement="colocated",
                                microbatches=2),
    "disaggregated encoder dp2 + llm pp2": Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(pp=2), microbatches=2),
    "heterogeneous encoder dp4, llm pp2 x dp2": Plan(encoder=ModulePlan(dp=4), llm=ModulePlan(pp=2, dp=2),
                                                     placement="heterogeneous", microbatches=2),
    "dp2 ZeRO-3 (FSDP2)": Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(dp=2), placement="colocated",
                               microbatches=2, zero=3),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_a_frozen_encoder_trains_as_the_reference_and_stays_as_it_was(small_samples, name):
    plan = PLANS[name]
    base = system_of()
    system = replace(base, training=replace(base.training, freeze_encoder=True))
    assert not plan.problems(system.cluster, MODEL, 8)
    steps = scheduled(system, plan, small_samples, 2)
    options = TorchOptions(dtype="float64", lr=1e-2, seed=7)
    result = TorchBackend(options=options, keep_parameters=True).run(CostedPlan(plan, system), steps)
    ref = reference_training(MODEL, [s.batch for s in steps], options, freeze_encoder=True)
    assert max_difference(result.extra["parameters"], ref.parameters) < 1e-9
    assert result.extra["losses"] == pytest.approx(ref.losses, rel=1e-12)
    initial = {f"encoder.{n}": p.detach().double()
               for n, p in build_stage(MODEL, Module.ENCODER, 0, (MODEL.encoder.layers,), options.seed).named_parameters()}
    encoder = {n: ref.parameters[n] for n in initial}
    assert max(float((encoder[n] - initial[n]).abs().max()) for n in initial) == 0.0  # untouched
    trained = reference_training(MODEL, [s.batch for s in steps], options)
    assert max(float((trained.parameters[n] - initial[n]).abs().max()) for n in initial) > 1e-4  # would move
    copies = [{n: t for n, t in params.items() if whole_model_name(n, MODEL.llm.tie_embeddings) in initial}
              for params in result.extra["rank_parameters"].values()]
    copies = [c for c in copies if c]  # every rank's copy of the encoder
    assert copies and all(max_difference(c, ref.parameters) < 1e-9 for c in copies)
    simulated = get_backend("sim").run(CostedPlan(plan, system), steps)
    sequences = node_sequences(result.trace)
    assert sequences == node_sequences(simulated.trace)
    names = " ".join(n for seq in sequences.values() for n in seq)
    assert "ENCODE_B" not in names and "ALL_TO_ALL_B" not in names and "BRIDGE_SEND_B" not in names
