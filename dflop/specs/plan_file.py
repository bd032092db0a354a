"""Plan files: a plan and the cluster it was made for.

`dflop optimize` writes the plan's fields and, under ``cluster``, the cluster it
planned for, so that `dflop simulate --plan` and `dflop run --plan` rebuild that
cluster instead of falling back on the config's, which may be another size.
Files written before the cluster was recorded (and hand-written ones) have no
``cluster`` and load as they always did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dflop.errors import SpecError
from dflop.specs import presets
from dflop.specs.hardware import ClusterSpec, HardwareSpec
from dflop.specs.limits import MAX_GPUS
from dflop.specs.loading import check_numbers, child, from_mapping, limit, load_yaml, require, to_mapping
from dflop.specs.plan import Plan

CLUSTER_KEY = "cluster"


@dataclass(frozen=True, kw_only=True)
class PlannedCluster:
    """The cluster a plan was made for, as its file records it."""

    hardware: str
    """The hardware's name (``HardwareSpec.name``, e.g. H100-SXM5-80GB) or a preset name."""
    nodes: int = field(metadata=limit(1, MAX_GPUS))
    gpus_per_node: int = field(metadata=limit(1, MAX_GPUS))

    def __post_init__(self) -> None:
        check_numbers(self)
        require(bool(self.hardware.strip()), "hardware: must name the hardware, got an empty string")
        require(self.gpus <= MAX_GPUS, f"nodes: {self.nodes} nodes of {self.gpus_per_node} GPUs are more than "
                                       f"{MAX_GPUS} GPUs")

    @classmethod
    def of(cls, cluster: ClusterSpec) -> "PlannedCluster":
        return cls(hardware=cluster.hardware.name, nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        return f"{self.nodes} x {self.gpus_per_node} {self.hardware}"

    def cluster(self, configured: HardwareSpec, where: str) -> ClusterSpec:
        """This cluster, on the config's hardware when the names agree (it may be a user's own
        spec), else on the preset of that name."""
        hardware = configured if _names(configured, self.hardware) else _preset_named(self.hardware, configured, where)
        return ClusterSpec(hardware=hardware, nodes=self.nodes, gpus_per_node=self.gpus_per_node)


def _names(spec: HardwareSpec, name: str) -> bool:
    return name.strip().lower() == spec.name.lower()


def _preset_named(name: str, configured: HardwareSpec, where: str) -> HardwareSpec:
    for key in presets.names("hardware"):
        spec = presets.hardware(key)
        if key == name.strip().lower() or _names(spec, name):
            return spec
    raise SpecError(f"{where}: hardware '{name}' is neither the config's ({configured.name}) nor a preset "
                    f"(known: {', '.join(presets.names('hardware'))}); give the --config the plan was made with")


@dataclass(frozen=True)
class PlanFile:
    plan: Plan
    cluster: PlannedCluster | None
    """None in files written before plans recorded their cluster."""
    path: Path

    @property
    def where(self) -> str:
        """Error location of the recorded cluster."""
        return child(f"{self.path}:", CLUSTER_KEY)


def save_plan(plan: Plan, path: str | Path, cluster: ClusterSpec) -> Path:
    """Write ``plan`` and the cluster it was made for."""
    p = Path(path)
    data = {**to_mapping(plan), CLUSTER_KEY: to_mapping(PlannedCluster.of(cluster))}
    p.parent.mkdir(parents=True, exist_ok=True)  # --out was checked to be makeable before the search
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


def load_plan(path: str | Path) -> PlanFile:
    """Read a plan file, with or without its recorded cluster; errors name the file and the key."""
    p = Path(path)
    data = load_yaml(p)
    cluster = None
    if isinstance(data, dict) and CLUSTER_KEY in data:
        data = dict(data)
        cluster = from_mapping(PlannedCluster, data.pop(CLUSTER_KEY), child(f"{p}:", CLUSTER_KEY))
    return PlanFile(from_mapping(Plan, data, f"{p}:"), cluster, p)
