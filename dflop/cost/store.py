"""The profile store: tidy measurement records, one JSON object per line.

Records are appended (and flushed to disk) as they are measured, so a run
that is interrupted loses nothing; reading de-duplicates on the record key
(device, module, model, dtype, tp, phase, shape), the last record winning,
so a rerun can skip whatever is already there. A line that is not a valid
record is skipped with a warning naming the file and line; a record appended
after a torn last line (an interrupted write) starts a line of its own.
A record's ``arch`` names the architecture measured, so that a model which
only shares a profiled model's name is not priced with its figures.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from enum import Enum
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterable

from dflop.errors import ensure_writable_folder
from dflop.specs.loading import NotJson, parse_json, read_text
from dflop.specs.plan import MODULES, Module

FILENAME = "profile.jsonl"
KEY_FIELDS = ("device", "module", "model", "dtype", "tp", "phase")
FSDP_UNIT = "fsdp_unit"
"""The phase of a record of what FSDP2 adds to one unit: ``fwd_ms`` to its forward (the weights'
all-gather), ``bwd_ms`` to its backward (the gradients' reduce-scatter), the spreads those of the
sharded unit's own times; shape ``params`` (the unit's) and ``shards``."""


class TPComm(str, Enum):
    """How a record of a TP degree > 1 holds its collectives."""

    MEASURED = "measured"
    """Measured in a real TP group of lock-step processes: in the figures."""
    MODELLED = "modelled"
    """One shard measured alone: the cost model adds them."""


def tp_comm_of(record: dict[str, Any]) -> TPComm | None:
    """None without TP; records from before the field are shards measured alone."""
    return None if record["tp"] == 1 else TPComm(record.get("tp_comm", TPComm.MODELLED.value))


ARCHITECTURE = {Module.LLM: ("hidden", "heads", "kv_heads", "ffn", "vocab", "qkv_bias", "head_dim", "o_bias",
                             "qk_norm", "layer_norms"),
                Module.ENCODER: ("hidden", "heads", "mlp", "image_size", "patch_size", "norm", "qk_norm", "qkv_bias",
                            "downsample")}
"""The spec fields a module's figures depend on: the shapes of one block and of the fixed parts. Not
the name, nor the layer count (the cost model multiplies a block's figures by it), nor the width of
the LLM an encoder's projector was measured for (an encoder is profiled once, for any LLM)."""


def architecture(module: str, spec: Any) -> dict[str, Any]:
    """What a record of ``spec`` (an encoder or LLM spec) says it was measured on (its ``arch``)."""
    return {name: getattr(spec, name) for name in ARCHITECTURE[module]}


def measured_architecture(record: dict[str, Any]) -> dict[str, Any] | None:
    """The architecture ``record`` was measured on: its ``arch``; a record from before that field
    names a preset (the profiler measures presets only), whose architecture it was. None: unknown."""
    if "arch" in record:
        return record["arch"]
    from dflop.specs import presets

    kind = "encoders" if record["module"] == Module.ENCODER else "llms"
    if record["model"] not in presets.names(kind):
        return None
    spec = presets.encoder(record["model"]) if kind == "encoders" else presets.llm(record["model"])
    return architecture(record["module"], spec)


def architecture_mismatch(record: dict[str, Any], spec: Any) -> str:
    """'' when ``record`` may price ``spec``; else the first field that differs, as
    ``hidden 128, the model's 4096``."""
    measured = measured_architecture(record) or {}
    for name, value in architecture(record["module"], spec).items():
        if name in measured and measured[name] != value:
            return f"{name} {measured[name]}, the model's {value}"
    return ""


MACHINE_FIELDS = {"cpu": "{}", "capability": "{}", "cores": "{} cores", "threads": "{} threads per process",
                  "memory_gib": "{} GiB", "torch": "torch {}", "python": "Python {}", "gpu": "{}",
                  "gpu_memory_gib": "{} GiB GPU", "driver": "driver {}", "cuda": "CUDA {}", "nccl": "NCCL {}",
                  "sm_clock_mhz": "SM clock {} MHz", "memory_clock_mhz": "memory clock {} MHz"}
"""What a record's ``machine`` says of where it was measured (``dflop.profile.profiler.machine_identity``),
and how each is written: every one moves the time of the same shapes."""


def profile_machine(records: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The machine most of ``records`` were measured on; None when none says (records from before
    the field: an unknown machine)."""
    seen = [json.dumps(r["machine"], sort_keys=True) for r in records if r.get("machine")]
    return json.loads(max(set(seen), key=seen.count)) if seen else None


def machine_difference(profile: dict[str, Any] | None, here: dict[str, Any]) -> str:
    """'' when ``profile`` (a record's ``machine``, None: unknown) is ``here``; else the line that
    says so, naming what differs: ``profile measured on <A, AVX512>, this is <B, AVX2>``. A field
    that one of them does not name (or names None) is not known to differ (a profile from before the
    GPU clocks were read, a machine whose NVML does not say) and is left out."""
    def describe(machine: dict[str, Any], names: Iterable[str]) -> str:
        return ", ".join(MACHINE_FIELDS[n].format(machine.get(n, "?")) for n in names)

    if profile is None:
        main = [n for n in ("cpu", "capability", "cores", "gpu") if n in here]
        return f"profile measured on an unknown machine (its records do not say), this is <{describe(here, main)}>"
    differ = [n for n in MACHINE_FIELDS if None not in (profile.get(n), here.get(n)) and profile[n] != here[n]]
    if not differ:
        return ""
    return f"profile measured on <{describe(profile, differ)}>, this is <{describe(here, differ)}>"


def record_key(record: dict[str, Any]) -> tuple:
    return tuple(record[f] for f in KEY_FIELDS) + (tuple(sorted(record["shape"].items())),)


def _problem(record: Any) -> str | None:
    """Why ``record`` is not a valid record (None when it is)."""
    if not isinstance(record, dict):
        return "not a JSON object"
    for name in ("device", "model", "dtype", "phase"):
        if not isinstance(record.get(name), str):
            return f"field '{name}' missing or not a string"
    if record.get("module") not in MODULES:
        return "field 'module' must be 'encoder' or 'llm'"
    if not isinstance(record.get("tp"), int) or record["tp"] < 1:
        return "field 'tp' must be an integer >= 1"
    for name in ("processes", "threads"):  # optional: how it was measured
        value = record.get(name, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"field '{name}' must be an integer >= 1"
    if record.get("tp_comm", TPComm.MODELLED.value) not in {c.value for c in TPComm}:
        return f"field 'tp_comm' must be one of {', '.join(c.value for c in TPComm)}"
    machine = record.get("machine", {})
    if not isinstance(machine, dict) or not all(v is None or isinstance(v, str) or _finite(v)
                                                for v in machine.values()):
        return "field 'machine' must map names to strings, finite numbers or null"
    arch = record.get("arch", {})
    if not isinstance(arch, dict) or not all(isinstance(v, (str, bool)) or _finite(v) for v in arch.values()):
        return "field 'arch' must map names to strings, booleans or finite numbers"
    shape = record.get("shape")
    if not isinstance(shape, dict) or not shape or not all(_finite(v) for v in shape.values()):
        return "field 'shape' must map names to finite numbers"
    if record["phase"] == FSDP_UNIT and not all(isinstance(shape.get(k), int) and shape[k] >= 1
                                                 for k in ("params", "shards")):
        return f"field 'shape' of an {FSDP_UNIT} record must give 'params' and 'shards' as integers >= 1"
    for name in ("fwd_ms", "bwd_ms", "memory_bytes"):
        value = record.get(name)
        if not _finite(value) or value < 0:
            return f"field '{name}' must be a finite number >= 0"
    return None


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class ProfileStore:
    path: Path

    @classmethod
    def in_dir(cls, folder: str | Path) -> "ProfileStore":
        return cls(ensure_writable_folder(folder, "profile") / FILENAME)

    def append(self, record: dict[str, Any]) -> None:
        problem = _problem(record)
        if problem:
            raise ValueError(f"not a profile record: {problem}")
        line = json.dumps(record).encode() + b"\n"
        with self.path.open("a+b") as f:
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    line = b"\n" + line
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def read(self, warn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
        return read_records(read_text(self.path) if self.path.exists() else "", str(self.path), warn)


def read_records(text: str, where: str, warn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    latest: dict[tuple, dict[str, Any]] = {}
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = parse_json(line, where)
            problem = _problem(record)
        except NotJson as exc:
            problem = f"not valid JSON ({exc.problem})"
        if problem:
            if warn is not None:
                warn(f"{where}:{line_no}: skipped a corrupt profile record ({problem})")
            continue
        latest[record_key(record)] = record
    return list(latest.values())


SHIPPED = "dflop/cost/profiles"


def shipped_sourced(warn: Callable[[str], None] | None = None) -> list[tuple[dict[str, Any], str]]:
    """(record, its file) of the profiles that ship with dflop (measured on the machines their
    ``device`` names)."""
    folder = resources.files("dflop.cost").joinpath("profiles")
    out: list[tuple[dict[str, Any], str]] = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".jsonl"):
            where = f"{SHIPPED}/{entry.name}"
            out.extend((r, where) for r in read_records(entry.read_text(), where, warn))
    return out


def shipped_records(warn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    return [r for r, _ in shipped_sourced(warn)]


def load_sourced(folders: Iterable[str | Path] = (), warn: Callable[[str], None] | None = None,
                 shipped: bool = True) -> list[tuple[dict[str, Any], str]]:
    """(record, the folder it comes from) of the shipped records and every store folder's,
    de-duplicated (later sources win)."""
    latest = {record_key(r): (r, where) for r, where in (shipped_sourced(warn) if shipped else [])}
    for folder in folders:
        latest.update((record_key(r), (r, str(folder))) for r in ProfileStore(Path(folder) / FILENAME).read(warn))
    return list(latest.values())


def load_records(folders: Iterable[str | Path] = (), warn: Callable[[str], None] | None = None,
                 shipped: bool = True) -> list[dict[str, Any]]:
    """Shipped records plus those of every store folder, de-duplicated (later sources win)."""
    return [r for r, _ in load_sourced(folders, warn, shipped)]
