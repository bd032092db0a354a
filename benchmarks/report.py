"""Run every benchmark and write benchmarks/REPORT.md with the JSON behind it (`make bench`).

Run: .venv/bin/python benchmarks/report.py [--quick] [--only NAME ...] [--render-only]

Each ``bench_*.py`` runs with its default arguments, as its own process. A benchmark that
takes ``--json PATH`` writes its figures there as

    {"title": str, "command": str, "tables": [{"title": str, "columns": [...], "rows": [[...]]}],
     "notes": [str, ...]}

(:class:`Results` writes it and prints the same figures); one that does not is reported by
its printed output. Every result lands in ``results/NAME.json`` with the run's exit status,
its seconds and its output; REPORT.md is rendered from those files alone, with the machine
(``os.uname()``, CPU count, Python, torch), the date and each benchmark's command.
``--quick`` passes ``--quick`` to the benchmarks that take it (smaller sizes, a dry run of
the plumbing) and skips the others; its report says so in its first lines.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpu_check import REPORT_END, REPORT_START, report_section

HERE = Path(__file__).resolve().parent


# ---- what a benchmark uses -----------------------------------------------------------------------

@dataclass
class Results:
    """A benchmark's figures: printed as they come, and saved as JSON for the report."""

    title: str
    command: str
    tables: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def table(self, columns: list[str], rows: list[list[Any]], title: str = "") -> None:
        self.tables.append({"title": title, "columns": list(columns), "rows": [list(r) for r in rows]})
        print(("\n" + title + "\n" if title else "\n") + _text_table(columns, rows))

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(text)

    def save(self, path: str | Path | None) -> None:
        if path is not None:
            Path(path).write_text(json.dumps(asdict(self), indent=1))


def arguments(description: str) -> argparse.ArgumentParser:
    """A benchmark's parser with the two options the report passes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", type=Path, help="Also write the figures here (the report's schema).")
    parser.add_argument("--quick", action="store_true", help="Smaller sizes: a dry run, not figures to cite.")
    return parser


def _cell(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _text_table(columns: list[str], rows: list[list[Any]]) -> str:
    cells = [list(map(str, columns))] + [[_cell(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.rjust(w) if k else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths)))
                     for r in cells)


# ---- running them ------------------------------------------------------------------------------

def _options(script: Path) -> set[str]:
    """The report's options a benchmark takes, read from its source and from the modules beside it
    that it imports (a parser they share), since running --help could run it: both when it
    builds its parser with :func:`arguments`."""
    text = script.read_text()
    for name in set(re.findall(r"^\s*(?:import|from)\s+(\w+)", text, re.MULTILINE)) - {script.stem}:
        sibling = script.parent / f"{name}.py"
        if sibling.is_file():
            text += sibling.read_text()
    if "from report import" in text and "arguments(" in text:
        return {"--json", "--quick"}
    return {o for o in ("--json", "--quick") if f'"{o}"' in text or f"'{o}'" in text}


def run_one(script: Path, results: Path, quick: bool) -> dict[str, Any]:
    name = script.stem
    options = _options(script)
    command = f"python benchmarks/{script.name}" + (" --quick" if quick else "")
    if quick and "--quick" not in options:
        return {"title": name, "command": command, "skipped": "no --quick option: not run in a quick report"}
    out = results / f"{name}.json"
    out.unlink(missing_ok=True)
    argv = [sys.executable, str(script)] + (["--quick"] if quick else []) + (["--json", str(out)] if
                                                                           "--json" in options else [])
    print(f"report: {command}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE)] + os.environ.get("PYTHONPATH", "").split(os.pathsep))}
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=script.parent.parent, env=env)
    seconds = time.perf_counter() - start
    return {**_figures(out, name), "command": command, "returncode": proc.returncode, "seconds": round(seconds, 1),
            "output": proc.stdout + (proc.stderr if proc.returncode else ""), "quick": quick, "ran": machine()}


def _figures(path: Path, name: str) -> dict[str, Any]:
    """The benchmark's JSON in the report's schema; other JSON is kept as ``data`` (the report then
    shows the printed output)."""
    data = json.loads(path.read_text()) if path.exists() else None
    if isinstance(data, dict) and isinstance(data.get("tables"), list):
        return {"title": name, "notes": [], **data}
    return {"title": name, "tables": [], "notes": [], **({"data": data} if data is not None else {})}


def machine() -> dict[str, Any]:
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    uname = os.uname()
    return {"uname": f"{uname.sysname} {uname.release} {uname.machine}", "node": uname.nodename,
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch_version,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


# ---- the report --------------------------------------------------------------------------------

def _markdown_table(table: dict[str, Any]) -> list[str]:
    lines = [f"**{table['title']}**", ""] if table.get("title") else []
    lines.append("| " + " | ".join(map(str, table["columns"])) + " |")
    lines.append("|" + "|".join("---" for _ in table["columns"]) + "|")
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in table["rows"]]
    return lines + [""]


def _section(r: dict[str, Any], where: dict[str, Any]) -> list[str]:
    """A benchmark's section; one run apart from the report's (``--only``) says when and where it ran."""
    lines = [f"## {r['title']}", "", f"`{r['command']}`", ""]
    if "skipped" in r:
        return lines + [f"Skipped: {r['skipped']}.", ""]
    status = "" if r["returncode"] == 0 else f", **failed with exit status {r['returncode']}**"
    ran = r.get("ran", where)
    other = ran["date"][:10] != where["date"][:10] or ran["uname"] != where["uname"]
    lines += [f"{r['seconds']:.1f} s{status}" + (f", run apart: {ran['date']} on {ran['uname']}" if other else ""), ""]
    for table in r.get("tables", []):
        lines += _markdown_table(table)
    lines += [f"- {n}" for n in r.get("notes", [])] + ([""] if r.get("notes") else [])
    if not r.get("tables") or r["returncode"]:
        lines += ["```text", r["output"].rstrip(), "```", ""]
    return lines


def render(results: list[dict[str, Any]], where: dict[str, Any], gpu: list[str] = ()) -> str:
    """The report: the CPU benchmarks' ``results``, then the sections of the GPU checks (``gpu_check``)."""
    quick = any(r.get("quick") for r in results) or where.get("quick", False)
    lines = ["# Benchmark report", ""]
    if quick:
        lines += ["**Quick dry run** (`--quick`): reduced sizes that test the plumbing; these figures are "
                  "not the benchmarks' and are not to be cited. `make bench` writes the real report.", ""]
    lines += [f"- date: {where['date']}", f"- machine: {where['uname']}, {where['cpus']} CPUs, "
              f"OMP_NUM_THREADS={where.get('omp_num_threads', 'unset')}",
              f"- Python {where['python']}, torch {where['torch']}",
              "- every figure comes from the run below, but for a section that names its own; ratios compare "
              "things measured in the same run", ""]
    for r in results:
        lines += _section(r, where)
    lines += [f"{REPORT_START}\n{section}{REPORT_END}\n" for section in gpu]
    return "\n".join(lines).rstrip() + "\n"


