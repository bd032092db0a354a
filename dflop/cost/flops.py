"""FLOP, parameter and activation counts of one layer and of the fixed parts.

Counts follow Megatron-LM's accounting (2 FLOPs per multiply-add, matmuls only):
an LLM layer with grouped-query attention and a SwiGLU MLP, a ViT layer with a
two-matrix GELU MLP. Attention scores and weighted sums grow with each
sample's *own* length, so they are counted from the sum of squared lengths;
causal attention (flash-attention skips the masked half) counts half.
All functions broadcast over numpy arrays of shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dflop.specs.models import EncoderSpec, LLMSpec, MLLMSpec

Array = Any  # float or numpy array


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one layer (whole layer, before tensor parallelism)."""

    gemm: Array
    attention: Array

    @property
    def total(self) -> Array:
        return self.gemm + self.attention


# ---- LLM -------------------------------------------------------------------------------------

def llm_layer_params(llm: LLMSpec) -> int:
    """q, k, v, o (heads x head_dim wide, not hidden), their biases, the SwiGLU MLP, the layer's
    RMSNorm weights and Qwen3's per-head q/k norms: what transformers builds for the config."""
    h, q, kv, f = llm.hidden, llm.q_dim, llm.kv_dim, llm.ffn
    attention = h * (q + 2 * kv) + q * h + (q + 2 * kv if llm.qkv_bias else 0) + (h if llm.o_bias else 0)
    norms = llm.layer_norms * h + (2 * llm.head_dim if llm.qk_norm else 0)
    return attention + 3 * h * f + norms


def llm_embedding_params(llm: LLMSpec) -> int:
    return llm.vocab * llm.hidden


def llm_head_params(llm: LLMSpec) -> int:
    """Output projection plus the final norm. Tied embeddings still keep a copy on the last
    pipeline stage (as Megatron does), so the count is the same either way."""
    return llm.vocab * llm.hidden + llm.hidden


def llm_params(llm: LLMSpec) -> int:
    head = 0 if llm.tie_embeddings else llm.vocab * llm.hidden
    return llm.layers * llm_layer_params(llm) + llm_embedding_params(llm) + head + llm.hidden


def llm_layer_flops(llm: LLMSpec, tokens: Array, sum_sq: Array) -> LayerFlops:
    h, q, kv, f = llm.hidden, llm.q_dim, llm.kv_dim, llm.ffn
    gemm = 2.0 * tokens * (h * (q + 2 * kv) + q * h + 3 * h * f)
    attention = 4.0 * q * sum_sq * 0.5  # QK^T and AV over each sample, causal half
    return LayerFlops(gemm, attention)


def llm_head_flops(llm: LLMSpec, tokens: Array) -> Array:
    return 2.0 * tokens * llm.hidden * llm.vocab


def llm_layer_activation_elements(llm: LLMSpec, tokens: Array) -> Array:
    """Elements a layer keeps for backward (flash attention, no score matrix): both norms'
    inputs and outputs, Q, K, V, the attention output, SwiGLU's gate, up and product."""
    return tokens * (2 * llm.layer_norms * llm.hidden + 2 * llm.q_dim + 2 * llm.kv_dim + 3 * llm.ffn)


def llm_layer_selective_elements(llm: LLMSpec, tokens: Array) -> Array:
    """Of those, what selective recomputation drops and recomputes: both norms' outputs and
    SwiGLU's product (elementwise, cheap to redo, a third of the layer's activations)."""
    return tokens * (llm.layer_norms * llm.hidden + llm.ffn)


# ---- ViT encoder -----------------------------------------------------------------------------

def vit_layer_params(enc: EncoderSpec) -> int:
    h, m = enc.hidden, enc.mlp
    if enc.mlp_kind == "swiglu":  # Qwen2.5-VL: gate, up and down projections, all with biases
        mlp = 3 * h * m + 2 * m + h
    else:
        mlp = 2 * h * m + m + h
    # Two norms (weight and bias; a weight alone for RMSNorm), InternViT-6B's q/k norms over the
    # whole width, and InternViT's two layer scales.
    norms = (2 if enc.norm == "rmsnorm" else 4) * h + (2 * h if enc.qk_norm else 0)
    scales = 2 * h if enc.family == "internvit" else 0
    return 4 * h * h + (3 * h if enc.qkv_bias else 0) + h + mlp + norms + scales


