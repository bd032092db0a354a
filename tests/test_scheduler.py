import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dflop.errors import DflopError, InfeasibleError
from dflop.schedule import heuristics
from dflop.schedule.improve import improve
from dflop.schedule.problem import PartitionProblem
from dflop.schedule.solve import SOLVERS, partition

FAST = ("lpt", "kk", "greedy", "sequential", "random", "auto")
NODES = 20  # node limits make ILP answers repeatable (wall-time limits do not)


@st.composite
def problems(draw, max_items=60):
    k = draw(st.integers(1, 8))
    n = draw(st.integers(k, max_items))
    d = draw(st.integers(1, 3))
    costs = np.array(draw(st.lists(st.lists(st.floats(0, 100, allow_nan=False), min_size=d, max_size=d),
                                   min_size=n, max_size=n)))
    return PartitionProblem(costs, k)


def check(problem, result):
    a = result.assignment
    assert a.shape == (problem.n,) and a.min() >= 0 and a.max() < problem.bins  # every item once
    assert (np.bincount(a, minlength=problem.bins) > 0).all()                    # no empty bin
    assert result.makespan == pytest.approx(problem.makespan(a))
    assert result.makespan >= result.lower_bound * (1 - 1e-9)
    assert result.status in ("optimal", "feasible", "heuristic")
    if result.status == "optimal":
        assert result.makespan <= result.lower_bound * (1 + 1e-9)


@given(problems(), st.sampled_from(FAST))
def test_invariants_of_every_fast_partitioner(problem, solver):
    check(problem, partition(problem, solver, time_limit=10, node_limit=NODES))


@settings(max_examples=12)
@given(problems(max_items=24))
def test_ilp_never_worse_than_its_warm_start(problem):
    warm = improve(problem, heuristics.lpt(problem))
    result = partition(problem, "ilp", time_limit=10, node_limit=NODES)
    check(problem, result)
    assert result.makespan <= problem.makespan(warm) * (1 + 1e-12)


@given(problems(), st.sampled_from(FAST), st.sampled_from([2.0, 4.0, 8.0, 0.5, 0.25]))
def test_scaling_costs_scales_the_makespan(problem, solver, k):
    # Powers of two scale floats exactly, so even ties between equal loads break the same way;
    # not subnormals, whose last bits a halving drops: those are a different problem.
    scaled = problem.scaled(k)
    assume(np.array_equal(scaled.costs / k, problem.costs))
    run = {"seed": 3, "time_limit": 10, "node_limit": NODES}
    a, b = partition(problem, solver, **run), partition(scaled, solver, **run)
    assert b.makespan == k * a.makespan


@given(problems(), st.sampled_from(FAST))
def test_same_seed_same_result(problem, solver):
    run = {"seed": 5, "time_limit": 10, "node_limit": NODES}
    a, b = partition(problem, solver, **run), partition(problem, solver, **run)
    assert (a.assignment == b.assignment).all()


@st.composite
def capped(draw):
    k = draw(st.integers(2, 6))
    n = draw(st.integers(k, 40))
    costs = np.array(draw(st.lists(st.floats(0.1, 10), min_size=n, max_size=n)))
    tokens = np.array(draw(st.lists(st.integers(1, 100), min_size=n, max_size=n)), dtype=float)
    slack = draw(st.floats(1.3, 3.0))
    cap = max(tokens.max(), tokens.sum() / k * slack)
    return PartitionProblem(costs, k, tokens[:, None], np.array([cap]))


@given(capped(), st.sampled_from(["lpt", "auto"]))
def test_caps_are_respected_or_refused_clearly(problem, solver):
    try:
        result = partition(problem, solver, time_limit=0.3)
    except InfeasibleError as exc:
        assert "cap" in str(exc)
        return
    check(problem, result)
    held = np.bincount(result.assignment, weights=problem.resources[:, 0], minlength=problem.bins)
    assert (held <= problem.caps[0] * (1 + 1e-9)).all()


def test_clear_errors():
    with pytest.raises(DflopError, match="3 items cannot fill 4 bins"):
        PartitionProblem(np.ones((3, 2)), 4)
    with pytest.raises(InfeasibleError, match="item 1 needs 9 of resource 0, more than the per-bin cap 5"):
        PartitionProblem(np.ones(3), 2, np.array([[1.0], [9.0], [1.0]]), np.array([5.0]))
    with pytest.raises(InfeasibleError, match="more than 2 bins x cap 5"):
        PartitionProblem(np.ones(3), 2, np.array([[4.0], [4.0], [4.0]]), np.array([5.0]))
    with pytest.raises(DflopError, match=r"unknown solver 'fast' \(known: auto, ilp"):
        partition(PartitionProblem(np.ones(3), 2), "fast")
    assert set(SOLVERS) == {"auto", "ilp", "greedy", "lpt", "kk", "sequential", "random"}


def known_optimum(rng, k, per_bin, dims=2, target=1000):
    """k bins of per_bin integer items summing to exactly `target` in every dimension, shuffled."""
    parts = []
    for _ in range(k):
        cuts = np.sort(rng.integers(1, target, size=(per_bin - 1, dims)), axis=0)
        edges = np.vstack([np.zeros((1, dims)), cuts, np.full((1, dims), target)])
        parts.append(np.diff(edges, axis=0))
    costs = np.vstack(parts)
    rng.shuffle(costs)
    return PartitionProblem(costs, k)


@pytest.mark.parametrize("k,per_bin,seed", [(3, 3, 0), (4, 4, 1), (4, 4, 2), (8, 6, 3), (16, 8, 4)])
def test_ilp_on_known_optimum_finds_it_or_reports_the_gap(k, per_bin, seed):
    problem = known_optimum(np.random.default_rng(seed), k, per_bin)
    result = partition(problem, "ilp", time_limit=1.0)
    assert result.lower_bound == pytest.approx(1000)
    if k <= 4:
        assert result.makespan == pytest.approx(1000) and result.status == "optimal"
    if result.makespan > 1000 + 1e-6:
        assert result.status == "feasible" and result.gap == pytest.approx(result.makespan / 1000 - 1)


def test_large_batch_is_near_the_bound_fast():
    from dflop.specs import presets
    from dflop.workload import profile_mix

    batch = profile_mix("llava-ov", 4096, presets.encoder("siglip-so400m"), seed=2).samples
    tokens = batch.llm_tokens.astype(float)
    costs = np.stack([batch.tiles * 0.004, tokens * 1e-4 + tokens**2 * 1.5e-9], axis=1)
    result = partition(PartitionProblem(costs, 64), "auto", time_limit=2.0)
    assert result.gap < 1e-3  # speed is measured in benchmarks/bench_scheduler.py
