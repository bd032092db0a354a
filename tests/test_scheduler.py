import os
import time

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dflop.errors import DflopError, InfeasibleError
from dflop.schedule import heuristics, ilp
from dflop.schedule.improve import improve
from dflop.schedule.problem import PartitionProblem, Status
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


@pytest.mark.processes  # the auto solver's ILP runs in a forked process
@given(problems(), st.sampled_from(FAST))
def test_invariants_of_every_fast_partitioner(problem, solver):
    check(problem, partition(problem, solver, time_limit=10, node_limit=NODES))


@pytest.mark.processes
@settings(max_examples=12, deadline=None)
@given(problems(max_items=24))
def test_ilp_never_worse_than_its_warm_start(problem):
    warm = improve(problem, heuristics.lpt(problem))
    outcome = ilp.solve(problem, warm, time_limit=10, node_limit=NODES)
    assert problem.makespan(outcome.assignment) <= problem.makespan(warm) * (1 + 1e-12)


@pytest.mark.processes
@given(problems(), st.sampled_from(FAST), st.sampled_from([2.0, 4.0, 8.0, 0.5, 0.25]))
def test_scaling_costs_scales_the_makespan(problem, solver, k):
    # Powers of two scale floats exactly, so even ties between equal loads break the same way;
    # not subnormals, whose last bits a halving drops: those are a different problem.
    scaled = problem.scaled(k)
    assume(np.array_equal(scaled.costs / k, problem.costs))
    run = {"seed": 3, "time_limit": 10, "node_limit": NODES}
    a, b = partition(problem, solver, **run), partition(scaled, solver, **run)
    assert b.makespan == k * a.makespan


@pytest.mark.processes  # the auto solver's ILP runs in a forked process
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


@pytest.mark.processes
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
    with pytest.raises(DflopError, match=r"unknown solver 'fast' \(valid: auto, ilp, greedy, lpt, kk, sequential, "
                                         r"random\)"):
        partition(PartitionProblem(np.ones(3), 2), "fast")
    assert set(SOLVERS) == {"auto", "ilp", "greedy", "lpt", "kk", "sequential", "random"}
    assert partition(PartitionProblem(np.ones(3), 2), " LPT ").solver == "lpt"  # any case


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


@pytest.mark.processes
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


@st.composite
def any_problems(draw):
    """Problems with and without per-bin caps (caps loose enough that LPT fits them)."""
    problem = draw(problems(max_items=30))
    if not draw(st.booleans()):
        return problem
    tokens = np.array(draw(st.lists(st.integers(0, 50), min_size=problem.n, max_size=problem.n)), dtype=float)
    cap = max(tokens.max(), tokens.sum() / problem.bins * 2.0, 1.0)
    return PartitionProblem(problem.costs, problem.bins, tokens[:, None], np.array([cap]))


@pytest.mark.processes
@settings(max_examples=40, deadline=None)
@given(any_problems(), st.sampled_from(SOLVERS))
def test_every_solver_puts_every_item_in_exactly_one_bin(problem, solver):
    try:
        result = partition(problem, solver, time_limit=10, node_limit=NODES)
    except InfeasibleError:
        assert solver in ("sequential", "random") and problem.resources is not None  # data-blind, capped
        return
    check(problem, result)
    assert np.array_equal(np.sort(np.bincount(result.assignment, minlength=problem.bins)).sum(), problem.n)
    assert problem.feasible(result.assignment)


@pytest.mark.parametrize("seed", range(6))
def test_auto_finds_the_known_optimum_of_small_instances(seed):
    """24 items in 4 bins with a perfect partition: a needle the exchange search alone misses
    (0.2-0.6% above) and the complete search finds."""
    problem = known_optimum(np.random.default_rng(100 + seed), 4, 6)
    result = partition(problem, "auto", time_limit=5.0)
    assert result.makespan == pytest.approx(1000) and result.status == Status.OPTIMAL


@pytest.mark.parametrize("seed", range(3))
def test_auto_is_within_a_tenth_of_a_percent_on_larger_known_optima(seed):
    # 128 items in 8 bins, costs cut from two equal targets: too many items for the complete search.
    rng = np.random.default_rng(seed)
    parts = [rng.dirichlet(np.ones(16), size=2).T for _ in range(8)]
    problem = PartitionProblem(np.vstack(parts)[rng.permutation(128)], 8)
    optimum = max(part.sum(axis=0).max() for part in parts)
    result = partition(problem, "auto", time_limit=5.0)
    assert result.makespan <= optimum * (1 + 1e-3)
    assert result.lower_bound == pytest.approx(optimum)  # the bound is tight here, so the gap is honest


