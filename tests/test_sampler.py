import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflop.errors import DflopError
from dflop.schedule.sampler import BalancedBatchSampler, default_costs
from dflop.specs import presets
from dflop.workload import Modality, Sample, profile_mix

PROFILE = profile_mix("llava-ov", 600, presets.encoder("siglip-so400m"), seed=4)


@settings(max_examples=20)
@given(dp=st.integers(1, 4), m=st.integers(1, 4), extra=st.integers(0, 20), solver=st.sampled_from(["lpt", "kk"]))
def test_ranks_together_cover_each_batch_exactly_once(dp, m, extra, solver):
    batch = dp * m + extra
    samplers = [BalancedBatchSampler(PROFILE, global_batch=batch, dp_size=dp, dp_rank=r, microbatches=m,
                                     solver=solver, seed=7) for r in range(dp)]
    streams = [list(s) for s in samplers]
    assert all(len(stream) == len(samplers[0]) for stream in streams)
    for g, indices in enumerate(samplers[0].global_batches()):
        mine = [streams[r][g * m:(g + 1) * m] for r in range(dp)]
        flat = [i for rank in mine for micro in rank for i in micro]
        assert sorted(flat) == sorted(indices.tolist())
        assert all(len(micro) >= 1 for rank in mine for micro in rank)


def test_deterministic_and_new_every_epoch():
    a = BalancedBatchSampler(PROFILE, global_batch=64, dp_size=2, dp_rank=0, microbatches=4, seed=1)
    b = BalancedBatchSampler(PROFILE, global_batch=64, dp_size=2, dp_rank=0, microbatches=4, seed=1)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first


def test_balanced_against_arrival_order():
    costs = default_costs(PROFILE.samples)
    spread = {}
    for solver in ("lpt", "sequential"):
        sampler = BalancedBatchSampler(PROFILE, global_batch=128, dp_size=4, dp_rank=0, microbatches=4,
                                       solver=solver)
        indices = next(sampler.global_batches())
        bins = [micro for rank in sampler.bins(indices) for micro in rank]
        loads = [costs[b].sum(axis=0).max() for b in bins]
        spread[solver] = max(loads) / np.mean(loads)
    assert spread["lpt"] < spread["sequential"]


def test_shape_function_and_errors():
    def shape(i):
        return Sample(str(i), Modality.IMAGE if i % 2 else Modality.TEXT, 5 * (i % 2), 100 + i, 729 * (i % 2))

    sampler = BalancedBatchSampler(shape, dataset_size=40, global_batch=8, dp_size=2, dp_rank=1, microbatches=2)
    assert len(sampler) == 5 * 2 and all(len(m) >= 1 for m in sampler)
    with pytest.raises(DflopError, match="not deterministic across ranks"):
        BalancedBatchSampler(PROFILE, global_batch=64, dp_size=2, dp_rank=0, microbatches=2, solver="auto")
    with pytest.raises(DflopError, match="dp_rank 2 is outside 0..1"):
        BalancedBatchSampler(PROFILE, global_batch=64, dp_size=2, dp_rank=2, microbatches=2)
    with pytest.raises(DflopError, match="smaller than dp_size x microbatches"):
        BalancedBatchSampler(PROFILE, global_batch=3, dp_size=2, dp_rank=0, microbatches=2)


SMALL = profile_mix("llava-ov", 120, presets.encoder("siglip-so400m"), seed=5).samples


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 120), dp=st.integers(1, 4), m=st.integers(1, 3), extra=st.integers(0, 9),
       drop_last=st.booleans(), shuffle=st.booleans())
def test_every_sample_once_per_epoch_for_any_dataset_length(size, dp, m, extra, drop_last, shuffle):
    table = SMALL.take(np.arange(size))
    batch = dp * m + extra
    make = lambda r: BalancedBatchSampler(table, global_batch=batch, dp_size=dp, dp_rank=r, microbatches=m,
                                          seed=3, shuffle=shuffle, drop_last=drop_last)
    if drop_last and size < batch:
        with pytest.raises(DflopError, match="fewer than one global batch"):
            make(0)
        return
    samplers = [make(r) for r in range(dp)]
    streams = [list(s) for s in samplers]
    assert all(len(stream) == len(samplers[0]) for stream in streams)  # every rank steps alike
    seen = [i for stream in streams for micro in stream for i in micro]
    assert len(seen) == len(set(seen))  # nothing twice
    order = [int(i) for batch_ in samplers[0].global_batches() for i in batch_]
    tail = size % batch if drop_last else 0
    assert sorted(seen) == sorted(order) and len(seen) == size - tail  # only the documented tail dropped
    if drop_last and tail:
        everything = (np.random.default_rng((3, 0)).permutation(size) if shuffle else np.arange(size)).tolist()
        assert set(everything) - set(seen) == set(everything[-tail:])
    assert all(len(micro) >= 1 for stream in streams for micro in stream) or size % batch < dp


def test_a_short_tail_is_kept_without_drop_last():
    # 10 samples, global batch 8, 2 ranks x 2 microbatches: the 2-sample tail is a last step.
    table = SMALL.take(np.arange(10))
    samplers = [BalancedBatchSampler(table, global_batch=8, dp_size=2, dp_rank=r, microbatches=2, drop_last=False)
                for r in range(2)]
    streams = [list(s) for s in samplers]
    assert [len(s) for s in streams] == [3, 3] and len(samplers[0]) == 3
    assert sorted(i for s in streams for micro in s for i in micro) == list(range(10))


@pytest.mark.parametrize("kwargs,message", [
    ({"microbatches": -1}, "microbatches: expected a whole number >= 1, got -1"),
    ({"microbatches": 0}, "microbatches: expected a whole number >= 1, got 0"),
    ({"dp_size": 0}, "dp_size: expected a whole number >= 1, got 0"),
    ({"global_batch": 2.5}, "global_batch: expected a whole number >= 1, got 2.5"),
    ({"dp_rank": -1}, "dp_rank: expected a whole number >= 0, got -1"),
    ({"seed": -3}, "seed: expected a whole number >= 0, got -3"),
    ({"solver": "fastest"}, r"unknown solver 'fastest' \(valid: auto, ilp, greedy, lpt, kk, sequential, random\)"),
])
def test_bad_arguments_fail_on_construction(kwargs, message):
    args = {"global_batch": 8, "dp_size": 2, "dp_rank": 0, "microbatches": 2, **kwargs}
    with pytest.raises(DflopError, match=message):
        BalancedBatchSampler(SMALL, **args)


def test_solver_names_are_case_insensitive():
    a = BalancedBatchSampler(SMALL, global_batch=8, dp_size=2, dp_rank=0, microbatches=2, solver="LPT")
    b = BalancedBatchSampler(SMALL, global_batch=8, dp_size=2, dp_rank=0, microbatches=2, solver="lpt")
    assert list(a) == list(b)
