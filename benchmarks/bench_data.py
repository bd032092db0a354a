"""`profile_dataset` on a 50k-entry manifest, once per manifest schema.

Run: .venv/bin/python benchmarks/bench_data.py [--entries N] [--repeats R]

Every manifest holds the same synthetic entries (40% single images, 30%
multi-image, 20% videos, 10% text) with their sizes in the entries
(``width``/``height``, ``duration``), so no image or video file is opened:
what is timed is reading, parsing and the tiling rules. The dataset-list rows
read the LLaVA manifest twice through a LLaVA-NeXT data YAML (``all`` and
``50%``) and the InternVL manifest through a meta JSON. A schema this version
of dflop cannot read prints ``n/a``. Best of ``--repeats`` runs; next to each
time, its ratio to bare JSON parsing of the same files in the same run (the
floor any reader pays), and at the end the whole ``dflop profile data``
command on the LLaVA JSON manifest, as a user runs it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dflop.errors import DflopError
from dflop.specs import presets
from dflop.workload import profile_dataset


def _entries(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    kinds = rng.choice(4, size=n, p=[0.4, 0.3, 0.2, 0.1])
    out = []
    for k, kind in enumerate(kinds.tolist()):
        words = " ".join(["word"] * int(rng.integers(5, 200)))
        entry: dict = {"id": f"s{k}", "text": words}
        if kind == 0:
            entry.update(images=[f"img/{k}.jpg"], width=[int(rng.integers(64, 4000))],
                         height=[int(rng.integers(64, 4000))])
        elif kind == 1:
            m = int(rng.integers(2, 6))
            entry.update(images=[f"img/{k}_{i}.jpg" for i in range(m)],
                         width=rng.integers(64, 2000, m).tolist(), height=rng.integers(64, 2000, m).tolist())
        elif kind == 2:
            entry.update(video=f"vid/{k}.mp4", duration=float(rng.uniform(2, 300)))
        out.append(entry)
    return out


def _llava(e: dict) -> dict:
    out = {"id": e["id"]}
    images = e.get("images", [])
    tag = "<image>\n" * (len(images) if images else int("video" in e))
    if len(images) == 1:
        out.update(image=images[0], width=e["width"][0], height=e["height"][0])
    elif images:
        out.update(image=images, width=e["width"], height=e["height"])
    if "video" in e:
        out.update(video=e["video"], duration=e["duration"])
    out["conversations"] = [{"from": "human", "value": tag + "Describe it."},
                            {"from": "gpt", "value": e["text"]}]
    return out


def _sharegpt(e: dict) -> dict:
    images = e.get("images", [])
    out = {"messages": [{"role": "user", "content": "<image>" * len(images) + "<video>" * ("video" in e)
                         + "Describe it."}, {"role": "assistant", "content": e["text"]}]}
    if images:
        out.update(images=images, width=e["width"], height=e["height"])
    if "video" in e:
        out.update(videos=[e["video"]], duration=e["duration"])
    return out


def _internvl(e: dict) -> dict:
    out = _llava(e)
    if "images" in e:
        out.update(width=e["width"], height=e["height"])
        out["image"] = e["images"] if len(e["images"]) > 1 else e["images"][0]
        if len(e["images"]) == 1:
            out.update(width=e["width"][0], height=e["height"][0])
    return out


def _write(folder: Path, entries: list[dict]) -> dict[str, Path]:
    paths = {"llava json": folder / "llava.json", "llava jsonl": folder / "llava.jsonl",
             "sharegpt json": folder / "sharegpt.json", "internvl jsonl": folder / "internvl.jsonl"}
    paths["llava json"].write_text(json.dumps([_llava(e) for e in entries]))
    paths["llava jsonl"].write_text("".join(json.dumps(_llava(e)) + "\n" for e in entries))
    paths["sharegpt json"].write_text(json.dumps([_sharegpt(e) for e in entries]))
    paths["internvl jsonl"].write_text("".join(json.dumps(_internvl(e)) + "\n" for e in entries))
    paths["llava-next data yaml (all + 50%)"] = folder / "data.yaml"
    paths["llava-next data yaml (all + 50%)"].write_text(
        "datasets:\n  - json_path: llava.json\n    sampling_strategy: all\n"
        "  - json_path: llava.jsonl\n    sampling_strategy: random:50%\n")
    paths["internvl meta json"] = folder / "meta.json"
    paths["internvl meta json"].write_text(json.dumps(
        {"bench": {"root": ".", "annotation": "internvl.jsonl", "repeat_time": 1, "length": len(entries)}}))
    return paths


def _parse_only(path: Path) -> float:
    """Seconds to parse the JSON of a manifest, or of every manifest a list names."""
    if path.suffix == ".yaml":
        return _parse_only(path.parent / "llava.json") + _parse_only(path.parent / "llava.jsonl")
    if path.name == "meta.json":
        return _parse_only(path.parent / "internvl.jsonl")
    start = time.perf_counter()
    text = path.read_text()
    _ = json.loads(text) if text.startswith("[") else [json.loads(line) for line in text.splitlines()]
    return time.perf_counter() - start


def _cli(path: Path, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "dflop.cli.main", "profile", "data", "--dataset", str(path),
                        "--out", str(path.parent / "profile.json")], check=True, capture_output=True)
        best = min(best, time.perf_counter() - start)
    return best


def _time(path: Path, encoder, repeats: int) -> tuple[float, int] | None:
    best, n = float("inf"), 0
    for _ in range(repeats):
        start = time.perf_counter()
        try:
            prof = profile_dataset(path, encoder)
        except DflopError:
            return None
        best, n = min(best, time.perf_counter() - start), len(prof)
    return best, n


def main() -> None:
    args = argparse.ArgumentParser()
    args.add_argument("--entries", type=int, default=50_000)
    args.add_argument("--repeats", type=int, default=3)
    opts = args.parse_args()
    entries = _entries(opts.entries)
    with tempfile.TemporaryDirectory() as tmp:
        paths = _write(Path(tmp), entries)
        floor = {name: min(_parse_only(path) for _ in range(opts.repeats)) for name, path in paths.items()}
        for encoder_name in ("siglip-so400m", "internvit-300m"):
            encoder = presets.encoder(encoder_name)
            print(f"{encoder_name}: profile_dataset on {opts.entries} entries, best of {opts.repeats}")
            for name, path in paths.items():
                result = _time(path, encoder, opts.repeats)
                cell = "n/a" if result is None else \
                    f"{result[0]:7.2f} s  ({result[1]} samples, {result[0] / floor[name]:.1f}x its JSON parsing)"
                print(f"  {name:<34} {cell}")
        print(f"dflop profile data --dataset llava.json (the command, best of {opts.repeats}): "
              f"{_cli(paths['llava json'], opts.repeats):.2f} s")


if __name__ == "__main__":
    main()