CAPPED = [  # (costs, tokens, cap, bins): KK's split broke the cap; LPT's did not
    ([4, 1, 1, 2, 1], [7, 5, 6, 3, 6], 11, 3),
    ([8, 4, 4, 6, 6, 9], [2, 4, 2, 8, 5, 1], 10, 3),
    ([6, 6, 8, 4], [9, 7, 6, 3], 14, 2),
    ([6, 3, 7, 3, 3, 7, 3, 7], [9, 8, 8, 2, 5, 7, 8, 5], 20, 3),
]


@pytest.mark.parametrize("costs,tokens,cap,bins", CAPPED)
@pytest.mark.parametrize("solver", ["kk", "auto", "ilp", "greedy"])
def test_a_heuristic_failing_the_caps_does_not_hide_one_that_fits(costs, tokens, cap, bins, solver):
    problem = PartitionProblem(np.array(costs, float), bins, np.array(tokens, float)[:, None], np.array([cap], float))
    heuristics.lpt(problem)  # fits
    result = partition(problem, solver, time_limit=2.0)
    check(problem, result)
    assert problem.feasible(result.assignment)


@pytest.mark.parametrize("costs,message", [
    ([[1e308], [1e308], [1.0]], "costs: the total of dimension 0 is beyond the float range "
                                r"\(item 0 alone has 1e\+308\); rescale them"),
    ([[1.0, np.inf], [1.0, 1.0]], "costs: item 0 has cost inf in dimension 1; expected a finite number >= 0"),
    ([[1.0], [np.nan]], "costs: item 1 has cost nan in dimension 0"),
    ([[1.0], [-2.0]], "costs: item 1 has cost -2.0 in dimension 0"),
])
def test_costs_are_validated_once_for_every_entry_point(costs, message):
    with pytest.raises(DflopError, match=message):
        PartitionProblem(np.array(costs), 2)


def test_costs_name_items_by_their_ids():
    with pytest.raises(DflopError, match="item true has cost -1.0"):
        PartitionProblem(np.array([1.0, -1.0]), 2, ids=["a", True])


@pytest.mark.parametrize("limit", [0, -1.0, float("inf"), float("nan"), "1"])
def test_time_limits_must_be_finite_and_positive(limit):
    with pytest.raises(DflopError, match="time limit: "):
        partition(PartitionProblem(np.ones(4), 2), "ilp", time_limit=limit)


def test_one_status_vocabulary():
    problem = PartitionProblem(np.array([5.0, 4, 3, 3, 3]), 2)  # bound 9, optimum 9: only search finds it
    statuses = {s: partition(problem, s, time_limit=2.0).status for s in SOLVERS}
    assert {statuses[s] for s in ("lpt", "kk", "sequential", "random")} <= {Status.HEURISTIC, Status.OPTIMAL}
    assert statuses["sequential"] == Status.HEURISTIC  # 12 vs 6: no search, no proof
    assert all(statuses[s] == Status.OPTIMAL for s in ("auto", "ilp", "greedy"))
    unproved = PartitionProblem(np.array([[3.0, 1], [1, 3], [2, 2]]), 2)  # bound 3, optimum 4
    assert partition(unproved, "greedy").status == Status.FEASIBLE  # searched, not proved
    assert partition(unproved, "auto").status == Status.OPTIMAL  # the complete search proves it
    assert {str(s) for s in Status} == {"optimal", "feasible", "heuristic"}


@pytest.mark.processes
def test_the_ilp_solver_is_held_to_its_time_limit(monkeypatch):
    """A solve that overruns its limit (HiGHS's root heuristics do not check the clock) is cut off."""
    def stubborn(model, deadline):
        time.sleep(30)

    monkeypatch.setattr(ilp, "_solve_model", stubborn)
    problem = PartitionProblem(np.random.default_rng(0).random((40, 2)), 4)
    start = time.monotonic()
    outcome = ilp.solve(problem, heuristics.lpt(problem), time_limit=0.5, backend="highs")
    assert time.monotonic() - start < 10  # not 30: the child was killed at the deadline
    assert outcome.solver_status == "killed at the time limit" and outcome.proven_bound is None


@pytest.mark.processes
def test_solver_messages_never_reach_stdout(monkeypatch, capfd):
    def chatty(model, deadline):
        os.write(1, b"Cbc0010I some message\n")
        return None, None, "stopped"

    monkeypatch.setattr(ilp, "_solve_model", chatty)
    problem = PartitionProblem(np.ones((6, 2)), 3)
    ilp.solve(problem, heuristics.lpt(problem), time_limit=5.0)
    out, err = capfd.readouterr()
    assert out == "" and "Cbc0010I" in err
