"""A DCP checkpoint of the torch backend as a Hugging Face folder that ``from_pretrained`` loads.

The checkpoint is read whole in this one process, without a process group, by
torch.distributed.checkpoint itself (``_load_state_dict_from_keys``: DCP assembles
every tensor from the shards that FSDP, tensor parallelism and the pipeline stages
saved). Its keys are dflop's whole-model names (``llm.blocks.3.q.weight``); each goes
back to a Hugging Face name through the one table of :mod:`hf_checkpoint` (dflop
name -> canonical name by ``parameter_name``, canonical -> the source checkpoint's
own name), so the folder has exactly the names, dtypes and ``config.json`` of the
checkpoint the run started from. What the source holds and dflop never trains (SigLIP
layers after ``vision_feature_layer``, its final norm and head) is copied unchanged;
a tied checkpoint that also saved its head gets the trained embedding there.

A run from dflop's own random weights has no source: its LLM is written in the Qwen2
layout (``Qwen2ForCausalLM``: q/k/v biases, RMSNorm, SwiGLU, rotate-half RoPE) when
its spec is one, in the run's dtype; its vision encoder has no Hugging Face
counterpart and is left out. Anything else is one line saying there is nothing to
export to.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch

from dflop.errors import DflopError
from dflop.specs.models import LLMSpec
from dflop.specs.plan import Module

from dflop.backends.torch_runtime.checkpoint import reason
from dflop.backends.torch_runtime.hf_checkpoint import (INDEX, LLM_STYLE, SINGLE, Checkpoint, Files,
                                                        checkpoint_name, parameter_name)

COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template*", "special_tokens_map.json",
          "preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
          "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")
"""The source folder's files (glob patterns) that a trained model keeps as they are."""
SHARD_BYTES = 5 * 10**9
"""Largest safetensors file before the weights are split with an index (save_pretrained's 5GB)."""
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
"""safetensors' dtype names: the source's dtype of each tensor is the exported one's."""


def read_parameters(path: Path) -> dict[str, torch.Tensor]:
    """Every parameter of a DCP checkpoint, whole, by its key (the optimizer's states left unread)."""
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore")
            return _load_state_dict_from_keys({"model"}, checkpoint_id=str(path))["model"]
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - a damaged checkpoint
        raise DflopError(f"{path}: cannot read this checkpoint ({reason(exc)})") from None


def hf_tensors(params: dict[str, torch.Tensor], llm: LLMSpec, source: Checkpoint | None) -> dict[str, torch.Tensor]:
    """The checkpoint's parameters by Hugging Face name: the source's names (and dtypes, and its
    tensors that dflop does not run), else a plain LLM's."""
    vision = source is not None and source.vision
    tied = source.tied if source is not None else llm.tie_embeddings
    out: dict[str, torch.Tensor] = {}
    trained: dict[str, torch.Tensor] = {}
    for key, tensor in params.items():
        module, _, name = key.partition(".")
        if module == Module.ENCODER and not vision:
            continue  # dflop's own encoder beside a plain LLM: no Hugging Face counterpart
        trained[parameter_name(Module(module), name, tied, source.family if vision else "")] = tensor
    if source is None:
        return {checkpoint_name(n, LLM_STYLE): t for n, t in trained.items()}
    missing = sorted(set(trained) - set(source.tensors))  # before reading a byte of the source
    if missing:
        raise DflopError(f"{source.listing}: has no tensor for dflop's '{missing[0]}' (the run did not start "
                         "from this checkpoint)")
    with Files() as opened:
        for canonical, (hf, file) in source.tensors.items():
            if canonical in trained:
                value = trained[canonical]
            elif tied and canonical == "head.weight":  # a tied checkpoint that saved its head too
                value = trained["llm.embed_tokens.weight"].clone()
            else:
                value = opened(file).get_tensor(hf)
            out[hf] = value.to(DTYPES.get(opened(file).get_slice(hf).get_dtype(), value.dtype)).contiguous()
    return out


def write_safetensors(tensors: dict[str, torch.Tensor], folder: Path, shard_bytes: int = SHARD_BYTES) -> list[str]:
    """``model.safetensors``, or above ``shard_bytes`` shards in order with the index save_pretrained
    writes; the names of the files written."""
    from safetensors.torch import save_file

    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    if len(shards) == 1:
        save_file(tensors, folder / SINGLE, metadata={"format": "pt"})
        return [SINGLE]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    for file, names in zip(files, shards):
        save_file({n: tensors[n] for n in names}, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return files + [INDEX]


def qwen2_config(llm: LLMSpec, dtype: torch.dtype, where: str) -> dict:
    """transformers' ``Qwen2Config`` of dflop's LLM (read back by ``llm_from_hf_config``, the same
    spec), or one line saying why it is none."""
    differs = [what for what, bad in (
        ("it has no q/k/v biases", not llm.qkv_bias), ("it has an output bias", llm.o_bias),
        ("it has per-head q/k norms", llm.qk_norm), ("it has 4 norms a layer", llm.layer_norms != 2),
        (f"its head_dim {llm.head_dim} is not hidden / heads", llm.head_dim * llm.heads != llm.hidden)) if bad]
    if differs:
        raise DflopError(f"{where}: the run started from no Hugging Face checkpoint and its LLM {llm.name} is no "
                         f"Qwen2 ({differs[0]}): it has no Hugging Face model to export to")
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
            "hidden_size": llm.hidden, "intermediate_size": llm.ffn, "num_hidden_layers": llm.layers,
            "num_attention_heads": llm.heads, "num_key_value_heads": llm.kv_heads, "vocab_size": llm.vocab,
            "max_position_embeddings": llm.max_position, "rms_norm_eps": llm.norm_eps,
            "rope_theta": llm.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": llm.rope_theta},
            "tie_word_embeddings": llm.tie_embeddings, "use_sliding_window": False,
            "dtype": str(dtype).removeprefix("torch.")}


def write_folder(checkpoint: Path, llm: LLMSpec, source: Checkpoint | None, out: Path, where: str,
                 shard_bytes: int = SHARD_BYTES) -> list[str]:
    """The Hugging Face folder of ``checkpoint`` in the existing, empty folder ``out``: weights,
    ``config.json`` (the source's, unchanged: same shapes) and the source's tokenizer and processor
    files; the names of the files written. ``where``: the run, for errors."""
    params = read_parameters(checkpoint)
    config = None if source is not None else qwen2_config(llm, next(iter(params.values())).dtype, where)
    files = write_safetensors(hf_tensors(params, llm, source), out, shard_bytes)
    if source is None:
        (out / "config.json").write_text(json.dumps(config, indent=2))
        return files + ["config.json"]
    kept = sorted({p for pattern in ("config.json", *COPIED) for p in source.folder.glob(pattern) if p.is_file()})
    for path in kept:
        shutil.copy2(path, out / path.name)
    return files + [p.name for p in kept]
