"""Names that stand for specs: a preset name, or the path of a Hugging Face config.json.

The spec modules (hardware, models) and the generic loader know no preset and no
config file; this module, above them and above the presets and the config.json
reader, is the one place that turns a name into a spec. A loader that accepts
names passes :func:`named_spec` to :func:`dflop.specs.loading.from_mapping`.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from dflop.errors import SpecError
from dflop.specs import presets
from dflop.specs.hardware import HardwareSpec
from dflop.specs.hf_config import encoder_from_hf_config, llm_from_hf_config
from dflop.specs.loading import at
from dflop.specs.models import EncoderSpec, LLMSpec


def hardware_spec(value: object, where: str) -> HardwareSpec:
    """A preset name stands for the preset (``hardware: h100``)."""
    if not isinstance(value, str):
        raise SpecError(f"{at(where)}: expected a preset name or a mapping, got {value!r}")
    return presets.hardware(value, where=where)


def _model_name(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise SpecError(f"{at(where)}: expected a preset name, a config.json path or a mapping, "
                        f"got {value!r}")
    return value


def encoder_spec(value: object, where: str) -> EncoderSpec:
    """A preset name, or the path of a Hugging Face config.json (SigLIP or InternViT, alone or as a
    VLM's ``vision_config``), stands for the spec."""
    name = _model_name(value, where)
    return encoder_from_hf_config(name) if name.endswith(".json") else presets.encoder(name, where=where)


def llm_spec(value: object, where: str) -> LLMSpec:
    """A preset name, or the path of a Hugging Face config.json, stands for the spec."""
    name = _model_name(value, where)
    return llm_from_hf_config(name) if name.endswith(".json") else presets.llm(name, where=where)


NAMED = MappingProxyType({HardwareSpec: hardware_spec, EncoderSpec: encoder_spec, LLMSpec: llm_spec})
"""The spec types a plain value (not a mapping) may stand for, and how it is read."""


def named_spec(cls: type, value: object, where: str) -> Any:
    """The spec of type ``cls`` that ``value`` names, or None where ``cls`` takes no names (the
    loader then asks for a mapping)."""
    read = NAMED.get(cls)
    return None if read is None else read(value, where)
