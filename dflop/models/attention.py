"""Attention over packed variable-length samples: every sample attends only to itself.

Training packs the samples of a microbatch into one sequence (no padding);
attention must then be block-diagonal. With flash-attn installed and a CUDA
half-precision tensor, its varlen kernel does exactly that from the
cumulative sequence lengths; otherwise each sample goes through PyTorch's
``scaled_dot_product_attention`` on its own slice (same result, exact, no
T x T mask in memory), a causal one padded to a round length. The inputs are
split and the per-sample outputs concatenated, never sliced out of the packed
sequence or written into slices of it one by one: autograd's backward of such
a slice (or slice assignment) materialises a gradient as large as the whole
sequence, which would make the backward of n packed samples cost n x T copies,
quadratic in the samples a microbatch packs (dropping a sample's own padded rows
costs its own length only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # only in the `gpu` extra
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_varlen_func = None


def flash_available(q: torch.Tensor) -> bool:
    return flash_attn_varlen_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                     causal: bool, use_flash: bool | None = None) -> torch.Tensor:
    """q: (T, Hq, D); k, v: (T, Hkv, D) with Hq a multiple of Hkv; cu_seqlens: (samples + 1,) int32."""
    if use_flash is None:
        use_flash = flash_available(q)
    if use_flash:
        if flash_attn_varlen_func is None:
            raise RuntimeError("flash-attn is not installed (pip install 'dflop[gpu]')")
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, longest, longest, causal=causal)
    bounds = cu_seqlens.tolist()
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    groups = q.shape[1] // k.shape[1]
    parts = [_sample_attention(qs, ks, vs, causal=causal, gqa=groups > 1)
             for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths)) if len(qs)]
    return torch.cat(parts) if parts else torch.empty_like(q)


CAUSAL_ALIGN = 16
"""A causal sample's length is padded to a multiple of this before ``scaled_dot_product_attention``:
its math kernel's batched matmuls run up to 40% slower on a score matrix whose rows are not a whole
number of vector widths (a 2673-token sample against a 2688-token one on an AVX-512 CPU), and a
profile measured at round lengths would price every real sample that much short."""


def _sample_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, gqa: bool) -> torch.Tensor:
    """One sample's attention, (L, H, D) in and out. A causal sample is padded at its end to a multiple
    of ``CAUSAL_ALIGN``: exact, since no real position attends to a later one, and the padded rows
    are dropped (their gradient is zero)."""
    length = len(q)
    pad = -length % CAUSAL_ALIGN if causal else 0
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=causal, enable_gqa=gqa).transpose(0, 1)
    return out[:length] if pad else out


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                        causal: bool) -> torch.Tensor:
    """The naive definition, for tests: full scores, a block-diagonal (and causal) mask, softmax."""
    t, heads, dim = q.shape
    groups = heads // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    sample = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1, device=q.device),
                                     (cu_seqlens[1:] - cu_seqlens[:-1]).long())
    allowed = sample[:, None] == sample[None, :]
    if causal:
        allowed &= torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("qhd,khd->hqk", q.to(wide), k.to(wide)) / dim**0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.to(wide)).to(q.dtype)
