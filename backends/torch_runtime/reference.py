"""The sequential reference: the whole model in one process, the whole global batch at once.

A distributed run of any plan must end with the parameters this produces from
the same seed and the same steps (up to floating-point reassociation): same
initial weights (by name), same synthetic inputs (by sample id), same loss (the
sum over every target token divided by their number), same AdamW.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dflop.models.llm import pack
from dflop.specs.models import MLLMSpec
from dflop.specs.plan import Module
from dflop.workload.chat import Encoded
from dflop.workload.sample import SampleTable

from dflop.backends.torch_runtime.hf_checkpoint import load_stages, open_checkpoint
from dflop.backends.torch_runtime.model import build_stage, pack_sequence, sample_inputs
from dflop.backends.torch_runtime.parallel import adamw_options
from dflop.backends.torch_runtime.shapes import target_tokens
from dflop.backends.torch_runtime.worker import TorchOptions


@dataclass(frozen=True)
class Reference:
    parameters: dict[str, torch.Tensor]
    """By whole-model name, after the last step."""
    losses: list[float]
    """Per step."""
    largest_gradient: list[float]
    """Per step, the largest gradient element in magnitude: the scale rounding errors are measured against."""


def reference_training(model: MLLMSpec, batches: list[SampleTable], options: TorchOptions,
                       texts: list[dict[str, Encoded]] | None = None, freeze_encoder: bool = False) -> Reference:
    """The sequential run of ``batches`` in one process; with ``texts`` (each step's real samples by
    id), on their tokens and targets; with ``freeze_encoder``, the encoder's weights untrained."""
    dtype = getattr(torch, options.dtype.value)
    encoder = build_stage(model, Module.ENCODER, 0, (model.encoder.layers,), options.seed).to(dtype)
    llm = build_stage(model, Module.LLM, 0, (model.llm.layers,), options.seed).to(dtype)
    if options.weights:
        load_stages(open_checkpoint(options.weights), [(Module.ENCODER, encoder), (Module.LLM, llm)])
    encoder.requires_grad_(not freeze_encoder)
    params = [p for p in list(encoder.parameters()) + list(llm.parameters()) if p.requires_grad]
    optimizer = torch.optim.AdamW(params, **adamw_options(options))
    losses, largest = [], []
    for step, batch in enumerate(batches):
        rows = np.arange(len(batch))
        real = texts[step] if texts is not None else None
        pixels, text = [], []
        for i in rows:
            p, tok = sample_inputs(options.seed, str(batch.ids[i]), int(batch.tiles[i]), int(batch.text_tokens[i]),
                                   model.encoder.image_size, model.llm.vocab, text=real)
            if len(p):
                pixels.append(p)
            text.append(tok)
        has = batch.tiles > 0
        encoded = [real[str(i)] for i in batch.ids] if real is not None else None
        image = encoder(torch.cat(pixels).to(dtype), [int(t) for t in batch.tiles[has]],
                        [int(m) for m in batch.image_tokens[has]],
                        [e.images for e, h in zip(encoded, has) if h] if encoded is not None else None) \
            if pixels else None
        masks = [e.targets[e.text] for e in encoded] if encoded is not None else None
        seq = pack_sequence([int(m) for m in batch.image_tokens], text, masks,
                            [~e.text for e in encoded] if encoded is not None else None)
        positions, cu = pack(seq.lengths)
        loss = llm(image, seq, positions, cu, text=torch.cat(text),
                   loss_scale=1.0 / max(target_tokens(batch, real), 1))
        loss.backward()
        largest.append(max(float(p.grad.abs().max()) for p in params if p.grad is not None))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    named = {f"encoder.{n}": p.detach().clone() for n, p in encoder.named_parameters()}
    named.update({f"llm.{n}": p.detach().clone() for n, p in llm.named_parameters()})
    return Reference(named, losses, largest)
