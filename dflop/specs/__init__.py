"""Specs: the frozen, validated data every part of dflop agrees on."""

from dflop.specs.hardware import GIB, ClusterSpec, HardwareSpec, TrainingSpec
from dflop.specs.loading import from_mapping, load_spec, save_spec, to_mapping
from dflop.specs.hf_config import encoder_from_hf_config, llm_from_hf_config
from dflop.specs.models import EncoderSpec, LLMSpec, MLLMSpec, TilingSpec
from dflop.specs.plan import (MODULES, GpuMap, Module, ModulePlan, Placement, Plan, Recompute, Strategy,
                              even_split, place)
from dflop.specs import presets

__all__ = [
    "GIB", "ClusterSpec", "HardwareSpec", "TrainingSpec", "EncoderSpec", "LLMSpec", "MLLMSpec",
    "TilingSpec", "encoder_from_hf_config", "llm_from_hf_config", "MODULES", "GpuMap", "Module", "ModulePlan",
    "Placement", "Plan", "Recompute", "Strategy", "even_split", "place", "presets", "from_mapping", "load_spec",
    "save_spec", "to_mapping",
]
