"""Named presets: models and hardware shipped as data with the package.

Names are case-insensitive; an unknown name lists the known ones.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

from dflop.errors import SpecError
from dflop.specs.hardware import HardwareSpec
from dflop.specs.loading import at, from_mapping
from dflop.specs.models import EncoderSpec, LLMSpec, MLLMSpec


@lru_cache(maxsize=None)
def _data(filename: str) -> dict[str, Any]:
    return yaml.safe_load(resources.files("dflop.specs").joinpath(filename).read_text())


def _lookup(table: dict[str, Any], kind: str, name: str, where: str | None) -> tuple[str, Any]:
    key = name.strip().lower()
    if key not in table:
        prefix = f"{at(where)}: " if where else ""
        raise SpecError(f"{prefix}unknown {kind} '{name}' (known: {', '.join(table)})")
    return key, table[key]


def encoder(name: str, where: str | None = None) -> EncoderSpec:
    key, data = _lookup(_data("models.yaml")["encoders"], "encoder", name, where)
    return from_mapping(EncoderSpec, {"name": key, **data}, f"models.yaml: encoders.{key}")


def llm(name: str, where: str | None = None) -> LLMSpec:
    key, data = _lookup(_data("models.yaml")["llms"], "LLM", name, where)
    return from_mapping(LLMSpec, {"name": key, **data}, f"models.yaml: llms.{key}")


def hardware(name: str, where: str | None = None) -> HardwareSpec:
    _, data = _lookup(_data("hardware.yaml"), "hardware", name, where)
    return from_mapping(HardwareSpec, data, f"hardware.yaml: {name}")


def model(encoder_name: str, llm_name: str) -> MLLMSpec:
    return MLLMSpec(encoder=encoder(encoder_name), llm=llm(llm_name))


def hf_config_defaults() -> dict[str, dict[str, Any]]:
    """transformers' config defaults per ``model_type``, for stub ``text_config`` sections."""
    return _data("models.yaml").get("hf_config_defaults", {})


def names(kind: str) -> list[str]:
    """Preset names of one kind: 'encoders', 'llms' or 'hardware'."""
    if kind == "hardware":
        return list(_data("hardware.yaml"))
    return list(_data("models.yaml")[kind])