def gpu_sections(folder: Path) -> list[str]:
    """A section per GPU check in ``folder`` (``gpu-*/gpu_check.json``; `make gpu-check`), oldest first."""
    return [report_section(json.loads(p.read_text()), str(p.parent.relative_to(HERE.parent)))
            for p in sorted(folder.glob("gpu-*/gpu_check.json")) if not json.loads(p.read_text()).get("dry")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Pass --quick; skip benchmarks without it.")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="Run these benchmarks (e.g. bench_sim).")
    parser.add_argument("--render-only", action="store_true", help="Render REPORT.md from results/ as they are.")
    parser.add_argument("--benchmarks", type=Path, default=HERE, help="Folder of bench_*.py (default: this one).")
    parser.add_argument("--out", type=Path, default=HERE, help="Where REPORT.md and results/ go.")
    args = parser.parse_args(argv)
    folder = args.out / "results"
    folder.mkdir(parents=True, exist_ok=True)
    scripts = sorted(args.benchmarks.glob("bench_*.py"))
    if args.only:
        unknown = set(args.only) - {s.stem for s in scripts}
        if unknown:
            parser.error(f"no benchmark named {', '.join(sorted(unknown))} in {args.benchmarks}")
        scripts = [s for s in scripts if s.stem in args.only]
    if not args.render_only:
        if not args.only or not (folder / "machine.json").exists():  # the report's own run: every benchmark
            (folder / "machine.json").write_text(json.dumps({**machine(), "quick": args.quick}, indent=1))
        for script in scripts:
            (folder / f"{script.stem}.json").write_text(json.dumps(run_one(script, folder, args.quick), indent=1))
    results = [json.loads(p.read_text()) for p in sorted(folder.glob("bench_*.json"))]
    if not results or not (folder / "machine.json").exists():
        parser.error(f"no results in {folder} to render")
    report = args.out / "REPORT.md"
    report.write_text(render(results, json.loads((folder / "machine.json").read_text()), gpu_sections(folder)))
    print(f"report: {report} ({len(results)} benchmarks)", file=sys.stderr)
    return 0 if all(r.get("returncode", 0) == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
