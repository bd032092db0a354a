import threading
import time
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflop.schedule.background import AsyncScheduler, FileChannel, SchedulerError, check_schedule
from dflop.schedule.step import StepSchedule
from dflop.specs import presets
from dflop.workload import batches, profile_mix

TABLE = profile_mix("llava-ov", 200, presets.encoder("siglip-so400m"), seed=0).samples


def simple(batch, bins=4):
    return StepSchedule(tuple(str(i) for i in batch.ids), np.arange(len(batch)) % bins, 2, bins // 2)


@settings(max_examples=15)
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


def test_late_solve_falls_back_without_blocking():
    def slow(b, limit):
        time.sleep(0.5)
        return simple(b)

    with AsyncScheduler(batches(TABLE, 16), slow, simple, deadline=0.05) as scheduler:
        start = time.perf_counter()
        batch, schedule = scheduler.get(0)
        assert time.perf_counter() - start < 0.3
        assert scheduler.late == 1 and len(schedule.ids) == 16


def test_worker_crash_surfaces_as_error():
    def broken(b, limit):
        raise ValueError("solver exploded")

    with AsyncScheduler(batches(TABLE, 16), broken, simple, deadline=5.0) as scheduler:
        start = time.perf_counter()
        with pytest.raises(SchedulerError, match="worker failed at step 0: ValueError: solver exploded"):
            scheduler.get(0)
        assert time.perf_counter() - start < 2.0


def test_end_of_stream_is_an_error_not_a_hang():
    with AsyncScheduler(iter([TABLE.take(np.arange(8))]), lambda b, t: simple(b), simple, deadline=1.0) as s:
        s.get(0)
        with pytest.raises(SchedulerError, match="stream ended"):
            s.get(1)


def test_every_rank_reads_the_same_schedule(tmp_path):
    channel = FileChannel(tmp_path / "schedules")
    read: dict[int, list] = {}

    def other_rank():
        read[1] = [channel.read(step, timeout=10).bins() for step in range(3)]

    reader = threading.Thread(target=other_rank)
    reader.start()
    with AsyncScheduler(batches(TABLE, 20), lambda b, t: simple(b), simple, deadline=1.0,
                        channel=channel) as scheduler:
        mine = [scheduler.get(step)[1].bins() for step in range(3)]
    reader.join(timeout=10)
    assert read[1] == mine
    with pytest.raises(SchedulerError, match="no schedule for step 9"):
        channel.read(9, timeout=0.05)
