"""Progress off a terminal, on a fake clock: at most one line per period, a last line when done;
and the time estimate said before profiling on a CPU."""

import io
import re
import subprocess
import sys
import threading
import time

import pytest

from dflop.cli.progress import progress_bar
from dflop.cost.flops import llm_layer_flops
from dflop.profile.estimate import WARN_S, duration, profile_estimate
from dflop.specs import presets


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def lines_of(stream):
    return stream.getvalue().splitlines()


def seconds(line):
    fields = re.search(r"([\d:]+) elapsed", line).group(1).split(":")
    return sum(int(x) * 60**i for i, x in enumerate(reversed(fields)))


def run(updates, period=5.0, describe="profiling tiny-llm", unit="shapes"):
    """Report ``(time, done, total)`` updates; return the lines written."""
    clock, stream = FakeClock(), io.StringIO()
    with progress_bar(describe, unit, stream=stream, terminal=False, clock=clock, period=period, beat=False) as p:
        for t, done, total in updates:
            clock.now = t
            p("a shape", done, total)
    return lines_of(stream)


def test_at_most_one_line_per_period_and_a_last_line():
    lines = run([(0.1 * k, k, 400) for k in range(401)])  # 40 s, ten updates a second
    assert lines[-1] == "dflop: profiling tiny-llm: 400/400 shapes, 0:40 elapsed"
    times = [seconds(line) for line in lines]
    assert times[:-1] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert all(b - a >= 5 for a, b in zip(times[:-2], times[1:-1]))


def test_quick_work_writes_only_the_last_line():
    assert run([(0.001 * k, k, 1000) for k in range(1001)]) == ["dflop: profiling tiny-llm: 1000/1000 shapes, 0:01 elapsed"]


def test_gaps_grow_with_the_time_elapsed():
    lines = run([(float(t), t, 7200) for t in range(7201)])  # two hours, an update a second
    times = [seconds(line) for line in lines[:-1]]
    assert all(b - a >= max(5, int(0.1 * b)) for a, b in zip(times, times[1:]))
    assert len(lines) < 80  # not one line per five seconds (1440)


def test_nothing_written_without_updates_or_on_error():
    assert run([]) == []
    clock, stream = FakeClock(), io.StringIO()
    with pytest.raises(RuntimeError):
        with progress_bar("profiling x", "shapes", stream=stream, terminal=False, clock=clock, beat=False) as p:
            p("a", 1, 4)
            raise RuntimeError("boom")
    assert lines_of(stream) == []  # the error has its own line


def test_heartbeat_between_updates_and_channels():
    clock, stream = FakeClock(), io.StringIO()
    with progress_bar(stream=stream, terminal=False, clock=clock, period=5.0, beat=False) as p:
        p("dflop colocated", 3, 48)
        clock.now = 4.0
        p.display.tick()
        assert lines_of(stream) == []
        clock.now = 6.0
        p.display.tick()  # one long unit of work: the line still comes
        assert lines_of(stream) == ["dflop: searching dflop colocated plans: 3/48 plans, 0:06 elapsed"]
        steps = p.channel("running {}", "steps")
        clock.now = 7.0
        steps("dflop", 2, 8)
        clock.now = 8.0
        steps("dflop", 8, 8)
    # the last line says that both parts are done, not only the steps
    assert lines_of(stream)[1:] == ["dflop: done: 2 parts in 0:08, the last running dflop (8/8 steps)"]


def test_profile_estimate():
    cpu = presets.hardware("cpu")
    # tiny shapes all take the profiler's minimum sample (3 x 20 ms), 2 probes + 2 warm-up + 7 repeats each.
    tiny = profile_estimate("tiny-llm", cpu, grid="quick")
    assert tiny.shapes == 10 and tiny.seconds == pytest.approx(10 * 11 * 0.060)
    big = profile_estimate("qwen2.5-7b", cpu)
    llm = presets.llm("qwen2.5-7b")
    # the largest block: the CPU grid's 16384 tokens as four sequences of 4096
    assert big.largest_flops == pytest.approx(float(llm_layer_flops(llm, 16384, 4 * 4096**2).total))
    assert big.seconds > WARN_S > tiny.seconds
    assert profile_estimate("qwen2.5-7b", cpu, tps=(2,)).seconds < big.seconds
    assert [duration(s) for s in (40, 420, 22076)] == ["40 s", "7 min", "6 h 8 min"]


@pytest.mark.processes
def test_profiling_a_large_model_on_cpu_warns_before_starting(tmp_path):
    # The first line comes before the first shape is measured; the run is stopped there.
    proc = subprocess.Popen([sys.executable, "-m", "dflop.cli.main", "profile", "model", "--model", "qwen2.5-7b",
                             "--out", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        first = proc.stderr.readline()
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert first.startswith("dflop: warning: profiling qwen2.5-7b on cpu may take about ") and "--grid quick" in first
    assert not (tmp_path / "profile.jsonl").exists()  # said before anything was measured


def test_a_launcher_tells_the_steps_every_rank_has_run_from_their_progress_files(tmp_path):
    """The torch backend's launcher waits for its ranks until they end; meanwhile it reads their
    progress files: the steps all of them have run are the step the furthest behind is in, and
    nothing while one has not started or warms up (on a later step's graph)."""
    from dflop.backends.torch_runtime.progress import ProgressFile, steps_done, telling_steps

    first, second = ProgressFile(tmp_path, 0), ProgressFile(tmp_path, 1)
    assert steps_done(tmp_path, 2) is None
    first.write(3, "warm-up F0")
    second.write(3, "warm-up barrier")
    assert steps_done(tmp_path, 2) is None
    first.write(0, "F0")
    assert steps_done(tmp_path, 2) is None
    second.write(0, "barrier")
    assert steps_done(tmp_path, 2) == 0
    first.write(2, "optimizer")
    second.write(1, "B1")
    assert steps_done(tmp_path, 2) == 1
    told: list[int] = []

    def told_by_now(step: int) -> None:
        deadline = time.monotonic() + 5
        while (not told or told[-1] < step) and time.monotonic() < deadline:
            time.sleep(0.005)

    with telling_steps(tmp_path, 2, told.append, every=0.005):
        told_by_now(1)
        for step in (2, 2, 3):
            first.write(step, "F0")
            second.write(step, "F0")
            told_by_now(step)
    assert told == [1, 2, 3]  # each count once, as it grew
