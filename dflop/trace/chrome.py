"""The one trace format: Chrome trace-event JSON, loadable in Perfetto and chrome://tracing.

One process (pid) per worker, thread 0 its compute stream, thread 1 its
communication; complete events (``ph: "X"``) in microseconds with the
microbatch, stage, samples, tokens and tiles in ``args``; memory as counter
events. ``otherData`` carries what metrics need beyond events: the workers
(GPUs, module, capacity), step boundaries, out-of-memory events and the
hardware peak. Both the simulator and a real backend write this format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflop.errors import DflopError

FORMAT = "dflop.trace/1"
COMPUTE, COMM = 0, 1


@dataclass
class TraceBuilder:
    """Collects events of one or more steps into a trace document."""

    workers: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    oom: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def set_workers(self, workers: list[dict[str, Any]]) -> None:
        self.workers = workers

    def op(self, pid: int, tid: int, name: str, cat: str, start_ns: int, end_ns: int,
           args: dict[str, Any] | None = None) -> None:
        event = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid,
                 "ts": start_ns / 1000.0, "dur": (end_ns - start_ns) / 1000.0}
        if args:
            event["args"] = args
        self.events.append(event)

    def counter(self, pid: int, name: str, ns: int, value: float) -> None:
        self.events.append({"name": name, "ph": "C", "pid": pid, "ts": ns / 1000.0,
                            "args": {"GiB": round(value / 2**30, 4)}})

    def step(self, index: int, start_ns: int, compute_end_ns: int, end_ns: int, **extra: Any) -> None:
        self.steps.append({"step": index, "start_us": start_ns / 1000.0,
                           "compute_end_us": compute_end_ns / 1000.0, "end_us": end_ns / 1000.0,
                           **extra})

    def document(self) -> dict[str, Any]:
        metadata = []
        for pid, w in enumerate(self.workers):
            metadata.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": w["name"]}})
            metadata.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
            for tid, label in ((COMPUTE, "compute"), (COMM, "communication")):
                metadata.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                                 "args": {"name": label}})
        return {"traceEvents": metadata + self.events, "displayTimeUnit": "ms",
                "otherData": {"format": FORMAT, "workers": self.workers, "steps": self.steps,
                              "oom": self.oom, **self.meta}}


def save_trace(doc: dict[str, Any], path: str | Path) -> Path:
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(doc))
    except OSError as exc:
        raise DflopError(f"{p}: cannot write the trace ({exc.strerror})") from None
    return p


def load_trace(path: str | Path) -> dict[str, Any]:
    from dflop.specs.loading import load_json

    doc = load_json(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise DflopError(f"{path}: not a Chrome trace (no 'traceEvents' list)")
    return doc
