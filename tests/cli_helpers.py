"""Run the `dflop` command in a subprocess, as a user would."""

import json
import subprocess
import sys


def dflop(*args, cwd=None, timeout=600):
    proc = subprocess.run([sys.executable, "-m", "dflop.cli.main", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    return proc


def dflop_json(*args, cwd=None, timeout=600):
    proc = dflop(*args, "--json", cwd=cwd, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected exactly one JSON object, got: {proc.stdout[:500]}"
    return json.loads(lines[0])


def assert_one_line_error(proc, *fragments):
    """Exit status 2 and exactly one error line, the last thing on stderr (logs may precede it)."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("dflop: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert proc.stdout == ""


class Ran:
    """What one in-process run of the command left: exit status, stdout, stderr, seconds."""

    def __init__(self, returncode, stdout, stderr, seconds):
        self.returncode, self.stdout, self.stderr, self.seconds = returncode, stdout, stderr, seconds


def dflop_here(*args):
    """Run `dflop` in this process (much faster than a subprocess), capturing what it prints."""
    import contextlib
    import io
    import time

    from dflop.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return Ran(code, out.getvalue(), err.getvalue(), time.perf_counter() - start)


def assert_only_error(ran, *fragments):
    """A one-line error and nothing before it on stderr: the command stopped before any work."""
    assert_one_line_error(ran, *fragments)
    assert len(ran.stderr.strip().splitlines()) == 1, ran.stderr
