"""benchmarks/report.py: runs benchmarks as processes and renders REPORT.md from their JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

REPORT = Path(__file__).resolve().parents[1] / "benchmarks" / "report.py"

WITH_JSON = '''
from report import Results, arguments

args = arguments("a benchmark").parse_args()
r = Results("Widgets per second", "python benchmarks/bench_a.py" + (" --quick" if args.quick else ""))
r.table(["size", "widgets/s"], [[8, 1.5], [64 if not args.quick else 16, 12.25]], "by size")
r.note("ratio 8.17x, measured in the same run")
r.save(args.json)
'''
PRINTS_ONLY = '''
import argparse, json
parser = argparse.ArgumentParser()
parser.add_argument("--json")
args = parser.parse_args()
print("plain figures: 42 things")
if args.json:
    json.dump({"rows": [{"things": 42}]}, open(args.json, "w"))  # not the report's schema
'''
FAILS = 'import sys\nprint("half done")\nsys.exit(3)\n'
SHARED_PARSER = 'import argparse\nparser = argparse.ArgumentParser()\nparser.add_argument("--json")\n'
USES_SHARED = 'import json\nimport shared\nargs = shared.parser.parse_args()\njson.dump({"n": 7}, open(args.json, "w"))\n'


def run(folder, *args):
    benches = folder / "benches"
    benches.mkdir(exist_ok=True)
    for name, text in (("bench_a", WITH_JSON), ("bench_b", PRINTS_ONLY), ("bench_c", FAILS), ("shared", SHARED_PARSER),
                       ("bench_d", USES_SHARED)):
        (benches / f"{name}.py").write_text(text)
    proc = subprocess.run([sys.executable, str(REPORT), "--benchmarks", str(benches), "--out", str(folder / "out"),
                           *args], capture_output=True, text=True, timeout=120)
    return proc, folder / "out"


def test_report_from_every_benchmark(tmp_path):
    proc, out = run(tmp_path)
    assert proc.returncode == 1, proc.stderr  # bench_c failed, and the report says so
    a = json.loads((out / "results" / "bench_a.json").read_text())
    assert a["title"] == "Widgets per second" and a["returncode"] == 0
    assert a["tables"] == [{"title": "by size", "columns": ["size", "widgets/s"], "rows": [[8, 1.5], [64, 12.25]]}]
    text = (out / "REPORT.md").read_text()
    assert "Quick dry run" not in text
    assert "| size | widgets/s |" in text and "| 64 | 12.25 |" in text and "- ratio 8.17x" in text
    assert "`python benchmarks/bench_a.py`" in text and "`python benchmarks/bench_b.py`" in text
    assert "plain figures: 42 things" in text  # no tables: its printed output stands in
    b = json.loads((out / "results" / "bench_b.json").read_text())
    assert b["data"] == {"rows": [{"things": 42}]} and b["tables"] == [] and b["title"] == "bench_b"
    assert "failed with exit status 3" in text and "half done" in text
    assert json.loads((out / "results" / "bench_d.json").read_text())["data"] == {"n": 7}  # --json via its import
    assert "shared" not in {p.stem for p in (out / "results").glob("*.json")}
    machine = json.loads((out / "results" / "machine.json").read_text())
    assert f"{machine['cpus']} CPUs" in text and f"torch {machine['torch']}" in text and machine["date"] in text


def test_quick_report_is_labelled_and_skips_what_cannot_run_quick(tmp_path):
    proc, out = run(tmp_path, "--quick", "--only", "bench_a", "bench_b")
    assert proc.returncode == 0, proc.stderr
    text = (out / "REPORT.md").read_text()
    assert text.splitlines()[2].startswith("**Quick dry run**")
    assert "| 16 | 12.25 |" in text and "`python benchmarks/bench_a.py --quick`" in text
    assert "Skipped: no --quick option" in text and "bench_c" not in text
    again = subprocess.run([sys.executable, str(REPORT), "--render-only", "--benchmarks", str(tmp_path / "benches"),
                            "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and (out / "REPORT.md").read_text() == text  # from the JSON alone


def test_a_benchmark_rerun_alone_keeps_the_reports_machine_and_names_its_own(tmp_path):
    """`--only` reruns one benchmark into an existing report: the header's machine and date stay those of
    the whole run, and that benchmark's section says when and where it ran instead."""
    _, out = run(tmp_path)
    assert "run apart" not in (out / "REPORT.md").read_text()  # every section from the report's own run
    machine = json.loads((out / "results" / "machine.json").read_text())
    machine["date"], machine["uname"] = "2020-01-01T00:00:00+00:00", "Elsewhere 1.0 x86_64"
    (out / "results" / "machine.json").write_text(json.dumps(machine))
    _, out = run(tmp_path, "--only", "bench_a")
    report = (out / "REPORT.md").read_text()
    assert json.loads((out / "results" / "machine.json").read_text()) == machine
    assert "- date: 2020-01-01T00:00:00+00:00" in report
    a = report.split("## Widgets per second")[1].split("## ")[0]
    assert "run apart: " in a and "Elsewhere" not in a
