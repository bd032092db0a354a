"""A decoder-only LLM with the Qwen2.5 / Llama-3 ingredients, built from an LLMSpec.

RMSNorm, rotary position embeddings (positions restart at every packed
sample), grouped-query attention (with Qwen's q/k/v bias, an output bias,
Qwen3's per-head q/k norms, a head size apart from hidden / heads, Gemma-2's
post-attention and post-MLP norms when the spec asks), a SwiGLU MLP, a tied
or untied LM head: the spec's weights, so the profiler measures its shapes. ``tp`` builds one tensor-parallel
shard (heads, key-value heads, MLP width and vocabulary divided by ``tp``):
what one GPU of a TP group computes, which is what the profiler measures.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflop.errors import DflopError
from dflop.models.attention import varlen_attention
from dflop.specs.models import LLMSpec


def wide(x: torch.Tensor) -> torch.Tensor:
    """At least float32, for norms and losses (half precision in, wide arithmetic inside)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def shard(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise DflopError(f"tp {tp} does not divide the {n} {what}")
    return n // tp


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = wide(x)
        return (w * torch.rsqrt(w.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs of channels (first half with second half) by position-dependent angles."""
    half = x.shape[-1] // 2
    w = wide(x)
    freq = theta ** (-torch.arange(half, device=x.device, dtype=w.dtype) / half)
    angle = positions.to(w.dtype)[:, None] * freq[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    a, b = w[..., :half], w[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).to(x.dtype)


class DecoderBlock(nn.Module):
    def __init__(self, spec: LLMSpec, tp: int = 1) -> None:
        super().__init__()
        self.spec = spec
        self.heads = shard(spec.heads, tp, "attention heads")
        self.kv_heads = shard(spec.kv_heads, tp, "key-value heads")
        h, d = spec.hidden, spec.head_dim
        eps = spec.norm_eps
        self.norm1 = RMSNorm(h, eps)
        self.q = nn.Linear(h, self.heads * d, bias=spec.qkv_bias)
        self.k = nn.Linear(h, self.kv_heads * d, bias=spec.qkv_bias)
        self.v = nn.Linear(h, self.kv_heads * d, bias=spec.qkv_bias)
        self.o = nn.Linear(self.heads * d, h, bias=spec.o_bias)
        self.q_norm = RMSNorm(d, eps) if spec.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(d, eps) if spec.qk_norm else nn.Identity()
        self.norm2 = RMSNorm(h, eps)
        post = spec.layer_norms == 4
        self.post_attention_norm = RMSNorm(h, eps) if post else nn.Identity()
        self.post_mlp_norm = RMSNorm(h, eps) if post else nn.Identity()
        ffn = shard(spec.ffn, tp, "MLP channels")
        self.gate = nn.Linear(h, ffn, bias=False)
        self.up = nn.Linear(h, ffn, bias=False)
        self.down = nn.Linear(ffn, h, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        t, d = x.shape[0], self.spec.head_dim
        a = self.norm1(x)
        # width // d heads: the local count when tensor parallelism has sharded the projections
        heads = lambda y: y.view(t, y.shape[-1] // d, d)  # noqa: E731
        q = rotary(self.q_norm(heads(self.q(a))), positions, self.spec.rope_theta)
        k = rotary(self.k_norm(heads(self.k(a))), positions, self.spec.rope_theta)
        v = heads(self.v(a))
        x = x + self.post_attention_norm(self.o(varlen_attention(q, k, v, cu_seqlens, causal=True).flatten(1)))
        m = self.norm2(x)
        return x + self.post_mlp_norm(self.down(F.silu(self.gate(m)) * self.up(m)))


class DecoderLLM(nn.Module):
    def __init__(self, spec: LLMSpec, tp: int = 1, layers: int | None = None, checkpointing: bool = False) -> None:
        super().__init__()
        self.spec, self.checkpointing = spec, checkpointing
        vocab = shard(spec.vocab, tp, "vocabulary entries")
        self.embed = nn.Embedding(vocab, spec.hidden)
        self.blocks = nn.ModuleList(DecoderBlock(spec, tp) for _ in range(layers or spec.layers))
        self.norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.head = nn.Linear(spec.hidden, vocab, bias=False)
        if spec.tie_embeddings:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor | None, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                embeddings: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of packed samples: ``tokens`` (T,) or ready ``embeddings`` (T, hidden)."""
        x = self.embed(tokens) if embeddings is None else embeddings
        for block in self.blocks:
            if self.checkpointing and self.training:
                x = checkpoint(block, x, positions, cu_seqlens, use_reentrant=False)
            else:
                x = block(x, positions, cu_seqlens)
        return self.head(self.norm(x))


def pack(lengths: list[int], device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, cu_seqlens) of samples of ``lengths`` packed into one sequence."""
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(torch.tensor(lengths, device=device), 0)
    return positions, cu


def packed_loss(logits: torch.Tensor, tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over samples, never across a sample boundary."""
    target = torch.roll(tokens, -1)
    last = (cu_seqlens[1:] - 1).long()
    keep = torch.ones_like(tokens, dtype=torch.bool)
    keep[last] = False
    return F.cross_entropy(wide(logits[keep]), target[keep], reduction="sum")
