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
    h, kv, f = llm.hidden, llm.kv_dim, llm.ffn
    attention = h * (h + 2 * kv) + h * h + (h + 2 * kv if llm.qkv_bias else 0)
    return attention + 3 * h * f + 2 * h  # + two RMSNorm weights


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
    h, kv, f = llm.hidden, llm.kv_dim, llm.ffn
    gemm = 2.0 * tokens * (h * (h + 2 * kv) + h * h + 3 * h * f)
    attention = 4.0 * h * sum_sq * 0.5  # QK^T and AV over each sample, causal half
    return LayerFlops(gemm, attention)


def llm_head_flops(llm: LLMSpec, tokens: Array) -> Array:
    return 2.0 * tokens * llm.hidden * llm.vocab


def llm_layer_activation_elements(llm: LLMSpec, tokens: Array) -> Array:
    """Elements a layer keeps for backward (flash attention, no score matrix): both norms'
    inputs and outputs, Q, K, V, the attention output, SwiGLU's gate, up and product."""
    return tokens * (6 * llm.hidden + 2 * llm.kv_dim + 3 * llm.ffn)


def llm_layer_selective_elements(llm: LLMSpec, tokens: Array) -> Array:
    """Of those, what selective recomputation drops and recomputes: both norms' outputs and
    SwiGLU's product (elementwise, cheap to redo, a third of the layer's activations)."""
    return tokens * (2 * llm.hidden + llm.ffn)


# ---- ViT encoder -----------------------------------------------------------------------------

def vit_layer_params(enc: EncoderSpec) -> int:
    h, m = enc.hidden, enc.mlp
    bias = (3 * h if enc.qkv_bias else 0) + h + m + h
    return 4 * h * h + 2 * h * m + bias + 4 * h  # + two norms (weight and bias)


def vit_embedding_params(enc: EncoderSpec) -> int:
    return 3 * enc.patch_size**2 * enc.hidden + enc.hidden + enc.patches_per_tile * enc.hidden


def projector_params(model: MLLMSpec) -> int:
    d_in, d_out = model.projector_in, model.llm.hidden
    if model.projector == "linear":
        return d_in * d_out + d_out
    return d_in * d_out + d_out + d_out * d_out + d_out


def vit_layer_flops(enc: EncoderSpec, tiles: Array) -> LayerFlops:
    p = enc.patches_per_tile
    tokens = tiles * p
    gemm = 2.0 * tokens * (4 * enc.hidden**2 + 2 * enc.hidden * enc.mlp)
    attention = 4.0 * enc.hidden * tiles * p * p  # bidirectional, each tile its own sequence
    return LayerFlops(gemm, attention)


def vit_embedding_flops(enc: EncoderSpec, tiles: Array) -> Array:
    return 2.0 * tiles * enc.patches_per_tile * 3 * enc.patch_size**2 * enc.hidden


def projector_flops(model: MLLMSpec, tiles: Array) -> Array:
    tokens = tiles * model.encoder.patches_per_tile / model.encoder.merge
    d_in, d_out = model.projector_in, model.llm.hidden
    per_token = d_in * d_out + (0 if model.projector == "linear" else d_out * d_out)
    return 2.0 * tokens * per_token


def vit_layer_activation_elements(enc: EncoderSpec, tiles: Array) -> Array:
    """Norm inputs and outputs, Q, K, V, attention output, the MLP's two intermediates."""
    return tiles * enc.patches_per_tile * (8 * enc.hidden + 2 * enc.mlp)


def vit_layer_selective_elements(enc: EncoderSpec, tiles: Array) -> Array:
    """Both norms' outputs and the GELU's output: what selective recomputation redoes."""
    return tiles * enc.patches_per_tile * (2 * enc.hidden + enc.mlp)


def projector_activation_elements(model: MLLMSpec, tiles: Array) -> Array:
    tokens = tiles * model.encoder.patches_per_tile / model.encoder.merge
    return tokens * (model.projector_in + 2 * model.llm.hidden)