def vit_embedding_params(enc: EncoderSpec) -> int:
    """Patch embedding and positions: CLIP adds a class token (and its position) and a norm, with
    no convolution bias; Qwen2-VL's 3-D patch embedding has no bias and no position table (rotary)."""
    h, patch = enc.hidden, 3 * enc.patch_size**2 * enc.hidden
    if enc.family == "clip":
        return patch + h + (enc.patches_per_tile + 1) * h + 2 * h
    if enc.family == "qwen2_vl":
        return enc.tiling.temporal_patch * patch
    if enc.family == "internvit":  # a class token and its position, as CLIP's, without the norm
        return patch + h + (enc.patches_per_tile + 1) * h + h
    return patch + h + enc.patches_per_tile * h


def _merger(model: MLLMSpec) -> bool:
    """Qwen2-VL's towers end in their own merger (a norm, then Linear(in, in), GELU, Linear(in, out)),
    which takes the projector's place."""
    return model.encoder.family == "qwen2_vl"


def projector_params(model: MLLMSpec) -> int:
    d_in, d_out = model.projector_in, model.llm.hidden
    if _merger(model):
        norm = model.encoder.hidden * (1 if model.encoder.norm == "rmsnorm" else 2)
        return norm + d_in * d_in + d_in + d_in * d_out + d_out
    norm = 2 * d_in if model.encoder.family == "internvit" else 0  # InternVL's mlp1 starts with a LayerNorm
    if model.projector == "linear":
        return norm + d_in * d_out + d_out
    return norm + d_in * d_out + d_out + d_out * d_out + d_out


def _native_span(enc: EncoderSpec, tiles: Array, samples: Array) -> Array:
    """Patches one full-attention sequence of a native-resolution tower holds: a microbatch's images
    taken as equal, one per sample (``tiles / samples`` tiles), at most one ``max_pixels`` image."""
    t = enc.tiling
    largest = t.max_pixels // t.tile_size**2
    mean = np.divide(tiles, np.maximum(samples, 1.0)) if samples is not None else largest
    return np.minimum(mean, largest) * enc.patches_per_tile


def vit_layer_flops(enc: EncoderSpec, tiles: Array, samples: Array = None) -> LayerFlops:
    """One layer's FLOPs, the mean over the encoder's layers. A tile is one sequence, except for
    the native-resolution towers (Qwen2-VL), where a full-attention layer attends over a whole image
    (see ``_native_span``; ``samples``: the samples with media) and a window layer (Qwen2.5-VL)
    within ``window`` x ``window`` patches."""
    p = enc.patches_per_tile
    tokens = tiles * p
    mlp = (3 if enc.mlp_kind == "swiglu" else 2) * enc.hidden * enc.mlp
    gemm = 2.0 * tokens * (4 * enc.hidden**2 + mlp)
    if enc.tiling.scheme != "native":
        attention = 4.0 * enc.hidden * tiles * p * p  # bidirectional, each tile its own sequence
        return LayerFlops(gemm, attention)
    full = 4.0 * enc.hidden * tokens * _native_span(enc, tiles, samples)
    if not enc.window:
        return LayerFlops(gemm, full)
    window = np.minimum(4.0 * enc.hidden * tokens * enc.window**2, full)
    n_full = len(enc.full_layers)
    return LayerFlops(gemm, (n_full * full + (enc.layers - n_full) * window) / enc.layers)


def vit_embedding_flops(enc: EncoderSpec, tiles: Array) -> Array:
    return 2.0 * tiles * enc.patches_per_tile * 3 * enc.patch_size**2 * enc.hidden * enc.tiling.temporal_patch


def projector_flops(model: MLLMSpec, tiles: Array) -> Array:
    tokens = tiles * model.encoder.patches_per_tile / model.encoder.merge
    d_in, d_out = model.projector_in, model.llm.hidden
    if _merger(model):
        per_token = d_in * d_in + d_in * d_out
    else:
        per_token = d_in * d_out + (0 if model.projector == "linear" else d_out * d_out)
    return 2.0 * tokens * per_token


def vit_layer_activation_elements(enc: EncoderSpec, tiles: Array) -> Array:
    """Norm inputs and outputs, Q, K, V, attention output, the MLP's two intermediates (three
    for SwiGLU)."""
    if enc.mlp_kind == "swiglu":
        return tiles * enc.patches_per_tile * (8 * enc.hidden + 3 * enc.mlp)
    return tiles * enc.patches_per_tile * (8 * enc.hidden + 2 * enc.mlp)


def vit_layer_selective_elements(enc: EncoderSpec, tiles: Array) -> Array:
    """Both norms' outputs and the GELU's output: what selective recomputation redoes."""
    return tiles * enc.patches_per_tile * (2 * enc.hidden + enc.mlp)


def projector_activation_elements(model: MLLMSpec, tiles: Array) -> Array:
    tokens = tiles * model.encoder.patches_per_tile / model.encoder.merge
    if _merger(model):
        return tokens * 3 * model.projector_in
    return tokens * (model.projector_in + 2 * model.llm.hidden)
