import threading
import time
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflop.errors import DflopError
from dflop.schedule.background import AsyncScheduler, SchedulerError, check_schedule
from dflop.schedule.step import StepSchedule
from dflop.specs import presets
from dflop.workload import batches, profile_mix

TABLE = profile_mix("llava-ov", 200, presets.encoder("siglip-so400m"), seed=0).samples
BOUND = 5.0
"""Seconds a get may take past its deadline: the fallback's time and thread wake-ups on a loaded
machine, generously. What it guards against is waiting on a slow solve (SLOW) or a hung one."""
SLOW = 30.0
"""Seconds a slow solve takes (cut short when its test ends)."""


def simple(batch, bins=4, order="fallback"):
    return StepSchedule(tuple(str(i) for i in batch.ids), np.arange(len(batch)) % bins, 2, bins // 2, order=order)


def stream(steps, size=4):
    """Batches whose ids name their step: s<step>:<k>."""
    for step in range(steps):
        rows = TABLE.take(np.arange(step * size, (step + 1) * size) % len(TABLE))
        yield rows.with_ids([f"s{step}:{k}" for k in range(size)])


def step_of(batch):
    return int(str(batch.ids[0]).split(":")[0][1:])


def in_thread(work, timeout):
    """work()'s result, computed in a thread: if it hangs the test fails instead of hanging."""
    out, error = [], []

    def run():
        try:
            out.append(work())
        except BaseException as exc:  # re-raised below
            error.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"hung for {timeout} s"
    if error:
        raise error[0]
    return out[0]


def consume(scheduler, steps, timeout=60.0):
    """(batch, schedule, seconds) of every step; a get that hangs fails the test."""
    def work():
        out = []
        for step in range(steps):
            start = time.monotonic()
            batch, schedule = scheduler.get(step)
            out.append((batch, schedule, time.monotonic() - start))
        return out

    return in_thread(work, timeout)


class FaultySolver:
    """A solver with a planned fault per step: ok, raise, hang (until released), slow, wrong."""

    def __init__(self, plan, slow=SLOW):
        self.plan, self.slow = plan, slow
        self.release = threading.Event()
        self.returned_ok: set[int] = set()
        self.started: set[int] = set()

    def __call__(self, batch, limit):
        step = step_of(batch)
        self.started.add(step)
        fault = self.plan.get(step, "ok")
        if fault == "raise":
            raise RuntimeError(f"injected failure at step {step}")
        if fault == "hang":
            self.release.wait()
        if fault == "slow":
            self.release.wait(self.slow)
        if fault == "wrong":  # a schedule for another batch
            return simple(TABLE.take(np.arange(len(batch))), order="solver")
        self.returned_ok.add(step)
        return simple(batch, order="solver")

    def stored_before(self, step):
        """Whether step's solve returned a good schedule and the worker has moved on since (so the
        schedule was stored): then the step must be served by the solver."""
        return step in self.returned_ok and any(s > step for s in self.started)


def run_case(plan, steps, deadline, lookahead):
    solver = FaultySolver(plan)
    with AsyncScheduler(stream(steps), solver, simple, deadline=deadline, lookahead=lookahead) as scheduler:
        due, served = {}, []
        try:
            for step in range(steps):
                due[step] = solver.stored_before(step)
                start = time.monotonic()
                batch, schedule = scheduler.get(step)
                served.append((batch, schedule, time.monotonic() - start))
        finally:
            solver.release.set()  # before closing: the worker may be held by a hang
    seen = Counter()
    for step, (batch, schedule, seconds) in enumerate(served):
        assert seconds <= deadline + BOUND, f"step {step} waited {seconds:.3f} s (deadline {deadline} s)"
        check_schedule(batch, schedule)
        assert step_of(batch) == step
        seen.update(schedule.ids)
        if due[step]:
            assert schedule.order == "solver", f"step {step} was solved before it was due, yet lost"
        if plan.get(step) in ("raise", "wrong"):
            assert schedule.order == "fallback"
    assert sum(seen.values()) == len(seen) == steps * 4  # every sample of every batch, once
    return scheduler


def test_faults_never_cost_a_step_its_deadline_or_a_solved_step():
    """10^4 steps with injected faults (raise, hang, slow, wrong batch), seeded; a get that hangs
    fails the test through `in_thread`."""
    rng = np.random.default_rng(7)
    faults = ["ok", "raise", "wrong", "slow", "hang"]
    steps_done = 0
    while steps_done < 10_000:
        steps = int(rng.integers(10, 60))
        plan = {s: str(rng.choice(faults, p=[0.84, 0.06, 0.06, 0.025, 0.015])) for s in range(steps)}
        deadline = float(rng.choice([0.0002, 0.0005, 0.001]))
        lookahead = int(rng.integers(1, 4))
        in_thread(lambda: run_case(plan, steps, deadline, lookahead), timeout=60)
        steps_done += steps


def test_a_failing_solve_loses_none_of_the_steps_solved_before_it():
    solver = FaultySolver({3: "raise"})
    with AsyncScheduler(stream(6), solver, simple, deadline=5.0, lookahead=4) as scheduler:
        give_up = time.monotonic() + 10
        while 3 not in solver.started and time.monotonic() < give_up:
            time.sleep(0.001)  # the worker has solved steps 0-2 and tried step 3
        served = consume(scheduler, 6)
    assert [s.order for _, s, _ in served[:3]] == ["solver"] * 3
    assert served[3][1].order == "fallback"
    assert scheduler.failures == ["step 3: RuntimeError: injected failure at step 3"]
    assert [s.order for _, s, _ in served[4:]] == ["solver"] * 2


def test_a_schedule_for_the_wrong_batch_leaves_the_batch_recoverable():
    with AsyncScheduler(stream(2), FaultySolver({0: "wrong"}), simple, deadline=5.0) as scheduler:
        (batch, schedule, _), _ = consume(scheduler, 2)
    check_schedule(batch, schedule)
    assert schedule.order == "fallback" and "does not hold exactly the samples" in scheduler.failures[0]


def test_a_hung_solve_holds_back_no_later_step():
    solver = FaultySolver({0: "hang"})
    with AsyncScheduler(stream(4), solver, simple, deadline=0.05) as scheduler:
        try:
            served = consume(scheduler, 4, timeout=20)
        finally:
            solver.release.set()
    assert all(seconds < 0.05 + BOUND for _, _, seconds in served)
    assert [s.order for _, s, _ in served] == ["fallback"] * 4 and scheduler.late == 4


def test_a_slow_solve_holds_back_neither_its_step_nor_the_next():
    solver = FaultySolver({0: "slow"})
    with AsyncScheduler(stream(2), solver, simple, deadline=0.05, lookahead=1) as scheduler:
        start = time.monotonic()
        try:
            consume(scheduler, 2, timeout=SLOW)
        finally:
            solver.release.set()
        both = time.monotonic() - start
    assert both < 2 * (0.05 + BOUND) < SLOW  # not held until the slow solve returns
    assert scheduler.late == 2


def test_a_late_answer_is_discarded_not_served_twice():
    solver = FaultySolver({0: "slow"}, slow=0.3)
    with AsyncScheduler(stream(3), solver, simple, deadline=0.01, lookahead=1) as scheduler:
        (_, first, _), = consume(scheduler, 1)
        time.sleep(0.6)  # the slow solve of step 0 returns now, after its step was served
        rest = [scheduler.get(step)[1] for step in (1, 2)]
    assert first.order == "fallback" and scheduler.discarded == 1
    assert [s.order for s in rest] == ["solver", "solver"]


@settings(max_examples=15, deadline=None)
@given(delays=st.lists(st.sampled_from([0.0, 0.0, 0.05]), min_size=6, max_size=6),
       lookahead=st.integers(1, 3), batch=st.integers(8, 40))
def test_every_sample_once_whatever_the_timing(delays, lookahead, batch):
    pauses = iter(delays)

    def solve(b, limit):
        time.sleep(next(pauses, 0.0))  # some solves miss the 20 ms deadline, some do not
        return simple(b)

    seen = Counter()
    with AsyncScheduler(batches(TABLE, batch, seed=1), solve, simple, deadline=0.02,
                        lookahead=lookahead) as scheduler:
        for step in range(6):
            b, schedule = scheduler.get(step)
            check_schedule(b, schedule)
            seen.update(schedule.ids)
    assert all(v == 1 for v in seen.values()) and sum(seen.values()) == 6 * batch


def test_a_failing_fallback_is_an_error_naming_the_step():
    def broken(b):
        raise ValueError("fallback exploded")

    with AsyncScheduler(stream(1), FaultySolver({0: "raise"}), broken, deadline=5.0) as scheduler:
        with pytest.raises(SchedulerError, match="step 0: the fallback scheduler failed: ValueError: fallback explo"):
            scheduler.get(0)


def test_end_of_stream_is_an_error_not_a_hang():
    with AsyncScheduler(iter([TABLE.take(np.arange(8))]), lambda b, t: simple(b), simple, deadline=1.0) as s:
        s.get(0)
        with pytest.raises(SchedulerError, match="no batch for step 1: the batch stream ended"):
            s.get(1)


def test_a_failing_stream_is_an_error_naming_the_step():
    def failing():
        yield TABLE.take(np.arange(8))
        raise OSError("disk gone")

    with AsyncScheduler(failing(), lambda b, t: simple(b), simple, deadline=1.0) as s:
        s.get(0)
        with pytest.raises(SchedulerError, match="no batch for step 1: the batch stream failed: OSError: disk gone"):
            s.get(1)


@pytest.mark.parametrize("deadline", [0.0, -1.0, float("inf"), float("nan")])
def test_deadline_must_be_finite_and_positive(deadline):
    with pytest.raises(DflopError, match="deadline: must be a finite number of seconds above 0"):
        AsyncScheduler(stream(1), lambda b, t: simple(b), simple, deadline=deadline)


