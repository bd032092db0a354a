"""The specs package is a layered graph: a spec module (hardware, models, plan) knows no preset and
no config.json reader; the name resolution above them (``dflop.specs.resolve``) knows both. An import
inside a function counts as much as one at the top: it is a cycle that only hides until run time."""

import ast
from pathlib import Path

SPECS = Path(__file__).resolve().parents[1] / "dflop" / "specs"


def specs_imports(folder: Path) -> dict[str, set[str]]:
    """Every ``dflop.specs`` module each module of ``folder`` imports, at any depth of its code."""
    modules = {p.stem for p in folder.glob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[:2] == ["dflop", "specs"] and len(parts) == 3 and parts[2] in modules:
                    graph[path.stem].add(parts[2])
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle (its modules in order, the first repeated last), or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return []

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return []


def test_the_specs_modules_import_each_other_without_a_cycle():
    assert find_cycle(specs_imports(SPECS)) == []


def test_the_spec_modules_know_no_preset_and_no_config_file():
    graph = specs_imports(SPECS)
    for leaf in ("hardware", "models", "plan"):
        assert graph[leaf] & {"presets", "hf_config", "resolve"} == set(), leaf


def test_a_lazy_import_that_closes_a_cycle_is_found(tmp_path):
    """The check can fail: a function-level import of the presets in a spec module is a cycle."""
    for path in SPECS.glob("*.py"):
        (tmp_path / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    models = tmp_path / "models.py"
    models.write_text(models.read_text(encoding="utf-8")
                      + "\n\ndef _late():\n    from dflop.specs import presets\n", encoding="utf-8")
    cycle = find_cycle(specs_imports(tmp_path))
    assert "models" in cycle and "presets" in cycle
