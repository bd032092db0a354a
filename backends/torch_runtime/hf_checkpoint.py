"""Initial weights from a local Hugging Face checkpoint folder, each rank reading its own tensors.

A folder holds ``config.json`` and ``model.safetensors``, or shards listed in
``model.safetensors.index.json``. Every file is opened with ``safetensors.safe_open``
(memory-mapped: a header read, then only the bytes asked for), and a rank reads
only the parameters of its stages, and of a tensor-parallel parameter only its
shard (``get_slice``): no process ever holds the whole model. The ranks load after
tensor parallelism has split their blocks and before FSDP2 shards them, so FSDP
shards what a rank read (each rank reads its stages' TP-local tensors whole).

Names are data: a checkpoint name is first rewritten to a canonical one
(``PREFIXES``: transformers 5 writes LLaVA-OneVision as ``language_model.model.*``,
released checkpoints and ``LlavaOnevisionModel`` as ``model.language_model.*``),
and dflop's parameters name their canonical counterparts (``Names``: the LLM's, and each
encoder family's).
Layouts agree as they are: Qwen2, Llama and Mistral keep q, k and v separate, as
dflop does; dflop's ``rotary`` pairs channel i with i + head_dim / 2 at angle
position x theta^(-2i/head_dim), which is transformers' ``rotate_half``; norm
epsilons come from the config (``LLMSpec.norm_eps``). What dflop's model would
compute differently is refused up front (``refusals``), never run approximately.
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from dflop.errors import DflopError
from dflop.specs.hf_config import llm_from_hf_config
from dflop.specs.loading import load_json
from dflop.specs.models import MLLMSpec
from dflop.specs.plan import Module

from dflop.backends.torch_runtime.parallel import local

LLM_TYPES = ("qwen2", "llama", "mistral")
"""Plain LLM checkpoints (``model_type``) dflop's decoder computes exactly."""
VLM_TYPES = {"llava_onevision": "siglip", "internvl": "internvit"}
"""Vision-language checkpoints (``model_type``) dflop's model computes exactly, and their encoder family."""
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

PREFIXES = (
    ("language_model.model.", "llm."), ("model.language_model.", "llm."),
    ("language_model.lm_head.", "head."), ("lm_head.", "head."),
    ("model.vision_tower.vision_model.", "vision."), ("vision_tower.vision_model.", "vision."),
    ("model.vision_tower.", "vision."), ("vision_tower.", "vision."),
    ("model.multi_modal_projector.", "projector."), ("multi_modal_projector.", "projector."),
    ("model.image_newline", "newline"), ("image_newline", "newline"),
    ("model.", "llm."),
)
"""Checkpoint name prefix -> canonical prefix; the first that matches wins (longest first)."""
LLM_STYLE = {to: prefix for prefix, to in PREFIXES if prefix in ("model.", "lm_head.")}
"""Canonical prefix -> the prefix a plain LLM checkpoint (Qwen2, Llama) writes for it."""


@dataclass(frozen=True)
class Names:
    """dflop's parameters of one module as a checkpoint family names them (canonical names)."""

    top: dict[str, str]
    """Parameters outside the blocks (stage-local names) -> canonical names."""
    blocks: str
    """The canonical prefix of layer i (``{blocks}.{i}.``)."""
    parts: dict[str, str]
    """Each block part (``q``, ``ls1``) -> its name in the layer."""


