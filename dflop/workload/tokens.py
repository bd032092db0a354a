"""Text tokens of a sample: counted with a local tokenizer, or estimated.

Without a tokenizer the count is ceil(characters / 4) per turn: about four
characters per token is the usual figure for English with BPE vocabularies of
the Qwen2 / Llama-3 size. Either way every turn adds 5 tokens of chat
template (``<|im_start|>role\\n ... <|im_end|>\\n``).

``--tokenizer`` takes a ``tokenizer.json`` (or the checkpoint folder holding
one) and counts with the ``tokenizers`` library, the fast tokenizers of
transformers, without special tokens (the template stands for them); it never
downloads anything.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from dflop.errors import DflopError

CHARS_PER_TOKEN = 4.0
TEMPLATE_TOKENS_PER_TURN = 5


def estimate_text_tokens(turns: list[str]) -> int:
    """The documented estimate used when no tokenizer is given."""
    total = TEMPLATE_TOKENS_PER_TURN * len(turns)
    for t in turns:
        total += math.ceil(len(t) / CHARS_PER_TOKEN)
    return total


class TokenCounter:
    """Counts the text tokens of many entries at once (a fast tokenizer encodes in batches)."""

    def __init__(self, tokenizer: Any = None, name: str = "estimate") -> None:
        self.tokenizer, self.name = tokenizer, name

    @property
    def batched(self) -> bool:
        return self.tokenizer is not None

    def entry(self, entry: Any, parsed: Any, where: str, images: list[tuple[Path, tuple[int, int]]] = (),
              videos: list[tuple[Path, tuple[int, float, int, float]]] = ()) -> Any:
        """What :meth:`count` takes of one manifest entry (its turns; a chat counter: its messages,
        ``images``, each file with its (width, height), and ``videos``, each with what the manifest and
        the container header say of its length)."""
        return parsed.turns

    def fed_frames(self, prepared: Any) -> list[int] | None:
        """The frames each video of an entry (its :meth:`entry`) is fed, where this counter decides
        them (real videos: the frames the run decodes); None: the reader's rule counts them."""
        return None

    def count(self, entries: list[list[str]]) -> list[int]:
        if self.tokenizer is None:
            return [estimate_text_tokens(turns) for turns in entries]
        flat = [t for turns in entries for t in turns]
        lengths = iter(self._lengths(flat))
        return [sum(next(lengths) for _ in turns) + TEMPLATE_TOKENS_PER_TURN * len(turns) for turns in entries]

    def _lengths(self, texts: list[str]) -> list[int]:
        tok = self.tokenizer
        if hasattr(tok, "encode_batch"):
            return [len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False)]
        encode: Callable[[str], Any] = tok.encode if hasattr(tok, "encode") else tok
        out = []
        for text in texts:
            result = encode(text)
            out.append(result if isinstance(result, int) else len(result))
        return out


def load_tokenizer(path: str | Path) -> TokenCounter:
    """A counter with the ``tokenizer.json`` at ``path`` (or inside the folder ``path``)."""
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise DflopError(f"{file}: tokenizer not found (give a tokenizer.json or the folder holding one)")
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # noqa: BLE001 - the Rust library reports every problem as one type
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DflopError(f"{file}: not a tokenizers tokenizer.json ({message})") from None
    return TokenCounter(tokenizer, f"tokenizer {file}")


def counter(tokenizer: Any) -> TokenCounter:
    """A TokenCounter from what a caller has: nothing, a path, a counter, or anything with
    ``encode`` (or a function) that gives token ids or a count per text."""
    if tokenizer is None:
        return TokenCounter()
    if isinstance(tokenizer, TokenCounter):
        return tokenizer
    if isinstance(tokenizer, (str, Path)):
        return load_tokenizer(tokenizer)
    return TokenCounter(tokenizer, f"tokenizer {type(tokenizer).__name__}")
