"""Conversations as a checkpoint trains on them: rendered by its chat template, tokenized by its
``tokenizer.json``, with the targets LLaVA-NeXT and LLaMA-Factory train on (each assistant turn's
content tokens and its end-of-turn token, nothing else).

The template renders as transformers' ``apply_chat_template`` renders it (a sandboxed jinja2
environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now``, the
special tokens as variables, no generation prompt) and the text is tokenized without adding
special tokens (the template writes them), so the ids are the ones transformers feeds. The data
profiler counts with the same :class:`ChatCounter` the torch backend takes its tokens from, so a
plan is made for exactly the tokens that run. jinja2 and tokenizers are imported only here, when
a checkpoint's template is used.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dflop.errors import DflopError
from dflop.specs.loading import load_json
from dflop.specs.models import EncoderSpec, TilingSpec
from dflop.workload.manifest import read_manifest
from dflop.workload.sample import SampleTable
from dflop.workload.pixels import ImageRef, ImageRule, VideoRef, image_refs, load_image_rule, video_ref
from dflop.workload.schemas import IMAGE, VIDEO, Parsed
from dflop.workload.tokens import TokenCounter, load_tokenizer

USER = "user"
ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system"}
"""Role names the manifest formats use (LLaVA's from: human/gpt, ShareGPT's role), as the template's."""
SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")
INTERNVL_IMAGE = ("<img>", "<IMG_CONTEXT>", "</img>")
"""InternVL's image start, context (the token its features replace) and end tokens: each ``<image>``
becomes ``<img><IMG_CONTEXT></img>``, the context token repeated to the image's tokens."""


@dataclass(frozen=True)
class Encoded:
    """One sample's token ids and which of them are targets; with images or a video, its token
    repeated where their features go (``media``), and the images or the video themselves."""

    ids: np.ndarray
    targets: np.ndarray
    """Bool per token."""
    media: np.ndarray | None = None
    """Bool per token: an image feature takes this position (None: no image)."""
    images: tuple[ImageRef | VideoRef, ...] = ()
    """Its images, or its video, in the order their tokens come."""

    @property
    def text(self) -> np.ndarray:
        """Bool per token: a text token (the LLM embeds its id)."""
        return np.ones(len(self.ids), dtype=bool) if self.media is None else ~self.media

    @property
    def predicted(self) -> int:
        """Target tokens the loss counts: those with a position before them."""
        return int(self.targets[1:].sum())


@dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's chat template and tokenizer (``load_chat``)."""

    template: Any
    tokenizer: Any
    variables: dict[str, str]
    """The special tokens the template may name (``bos_token``, ...)."""
    name: str
    specials: frozenset[str] = frozenset()
    """The tokenizer's special added tokens (an assistant turn must end with one)."""
    folder: Path = Path(".")
    image_token: int | None = None
    """The id ``<image>`` tokenizes to, where config.json names it the image token (a vision-language
    checkpoint); None: the checkpoint takes no images."""
    video_token: int | None = None
    """The same of ``<video>``."""
    image_text: str = IMAGE
    """What each ``<image>`` placeholder is written as before tokenizing (InternVL: framed by its
    start and end tokens); the image token in it is repeated to the image's tokens."""

    def render(self, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
        return self.template.render(messages=messages, add_generation_prompt=generation_prompt, **self.variables)

    def encode(self, messages: list[dict[str, str]], where: str,
               images: tuple[ImageRef | VideoRef, ...] = ()) -> Encoded:
        """The ids and targets of ``messages``, each ``<image>`` or ``<video>`` repeated to its image's
        or video's tokens (as the checkpoint's processor expands it); a template that fails, or that
        renders an assistant turn without its content and an end-of-turn token after it, is an error
        naming ``where``."""
        import jinja2

        messages = [{**m, "content": self._written(m["content"], images)} for m in messages]
        try:
            text = self.render(messages)
            spans = [self._span(messages, i, text, where) for i, m in enumerate(messages) if m["role"] == "assistant"]
        except jinja2.TemplateError as exc:
            raise DflopError(f"{where}: {self.name}: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        starts = np.array([a for a, _ in enc.offsets], dtype=np.int64)
        ends = np.array([b for _, b in enc.offsets], dtype=np.int64)
        targets = np.zeros(len(enc.ids), dtype=bool)
        for k, (a, b) in enumerate(spans):
            content = (starts < b) & (ends > a)
            after = np.flatnonzero(starts >= b)
            if not len(after) or enc.tokens[after[0]] not in self.specials:
                raise DflopError(f"{where}: {self.name}: assistant turn {k + 1} is not followed by an end-of-turn "
                                 "special token")
            targets |= content
            targets[after[0]] = True
        ids = np.asarray(enc.ids, dtype=np.int64)
        return self._expand(ids, targets, images, where) if images else Encoded(ids, targets)

    def _written(self, text: str, images: tuple[ImageRef | VideoRef, ...]) -> str:
        """A turn as it is tokenized: InternVL's framing of each ``<image>``, and a video whose frames
        are images of their own written as InternVL's processor writes it, frame by frame."""
        if self.image_text != IMAGE:
            text = text.replace(IMAGE, self.image_text)
        video = next((v for v in images if isinstance(v, VideoRef) and v.framed), None)
        if video is not None:
            text = text.replace(VIDEO, "\n".join(f"Frame{i + 1}: {self.image_text}" for i in range(video.tiles)))
        return text

    def _expand(self, ids: np.ndarray, targets: np.ndarray, images: tuple[ImageRef | VideoRef, ...],
                where: str) -> Encoded:
        at = np.flatnonzero((ids == self.image_token) | (ids == self.video_token))
        kinds = [self.video_token if isinstance(image, VideoRef) and not image.framed else self.image_token
                 for image in images for _ in image.slots]
        if ids[at].tolist() != kinds:
            raise DflopError(f"{where}: {self.name}: renders {len(at)} image or video token(s) where the entry has "
                             f"{len(images)} image(s) or video(s) in that order")
        if targets[at].any():
            raise DflopError(f"{where}: an <image> or <video> placeholder in an assistant turn (they are the model's "
                             "input)")
        repeat = np.ones(len(ids), dtype=np.int64)
        repeat[at] = [n for image in images for n in image.slots]
        media = np.zeros(len(ids), dtype=bool)
        media[at] = True
        return Encoded(np.repeat(ids, repeat), np.repeat(targets, repeat), np.repeat(media, repeat), images)

    def _span(self, messages: list[dict[str, str]], i: int, text: str, where: str) -> tuple[int, int]:
        """Characters of assistant message i's content in ``text`` (the whole rendering): found after
        the rendering of the turns before it with the generation prompt, so it is that turn's."""
        prefix = self.render(messages[:i], generation_prompt=True)
        upto = self.render(messages[:i + 1])
        at, content = -1, messages[i]["content"]
        if upto.startswith(prefix) and text.startswith(upto):
            for content in (content, content.strip()):  # as written (Qwen2's template), or trimmed (Llama-3's)
                if (at := upto.find(content, len(prefix))) >= 0:
                    break
        if at < 0:
            raise DflopError(f"{where}: {self.name}: the template does not render assistant message {i} after the "
                             "turns before it (dflop cannot find its tokens)")
        return at, at + len(content)


def _token(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def load_chat(folder: str | Path) -> ChatTemplate:
    """The chat template (``tokenizer_config.json``'s ``chat_template``, else ``chat_template.jinja``)
    and ``tokenizer.json`` of the checkpoint ``folder``."""
    folder = Path(folder)
    tokenizer = load_tokenizer(folder).tokenizer
    config_file, jinja_file = folder / "tokenizer_config.json", folder / "chat_template.jinja"
    config = load_json(config_file) if config_file.is_file() else {}
    source = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str) and jinja_file.is_file():
        source = jinja_file.read_text(encoding="utf-8")
    if not isinstance(source, str):
        raise DflopError(f"{folder}: no chat template (tokenizer_config.json's chat_template or chat_template.jinja)")
    variables = {k: t for k in SPECIAL if (t := _token(config.get(k))) is not None}
    specials = frozenset(t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special)
    model = load_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    model = model if isinstance(model, dict) else {}
    image_text, image = IMAGE, IMAGE
    if model.get("model_type") == "internvl":
        start, image, end = INTERNVL_IMAGE
        missing = [t for t in (start, end) if tokenizer.token_to_id(t) is None]
        if missing:
            raise DflopError(f"{folder}: tokenizer.json has no {missing[0]} token (InternVL frames an image's "
                             f"tokens with {start} and {end})")
        image_text = start + image + end
    return ChatTemplate(_compile(source, folder), tokenizer, variables, f"chat template of {folder}", specials,
                        folder, _media_token(folder, model, tokenizer, image, "image"),
                        _media_token(folder, model, tokenizer, VIDEO, "video"), image_text)


def _media_token(folder: Path, config: dict[str, Any], tokenizer: Any, text: str, kind: str) -> int | None:
    """The id of ``text`` (``<image>``), where config.json names that ``kind``'s token (a
    vision-language checkpoint) and the tokenizer agrees with it."""
    named = next((config[k] for k in (f"{kind}_token_index", f"{kind}_token_id") if k in config), None)
    if named is None:
        return None
    if tokenizer.token_to_id(text) != named:
        raise DflopError(f"{folder}: config.json's {kind} token is id {named}, but tokenizer.json gives {text} "
                         f"the id {tokenizer.token_to_id(text)}")
    return int(named)


def _compile(source: str, folder: Path) -> Any:
    """The template in the environment transformers renders chat templates in."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}`` blocks (transformers' assistant mask markers) render as their body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise DflopError(f"{folder}: chat template, line {exc.lineno}: {exc.message}") from None


def messages_of(entry: Any, parsed: Parsed, where: str) -> list[dict[str, str]]:
    """The entry's turns with their roles (a system prompt the reader put first is the system turn).
    An entry with images keeps its ``<image>`` placeholders where it wrote them; one that wrote none
    has them put before its first user turn, one per image (LLaVA's rule)."""
    if parsed.videos and (parsed.images or len(parsed.videos) > 1):
        raise DflopError(f"{where}: has several videos, or video and images: real samples hold images or one "
                         "video for now (data: {synthetic: true} trains on synthetic inputs)")
    conv = next((entry[k] for k in ("messages", "conversations", "conversation") if isinstance(entry.get(k), list)), [])
    system = len(parsed.turns) - len(conv)
    roles = ["system"] * system
    for k, turn in enumerate(conv):
        role = turn.get("role", turn.get("from")) if isinstance(turn, dict) else None
        if role not in ROLES:
            raise DflopError(f"{where}: turn {k}: role {role!r} is not one of {', '.join(ROLES)}")
        roles.append(ROLES[role])
    if system not in (0, 1) or len(roles) != len(parsed.turns):
        raise DflopError(f"{where}: its turns are not a conversation of roles dflop can render")
    contents = list(parsed.turns)
    if parsed.images or parsed.videos:
        written = [turn.get("value", turn.get("content")) for turn in conv]
        if not all(isinstance(text, str) for text in written):
            raise DflopError(f"{where}: images or video with turns that are not plain text: real samples take "
                             "LLaVA's and ShareGPT's text turns with <image> or <video> placeholders for now")
        tag, n = (VIDEO, 1) if parsed.videos else (IMAGE, len(parsed.images))
        if parsed.videos:  # LLaVA-Video writes <image> for its video
            written = [text.replace(IMAGE, VIDEO) for text in written]
        placed = sum(text.count(tag) for text in written)
        if placed == 0 and USER in roles:
            first = roles.index(USER) - system
            written[first] = (tag + "\n") * n + written[first]
        elif placed != n:
            raise DflopError(f"{where}: {placed} {tag} placeholder(s) for {n} {tag[1:-1]}(s)")
        contents[system:] = written
    return [{"role": r, "content": t} for r, t in zip(roles, contents)]


class ChatCounter(TokenCounter):
    """Counts each entry's text tokens as the checkpoint's chat template renders it (its images'
    tokens are the tiling rule's to count), keeping the encodings in reading order when asked to
    (the torch backend trains on them). ``tiling``: the encoder's, where the entries hold images."""

    def __init__(self, chat: ChatTemplate, keep: bool = False, tiling: TilingSpec | None = None) -> None:
        super().__init__(chat.tokenizer, chat.name)
        self.chat, self.tiling = chat, tiling
        self.encoded: list[Encoded] | None = [] if keep else None
        self._rule: ImageRule | None = None

    def entry(self, entry: Any, parsed: Parsed, where: str, images: list[tuple[Path, tuple[int, int]]] = (),
              videos: list[tuple[Path, tuple[int, float, int, float]]] = ()) -> Any:
        messages = messages_of(entry, parsed, where)
        if images:
            return where, messages, image_refs(list(images), self.rule(where))
        return where, messages, tuple(video_ref(path, header, self.rule(where), where) for path, header in videos)

    def fed_frames(self, prepared: Any) -> list[int] | None:
        return [ref.tiles for ref in prepared[2] if isinstance(ref, VideoRef)] or None

    def rule(self, where: str) -> ImageRule:
        if self.chat.image_token is None or self.tiling is None:
            raise DflopError(f"{where}: has images or video, but {self.chat.folder} is not a vision-language "
                             "checkpoint (its config.json names no image token)")
        if self._rule is None:
            self._rule = load_image_rule(self.chat.folder, self.tiling)
        return self._rule

    def count(self, entries: list[Any]) -> list[int]:
        out = []
        for where, messages, images in entries:
            encoded = self.chat.encode(messages, where, images)
            if self.encoded is not None:
                self.encoded.append(encoded)
            out.append(int(encoded.text.sum()))
        return out


EPOCH = re.compile(r"e\d+:")
"""The prefix global batches put before a sample's id (``data_profile.batches``)."""


def encode_dataset(path: str | Path, encoder: EncoderSpec, chat: ChatTemplate,
                   batches: Sequence[SampleTable]) -> list[dict[str, Encoded]]:
    """Each batch's samples of the dataset ``path`` as ``chat`` renders and tokenizes them, by id:
    read as the data profiler reads it (same ids, same counts)."""
    return by_step(encode_samples(path, encoder, chat), batches, path)


def encode_samples(path: str | Path, encoder: EncoderSpec, chat: ChatTemplate) -> dict[str, Encoded]:
    """Every sample of the dataset ``path`` as ``chat`` renders and tokenizes it, by id, read as the
    data profiler reads it (same ids; its tiles and tokens checked against the profile's)."""
    tokens = ChatCounter(chat, keep=True, tiling=encoder.tiling)
    table = read_manifest(path, encoder, tokenizer=tokens).samples
    assert tokens.encoded is not None and len(tokens.encoded) == len(table)
    for i, encoded in enumerate(tokens.encoded):  # the profile's rule and the processor's tiles: one count
        if (sum(im.tiles for im in encoded.images), int(encoded.media.sum()) if encoded.images else 0) \
                != (table.tiles[i], table.image_tokens[i]):
            raise DflopError(f"{path}: sample {table.ids[i]!r}: its images' tiles and tokens differ from the data "
                             "profile's (a preference pair: not trained on real samples yet)")
    return dict(zip((str(i) for i in table.ids), tokens.encoded))


def by_step(by_id: dict[str, Encoded], batches: Sequence[SampleTable], path: str | Path) -> list[dict[str, Encoded]]:
    """Each batch's samples (ids as global batches write them: ``e<epoch>:<id>``) from the samples of
    the dataset ``path`` by id, each with the tiles and tokens its batch gives it (else the steps were
    scheduled for other data: a one-line error, before any rank is fed what was not planned)."""
    out = []
    for batch in batches:
        step = {}
        for i, sample_id in enumerate(map(str, batch.ids)):
            key = sample_id[m.end():] if (m := EPOCH.match(sample_id)) else sample_id
            if key not in by_id:
                raise DflopError(f"{path}: has no sample {key!r} (the run's data is not this dataset)")
            got = by_id[key]
            shape = (sum(im.tiles for im in got.images), int((~got.text).sum()), int(got.text.sum()))
            if shape != (batch.tiles[i], batch.image_tokens[i], batch.text_tokens[i]):
                raise DflopError(f"{path}: sample {key!r} has {shape[0]} tiles, {shape[1]} image and {shape[2]} text "
                                 "tokens now, not what the run's steps were scheduled for (the dataset changed?)")
            step[sample_id] = got
        out.append(step)
    return out
