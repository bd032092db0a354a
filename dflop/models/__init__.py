"""Torch modules of the encoders and LLMs dflop plans for (the profiler and a backend use them)."""

from dflop.models.attention import reference_attention, varlen_attention
from dflop.models.llm import DecoderBlock, DecoderLLM, pack, packed_loss
from dflop.models.vit import Projector, VisionBlock, VisionEncoder

__all__ = ["reference_attention", "varlen_attention", "DecoderBlock", "DecoderLLM", "pack", "packed_loss",
           "Projector", "VisionBlock", "VisionEncoder"]
