from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflop.errors import DflopError
from dflop.models import (DecoderBlock, DecoderLLM, VisionEncoder, pack, packed_loss, reference_attention,
                          varlen_attention)
from dflop.specs import MLLMSpec, presets

TINY = presets.model("tiny-vit", "tiny-llm")


@pytest.mark.numerics
@settings(max_examples=40)
@given(lengths=st.lists(st.integers(1, 24), min_size=1, max_size=5), causal=st.booleans(),
       groups=st.sampled_from([1, 2, 4]), seed=st.integers(0, 1000))
def test_varlen_attention_matches_the_naive_reference(lengths, causal, groups, seed):
    torch.manual_seed(seed)
    t, kv = sum(lengths), 2
    q = torch.randn(t, kv * groups, 16, dtype=torch.float64)
    k, v = torch.randn(t, kv, 16, dtype=torch.float64), torch.randn(t, kv, 16, dtype=torch.float64)
    _, cu = pack(lengths)
    fast = varlen_attention(q, k, v, cu, causal=causal, use_flash=False)
    assert torch.allclose(fast, reference_attention(q, k, v, cu, causal=causal), atol=1e-10)


@pytest.mark.numerics
@settings(max_examples=20)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4), groups=st.sampled_from([1, 2]),
       seed=st.integers(0, 1000))
def test_causal_samples_are_attended_at_aligned_lengths_with_the_reference_s_gradients(lengths, groups, seed):
    """A causal sample runs SDPA padded to a multiple of CAUSAL_ALIGN (an unaligned length runs its
    math kernel up to 40% slower than the round lengths a profile measures) and nothing of the padding
    reaches the outputs or the gradients."""
    import dflop.models.attention as attention

    torch.manual_seed(seed)
    t = sum(lengths)
    inputs = [torch.randn(t, h, 8, dtype=torch.float64, requires_grad=True) for h in (2 * groups, 2, 2)]
    _, cu = pack(lengths)
    seen, sdpa = [], attention.F.scaled_dot_product_attention

    def recording(q, *args, **kwargs):
        seen.append(q.shape[-2])
        return sdpa(q, *args, **kwargs)

    attention.F.scaled_dot_product_attention = recording
    try:
        fast = varlen_attention(*inputs, cu, causal=True, use_flash=False)
    finally:
        attention.F.scaled_dot_product_attention = sdpa
    assert seen == [-(-n // attention.CAUSAL_ALIGN) * attention.CAUSAL_ALIGN for n in lengths]
    weights = torch.randn_like(fast)
    grads = torch.autograd.grad((fast * weights).sum(), inputs)
    slow = reference_attention(*inputs, cu, causal=True)
    expected = torch.autograd.grad((slow * weights).sum(), inputs)
    assert torch.allclose(fast, slow, atol=1e-10)
    assert all(torch.allclose(g, e, atol=1e-10) for g, e in zip(grads, expected))


@pytest.mark.numerics
def test_the_flash_attn_path_keeps_the_varlen_kernel_s_contract(monkeypatch):
    """flash-attn runs only on a GPU, so its path is held here to what its varlen kernel takes
    (flash_attn 2.x ``flash_attn_varlen_func``): (tokens, heads, dim) tensors, query heads a multiple
    of key heads, int32 cumulative lengths from 0 to the tokens on the tensors' device, the longest
    sample as an int, causal for the LLM. A stand-in that checks all that and attends naively trains
    the model exactly as the fallback does."""
    import dflop.models.attention as attention

    causal_calls = []

    def stand_in(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                 softmax_scale=None, causal=False):
        assert q.dim() == k.dim() == 3 and k.shape == v.shape and q.shape[0] == k.shape[0] == int(cu_seqlens_q[-1])
        assert q.shape[1] % k.shape[1] == 0 and q.shape[2] == k.shape[2]
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.device == q.device and int(cu_seqlens_q[0]) == 0
        assert torch.equal(cu_seqlens_q, cu_seqlens_k) and max_seqlen_q == max_seqlen_k
        assert type(max_seqlen_q) is int and max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        assert dropout_p == 0.0 and softmax_scale is None  # the default scale, 1/sqrt(dim)
        causal_calls.append(causal)
        return reference_attention(q, k, v, cu_seqlens_q, causal=causal)

    def gradients(flash: bool):
        torch.manual_seed(0)
        model = DecoderLLM(TINY.llm).double()
        lengths = [7, 1, 12, 5]
        tokens = torch.randint(0, TINY.llm.vocab, (sum(lengths),))
        positions, cu = pack(lengths)
        with monkeypatch.context() as m:
            if flash:
                m.setattr(attention, "flash_attn_varlen_func", stand_in)
                m.setattr(attention, "flash_available", lambda q: True)
            packed_loss(model(tokens, positions, cu), tokens, cu).backward()
        return [p.grad for p in model.parameters()]

    fallback, flash = gradients(False), gradients(True)
    assert causal_calls == [True] * TINY.llm.layers  # every block, causal; none on the fallback run
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(fallback, flash))


@pytest.mark.numerics
@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_gradients_equal_the_sum_of_per_sample_gradients(checkpointing):
    torch.manual_seed(0)
    model = DecoderLLM(TINY.llm, checkpointing=checkpointing).double()
    lengths = [9, 3, 14]
    tokens = torch.randint(0, TINY.llm.vocab, (sum(lengths),))
    positions, cu = pack(lengths)
    packed = packed_loss(model(tokens, positions, cu), tokens, cu)
    packed.backward()
    together = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    total, start = 0.0, 0
    for n in lengths:
        p1, c1 = pack([n])
        part = tokens[start:start + n]
        start += n
        loss = packed_loss(model(part, p1, c1), part, c1)
        loss.backward()
        total += loss.item()
    assert packed.item() == pytest.approx(total, rel=1e-12)
    for a, p in zip(together, model.parameters()):
        assert torch.allclose(a, p.grad, atol=1e-10)


def test_vision_encoder_feeds_the_llm_the_tokens_the_tiling_promises():
    enc = VisionEncoder(TINY)
    out = enc(torch.randn(3, 3, 64, 64))
    assert out.shape == (3, TINY.encoder.tiling.tile_tokens, TINY.llm.hidden)
    small = replace(presets.encoder("internvit-300m"), layers=1, hidden=64, heads=4, mlp=128, image_size=56)
    shuffled = VisionEncoder(MLLMSpec(encoder=small, llm=TINY.llm))(torch.randn(2, 3, 56, 56))
    assert shuffled.shape == (2, (56 // 14) ** 2 // 4, TINY.llm.hidden)  # pixel shuffle: 4 patches -> 1 token


def test_tensor_parallel_shard_halves_the_block():
    full, half = DecoderBlock(TINY.llm), DecoderBlock(TINY.llm, tp=2)
    assert half.q.out_features == full.q.out_features // 2 and half.gate.out_features == full.gate.out_features // 2
    with pytest.raises(DflopError, match="tp 3 does not divide the 4 attention heads"):
        DecoderBlock(TINY.llm, tp=3)


def test_bfloat16_runs_on_cpu():
    model = DecoderLLM(TINY.llm, layers=1).to(torch.bfloat16)
    positions, cu = pack([5, 7])
    logits = model(torch.randint(0, TINY.llm.vocab, (12,)), positions, cu)
    assert logits.dtype == torch.bfloat16 and logits.shape == (12, TINY.llm.vocab)