LLM_NAMES = Names(
    {"embed.weight": "llm.embed_tokens.weight", "norm.weight": "llm.norm.weight", "head.weight": "head.weight"},
    "llm.layers", {"norm1": "input_layernorm", "norm2": "post_attention_layernorm", "q": "self_attn.q_proj",
                   "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                   "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"})
ENCODER_NAMES = {
    "siglip": Names(  # LLaVA-OneVision: SigLIP, LLaVA's projector, the image newline
        {"embed.conv.weight": "vision.embeddings.patch_embedding.weight",
         "embed.conv.bias": "vision.embeddings.patch_embedding.bias",
         "embed.position": "vision.embeddings.position_embedding.weight",
         "projector.layers.0.weight": "projector.linear_1.weight", "projector.layers.0.bias": "projector.linear_1.bias",
         "projector.layers.2.weight": "projector.linear_2.weight", "projector.layers.2.bias": "projector.linear_2.bias",
         "newline": "newline"},
        "vision.encoder.layers", {"norm1": "layer_norm1", "norm2": "layer_norm2", "q": "self_attn.q_proj",
                                  "k": "self_attn.k_proj", "v": "self_attn.v_proj", "proj": "self_attn.out_proj",
                                  "fc1": "mlp.fc1", "fc2": "mlp.fc2"}),
    "internvit": Names(  # transformers' InternVL: InternViT with its class token, the normalising projector
        {"embed.conv.weight": "vision.embeddings.patch_embeddings.projection.weight",
         "embed.conv.bias": "vision.embeddings.patch_embeddings.projection.bias",
         "embed.cls": "vision.embeddings.cls_token", "embed.position": "vision.embeddings.position_embeddings",
         "projector.norm.weight": "projector.layer_norm.weight", "projector.norm.bias": "projector.layer_norm.bias",
         "projector.layers.0.weight": "projector.linear_1.weight", "projector.layers.0.bias": "projector.linear_1.bias",
         "projector.layers.2.weight": "projector.linear_2.weight", "projector.layers.2.bias": "projector.linear_2.bias"},
        "vision.encoder.layer", {"norm1": "layernorm_before", "norm2": "layernorm_after", "q": "attention.q_proj",
                                 "k": "attention.k_proj", "v": "attention.v_proj", "proj": "attention.projection_layer",
                                 "q_norm": "attention.q_norm", "k_norm": "attention.k_norm", "fc1": "mlp.fc1",
                                 "fc2": "mlp.fc2", "ls1": "lambda_1", "ls2": "lambda_2"}),
}
"""Each encoder family's names, by the family's VLM (a plain LLM's folder has no encoder weights)."""
UNUSED = re.compile(r"vision\.(post_layernorm|head)\..*")
"""Tensors a checkpoint has that its VLM never runs (SigLIP's final norm and pooling head)."""


def names(module: Module, family: str) -> Names:
    if module is Module.LLM:
        return LLM_NAMES
    if family not in ENCODER_NAMES:
        raise DflopError(f"dflop's {family or 'own'} encoder has no Hugging Face checkpoint names")
    return ENCODER_NAMES[family]


def canonical(name: str) -> tuple[str, str, str]:
    """(canonical name, the checkpoint's prefix, the canonical prefix) of a checkpoint tensor name
    (unchanged, with empty prefixes, when no prefix matches)."""
    for prefix, to in PREFIXES:
        if name.startswith(prefix):
            return to + name[len(prefix):], prefix, to
    return name, "", ""


def checkpoint_name(name: str, style: dict[str, str]) -> str:
    """A canonical name as a checkpoint writes it (``style``: canonical prefix -> its prefix), the
    inverse of :func:`canonical` for that checkpoint."""
    to = next((to for _, to in PREFIXES if to and name.startswith(to)), "")
    return style.get(to, to) + name[len(to):]


def parameter_name(module: Module, name: str, tied: bool, family: str = "") -> str:
    """The canonical checkpoint name of dflop's stage-local parameter ``name`` of ``module`` (an
    encoder's: of the checkpoint's encoder ``family``)."""
    table = names(module, family)
    block = re.fullmatch(r"blocks\.(\d+)\.(\w+?)(\.weight|\.bias)?", name)
    if block and block[2] in table.parts:
        return f"{table.blocks}.{block[1]}.{table.parts[block[2]]}{block[3] or ''}"
    if tied and module is Module.LLM and name == "head.weight":
        return "llm.embed_tokens.weight"
    if name not in table.top:
        raise DflopError(f"dflop's {module}.{name} has no counterpart in a Hugging Face checkpoint")
    return table.top[name]


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder's tensor names (canonical -> (checkpoint name, file)), read from headers."""

    folder: Path
    config: dict[str, Any]
    tensors: dict[str, tuple[str, Path]]
    listing: Path
    """The file that lists the tensors (the index, or the single safetensors file): errors name it."""
    style: dict[str, str]
    """Canonical prefix -> the prefix this checkpoint writes for it (to name a missing tensor as it would)."""
    tied: bool
    """Its head is its embedding (as transformers ties them for its ``model_type``)."""

    @property
    def family(self) -> str:
        """Its encoder's family ("" for a plain LLM)."""
        return VLM_TYPES.get(self.config.get("model_type"), "")

    @property
    def vision(self) -> bool:
        return bool(self.family)

    def locate(self, name: str) -> tuple[str, Path]:
        if name not in self.tensors:
            expected = checkpoint_name(name, self.style)
            raise DflopError(f"{self.listing}: missing tensor '{expected}' (dflop's model needs it)")
        return self.tensors[name]


def _safe_open(path: Path):  # noqa: ANN202 - safetensors' handle
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise DflopError(f"{path}: cannot read as safetensors ({str(exc).splitlines()[0]})") from None


def _listing(folder: Path) -> tuple[Path, dict[str, Path]]:
    """(the file listing the tensors, checkpoint name -> file)."""
    index = folder / INDEX
    if index.is_file():
        data = load_json(index)
        weights = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weights, dict) or not all(isinstance(v, str) for v in weights.values()):
            raise DflopError(f"{index}: weight_map: expected a mapping of tensor names to file names")
        for file in sorted(set(weights.values())):
            if not (folder / file).is_file():
                raise DflopError(f"{index}: weight_map names '{file}', which is not in {folder}")
        return index, {name: folder / file for name, file in weights.items()}
    single = folder / SINGLE
    if not single.is_file():
        raise DflopError(f"{folder}: no {SINGLE} or {INDEX} (a Hugging Face checkpoint folder has one)")
    with _safe_open(single) as f:
        return single, dict.fromkeys(f.keys(), single)


def refusals(config: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """(key, value, what dflop computes) for each config setting dflop's model would not reproduce."""
    vision = config.get("model_type") in VLM_TYPES
    text = config.get("text_config") if vision else config
    text = text if isinstance(text, dict) else {}
    where = "text_config." if vision else ""
    out = []
    if text.get("model_type") not in LLM_TYPES:
        out.append((f"{where}model_type", text.get("model_type"), f"one of {', '.join(LLM_TYPES)}"))
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
    checks = [(f"{where}hidden_act", text.get("hidden_act", "silu"), "silu"),
              (f"{where}rope type", kind, "default")]
    vc = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else {}
    vision_checks = {
        "llava_onevision": [
            ("vision_config.model_type", vc.get("model_type"), "siglip_vision_model"),
            ("vision_config.hidden_act", vc.get("hidden_act", "gelu_pytorch_tanh"), "gelu_pytorch_tanh"),
            ("multimodal_projector_bias", config.get("multimodal_projector_bias", True), True),
            ("vision_feature_select_strategy", config.get("vision_feature_select_strategy", "full"), "full")],
        "internvl": [
            ("vision_config.model_type", vc.get("model_type"), "internvl_vision"),
            ("vision_config.hidden_act", vc.get("hidden_act", "gelu"), "gelu"),
            ("vision_config.use_mean_pooling", vc.get("use_mean_pooling", True), True),  # no final norm
            ("vision_config.use_absolute_position_embeddings", vc.get("use_absolute_position_embeddings", True),
             True),
            ("downsample_ratio", config.get("downsample_ratio", 0.5), 0.5),
            ("vision_feature_select_strategy", config.get("vision_feature_select_strategy", "default"), "default")],
    }.get(config.get("model_type"), [])
    if vision:
        checks += vision_checks + [
            ("vision_config.layer_norm_eps", vc.get("layer_norm_eps", 1e-6), 1e-6),
            ("projector_hidden_act", config.get("projector_hidden_act", "gelu"), "gelu")]
    return out + [(k, v, str(want)) for k, v, want in checks if v != want]


def open_checkpoint(folder: str | Path) -> Checkpoint:
    """The folder's config and tensor names (file headers only), refusing what dflop cannot run exactly."""
    folder = Path(folder)
    config_file = folder / "config.json"
    config = load_json(config_file)
    if not isinstance(config, dict):
        raise DflopError(f"{config_file}: expected a JSON object (a Hugging Face config.json)")
    known = LLM_TYPES + tuple(VLM_TYPES)
    if config.get("model_type") not in known:
        raise DflopError(f"{config_file}: model_type: {config.get('model_type')!r} is not a checkpoint dflop "
                         f"loads (known: {', '.join(known)})")
    for key, value, want in refusals(config):
        raise DflopError(f"{config_file}: {key}: {value!r}: dflop's model computes {want} only")
    listing, files = _listing(folder)
    tensors: dict[str, tuple[str, Path]] = {}
    style: dict[str, str] = {}
    for name, file in files.items():
        key, prefix, to = canonical(name)
        tensors[key] = (name, file)
        style.setdefault(to, prefix)
    return Checkpoint(folder, config, tensors, listing, style, llm_from_hf_config(config_file).tie_embeddings)


def whole_model_shapes(model: MLLMSpec, vision: bool) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor the whole model takes from a checkpoint (built on the
    meta device: no memory)."""
    from dflop.backends.torch_runtime.model import EncoderStage, LLMStage

    with torch.device("meta"):
        parts = [(Module.LLM, LLMStage(model, range(model.llm.layers), True, True))]
        if vision:
            parts.append((Module.ENCODER, EncoderStage(model, range(model.encoder.layers), True, True)))
    return {parameter_name(kind, n, model.llm.tie_embeddings, model.encoder.family): tuple(p.shape)
            for kind, stage in parts for n, p in stage.named_parameters()}


def check_checkpoint(ckpt: Checkpoint, model: MLLMSpec) -> None:
    """Every tensor the model needs is there with its shape, and nothing is there that it does not
    use: the first problem as one line naming the tensor and the file (headers only)."""
    need = whole_model_shapes(model, ckpt.vision)
    with Files() as opened:
        for name, shape in need.items():
            hf, file = ckpt.locate(name)
            _check_shape(tuple(opened(file).get_slice(hf).get_shape()), shape, hf, file)
    for name, (hf, file) in sorted(ckpt.tensors.items()):
        if name in need or UNUSED.fullmatch(name) or _unrun_layer(name, model.encoder.layers, ckpt.family):
            continue
        if model.llm.tie_embeddings and name == "head.weight":
            continue  # some tied checkpoints save the head as well
        raise DflopError(f"{file}: unexpected tensor '{hf}' (no parameter of dflop's "
                         f"{model.name if ckpt.vision else model.llm.name} takes it)")


def _unrun_layer(name: str, layers_run: int, family: str) -> bool:
    """A vision layer after the one whose features the VLM takes (``vision_feature_layer``)."""
    m = re.match(re.escape(ENCODER_NAMES[family].blocks) + r"\.(\d+)\.", name) if family else None
    return m is not None and int(m[1]) >= layers_run


def _check_shape(found: tuple[int, ...], want: tuple[int, ...], hf: str, file: Path) -> None:
    if tuple(found) != tuple(want):
        raise DflopError(f"{file}: tensor '{hf}' has shape {list(found)}, the config asks for {list(want)}")


def _local_index(p: torch.Tensor) -> tuple[slice, ...]:
    """The part of the whole tensor a (tensor-parallel DTensor) parameter holds on this rank."""
    index = [slice(None)] * p.dim()
    for mesh_dim, placement in enumerate(getattr(p, "placements", ())):
        if placement.is_shard():
            size, at = p.device_mesh.size(mesh_dim), p.device_mesh.get_local_rank(mesh_dim)
            n = p.shape[placement.dim] // size
            index[placement.dim] = slice(at * n, (at + 1) * n)
    return tuple(index)


def load_module(module: nn.Module, kind: Module, ckpt: Checkpoint,
                opened: Callable[[Path], Any]) -> dict[str, tuple[int, ...]]:
    """Copy ``module``'s parameters (stage-local names; whole or a TP shard each) from the checkpoint,
    reading only those bytes; returns checkpoint name -> shape of what was read."""
    read: dict[str, tuple[int, ...]] = {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            hf, file = ckpt.locate(parameter_name(kind, name, ckpt.tied, ckpt.family))
            view = opened(file).get_slice(hf)
            _check_shape(tuple(view.get_shape()), tuple(p.shape), hf, file)
            part = view[_local_index(p)]
            local(p).copy_(part.to(local(p).dtype))
            read[hf] = tuple(part.shape)
    return read


class Files:
    """Each safetensors file opened once when first asked for (memory-mapped), all closed together."""

    def __init__(self) -> None:
        self._stack, self._handles = ExitStack(), {}

    def __enter__(self) -> "Files":
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def __call__(self, file: Path) -> Any:
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(_safe_open(file))
        return self._handles[file]


def load_stages(ckpt: Checkpoint, modules: list[tuple[Module, nn.Module]]) -> dict[str, tuple[int, ...]]:
    """Load every (kind, stage module) the checkpoint has weights for (a plain LLM has none for an
    encoder: that keeps its seeded weights), each file opened once."""
    with Files() as opened:
        read: dict[str, tuple[int, ...]] = {}
        for kind, module in modules:
            if kind is Module.LLM or ckpt.vision:
                read.update(load_module(module, kind, ckpt, opened))
        return read
