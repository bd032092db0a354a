"""The layer picture in docs/design/architecture.md is generated from the code: it must be current,
and no import may go the wrong way (a lower layer importing a higher one, torch in a planning layer)."""

import importlib.util
import shutil
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "docs" / "design" / "make_architecture.py"


def load_script():
    spec = importlib.util.spec_from_file_location("make_architecture", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_architecture_picture_is_current_and_every_import_goes_down():
    arch = load_script()
    picture = arch.analyse()
    assert [str(i) for i in picture.wrong_way] == []
    assert [str(i) for i in picture.torch if arch.layer_of(i.source) is not None] == []
    assert arch.render(arch.DOC.read_text(encoding="utf-8"), picture) == arch.DOC.read_text(encoding="utf-8"), \
        "stale: run python docs/design/make_architecture.py"


def test_a_wrong_way_import_is_found(tmp_path, monkeypatch):
    """The check can fail: in a copy of the tree, a planning module that imports the torch backend is
    flagged."""
    arch = load_script()
    for folder in arch.PACKAGES:
        shutil.copytree(arch.ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    planner = tmp_path / "dflop" / "plan" / "search.py"
    planner.write_text(planner.read_text(encoding="utf-8") + "\nimport dflop.backends.torch_runtime.worker\n")
    monkeypatch.setattr(arch, "ROOT", tmp_path)
    picture = arch.analyse()
    assert [i.source for i in picture.wrong_way] == ["dflop.plan.search"]
