"""Frozen dataclass specs to and from plain mappings (YAML/JSON).

One generic converter serves every spec so that every spec reports bad input
the same way: ``<file>: <key.path>: <what is wrong>`` on one line.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import functools
import json
import math
import os
import reprlib
import stat
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar, Union, get_args, get_origin

import yaml

from dflop.errors import SpecError
from dflop.specs.limits import MAX_DEPTH, MAX_FILE_BYTES, MAX_FLOAT, MAX_INT

T = TypeVar("T")

Resolve = Callable[[type, Any, str], Any]
"""``resolve(cls, value, where)``: the spec of type ``cls`` that a plain value (not a mapping) names, or
None where ``cls`` takes no names. Given by the loader's caller (``dflop.specs.resolve.named_spec``), so
that the spec modules and this one know no preset and no config file."""


def require(condition: bool, message: str) -> None:
    """Raise SpecError(message) unless condition holds (used in __post_init__)."""
    if not condition:
        raise SpecError(message)


def read_regular(path: Path, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of the regular file ``path``. A device (/dev/zero never ends), a FIFO (it blocks
    until someone writes) or a file over ``limit`` bytes would hang or exhaust memory: each is a
    ValueError saying so; the rest are the OSErrors of reading (FileNotFoundError, ...)."""
    info = path.stat()
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if not stat.S_ISREG(info.st_mode):
        raise ValueError("not a regular file (a device, pipe or socket)")
    too_big = ValueError(f"larger than {limit} bytes, the most dflop reads from one file")
    if info.st_size > limit:
        raise too_big
    data = path.read_bytes()
    if len(data) > limit:  # it grew while read
        raise too_big
    return data


def read_text(path: str | Path) -> str:
    """The text of an input file, decoded as UTF-8 (a byte-order mark is dropped); every failure is
    a SpecError naming the file, and for bytes that are not UTF-8 the line too."""
    p = Path(path)
    try:
        data = read_regular(p)
    except FileNotFoundError:
        raise SpecError(f"{p}: file not found") from None
    except IsADirectoryError:
        raise SpecError(f"{p}: is a folder, expected a file") from None
    except OSError as exc:
        raise SpecError(f"{p}: cannot read ({exc.strerror})") from None
    except ValueError as exc:
        raise SpecError(f"{p}: {exc}") from None
    return decode(data, str(p))


def decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise SpecError(f"{where}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x})") from None


def too_many_digits(exc: ValueError) -> str:
    """The problem of an integer too long for Python to convert, without its advice to the programmer."""
    return str(exc).split(";")[0]


class _Loader(yaml.SafeLoader):
    """Safe YAML that bounds nesting and refuses a key given twice in one mapping (YAML would keep
    the last silently)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: the constructor reports it
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}' (first given on line {first + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def parse_yaml(text: str, where: str) -> Any:
    """Parse YAML (or JSON) text; a problem names ``where`` and the line."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f"{where}:{mark.line + 1}" if mark is not None else where
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(f"{line}: not valid YAML ({problem})") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise SpecError(f"{where}: not valid YAML ({too_many_digits(exc)})") from None


def load_yaml(path: str | Path) -> Any:
    """Parse a YAML (or JSON) file; a problem names the file and line."""
    return parse_yaml(read_text(path), str(path))


_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')


def _too_deep(text: str) -> bool:
    """Whether JSON ``text`` nests deeper than MAX_DEPTH, found at C speed before the parser
    recurses: escapes and string contents dropped, every bracket made ``[]``, then the innermost
    pairs peeled away one level a pass."""
    data = text.encode("utf-8", "surrogatepass")
    if b"\\" in data:
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    # Dropping two adjacent quotes keeps, for every bracket, the parity of the quotes before it
    # (odd: inside a string), so most strings go at once and few pieces are left to split.
    skeleton = data.translate(_BRACKETS, _NOT_STRUCTURE).replace(b'""', b"")
    if b'"' in skeleton:
        skeleton = b"".join(skeleton.split(b'"')[::2])
    for _ in range(MAX_DEPTH):
        peeled = skeleton.replace(b"[]", b"")
        if not peeled or len(peeled) == len(skeleton):
            return False  # balanced within the bound, or not JSON (the parser says why)
        skeleton = peeled
    return True


class NotJson(SpecError):
    """Text that is not valid JSON; ``problem`` says why, without the location."""

    def __init__(self, where: str, problem: str, line: int | None = None) -> None:
        self.problem = problem
        super().__init__(f"{where}{'' if line is None else f':{line}'}: not valid JSON ({problem})")


def parse_json(text: str, where: str) -> Any:
    """Parse JSON text; a problem raises NotJson naming ``where`` and the line."""
    if _too_deep(text):
        raise NotJson(where, f"nested deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise NotJson(where, exc.msg, exc.lineno) from None
    except RecursionError:  # unbalanced brackets the depth check could not pair up
        raise NotJson(where, f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise NotJson(where, too_many_digits(exc)) from None


def load_json(path: str | Path) -> Any:
    return parse_json(read_text(path), str(path))


def save_json(path: str | Path, data: Any) -> Path:
    """Whole or not at all: a reader (or a resume after a crash) sees the previous file or the new
    one, never half of it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
    return path


def child(where: str, key: Any) -> str:
    """Extend an error location: ``"cfg.yaml:"`` + ``llm`` -> ``"cfg.yaml: llm"``."""
    return f"{where} {key}" if where.endswith(":") else f"{where}.{key}"


def at(where: str) -> str:
    return where[:-1] if where.endswith(":") else where


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def shown(value: Any) -> str:
    """A value as an error message quotes it: its repr, shortened, so the message stays short."""
    short = reprlib.Repr()
    short.maxstring, short.maxother, short.maxlevel = 60, 60, 3
    return short.repr(value)


def limit(low: float | None = None, high: float | None = None) -> dict[str, Any]:
    """Field metadata bounding a number beyond the checks every number gets:
    ``samples: int = field(default=100, metadata=limit(1, MAX_SAMPLES))``."""
    return {"low": low, "high": high}


def number_problem(value: Any, bounds: Any = None) -> str | None:
    """What is wrong with a number in a spec (None when nothing): every number is finite and at most
    MAX_INT (integers) or MAX_FLOAT (reals) in magnitude, and within ``bounds`` (a field's
    metadata, see :func:`limit`); lists and mappings are checked item by item."""
    if isinstance(value, (tuple, list, dict)):
        items = value.values() if isinstance(value, dict) else value
        return next((p for p in map(number_problem, items) if p), None)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value}"
    bounds = bounds or {}
    largest = MAX_INT if isinstance(value, int) else MAX_FLOAT
    low, high = bounds.get("low"), bounds.get("high")
    low = -largest if low is None else max(low, -largest)
    high = largest if high is None else min(high, largest)
    if value < low:
        return f"must be at least {_show(low)}, got {_show(value)}"
    if value > high:
        return f"must be at most {_show(high)}, got {_show(value)}"
    return None


def _show(number: float) -> str:
    if isinstance(number, int) or (number.is_integer() and abs(number) < 1e16):
        return shown(int(number))
    return f"{number:g}"


def check_numbers(spec: Any) -> None:
    """Raise SpecError naming the field unless every number of ``spec`` passes
    :func:`number_problem`; every spec calls this first in ``__post_init__``."""
    for name, bounds in _fields(type(spec)):
        value = getattr(spec, name)
        if type(value) is int and not bounds and -MAX_INT <= value <= MAX_INT:  # the common case, at once:
            continue  # the search builds specs by the hundred thousand
        problem = number_problem(value, bounds)
        if problem:
            raise SpecError(f"{name}: {problem}")


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, Any], ...]:
    return tuple((f.name, f.metadata) for f in dataclasses.fields(cls))


def convert(tp: Any, value: Any, where: str, resolve: Resolve | None = None) -> Any:
    """Convert a plain value to type ``tp``; errors name ``where``; ``resolve`` reads names of specs."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return convert(option, value, where, resolve)
            except SpecError as exc:
                errors.append(str(exc))
        raise SpecError(errors[0])
    if origin is Literal:
        allowed = get_args(tp)
        if not any(value == a and type(value) is type(a) for a in allowed):  # true is not 1
            raise SpecError(f"{at(where)}: {shown(value)} is not one of {', '.join(map(repr, allowed))}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(f"{at(where)}: expected true or false, got {_type_name(value)} {shown(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise SpecError(f"{at(where)}: expected an integer, got {_type_name(value)} {shown(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if isinstance(value, str):
                try:
                    return float(value)  # YAML reads 1e9 (no dot) as a string
                except ValueError:
                    pass
            raise SpecError(f"{at(where)}: expected a number, got {_type_name(value)} {shown(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(f"{at(where)}: expected a string, got {_type_name(value)} {shown(value)}")
        return value
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise SpecError(f"{at(where)}: expected a list, got {_type_name(value)} {shown(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(convert(args[0], v, f"{where}[{i}]", resolve) for i, v in enumerate(value))
        if len(value) != len(args):
            raise SpecError(f"{at(where)}: expected {len(args)} items, got {len(value)}")
        return tuple(convert(a, v, f"{where}[{i}]", resolve) for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        key_t, val_t = get_args(tp)
        if not isinstance(value, dict):
            raise SpecError(f"{at(where)}: expected a mapping, got {_type_name(value)}")
        return {convert(key_t, k, where, resolve): convert(val_t, v, child(where, k), resolve) for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in tp)
            raise SpecError(f"{at(where)}: {shown(value)} is not one of {allowed}") from None
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict) and resolve is not None:
            named = resolve(tp, value, where)
            if named is not None:
                return named
        return from_mapping(tp, value, where, resolve)
    raise TypeError(f"unsupported spec field type {tp!r}")


def from_mapping(cls: type[T], data: Any, where: str, resolve: Resolve | None = None) -> T:
    """Build the frozen dataclass ``cls`` from a mapping, validating every key; ``resolve`` reads the
    nested specs given by name (without it every spec is a mapping)."""
    if not isinstance(data, dict):
        raise SpecError(f"{at(where)}: expected a mapping, got {_type_name(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise SpecError(f"{at(where)}: unknown key '{unknown[0]}' (valid keys: {', '.join(fields)})")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, field in fields.items():
        if name not in data:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise SpecError(f"{at(where)}: missing key '{name}'")
            continue
        kwargs[name] = convert(hints[name], data[name], child(where, name), resolve)
        problem = number_problem(kwargs[name], field.metadata)
        if problem:
            raise SpecError(f"{at(child(where, name))}: {problem}")
    try:
        return cls(**kwargs)
    except SpecError as exc:
        raise SpecError(f"{at(where)}: {exc}") from None


def to_mapping(obj: Any) -> Any:
    """Plain (YAML/JSON-ready) form of a spec; the inverse of :func:`from_mapping`."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_mapping(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_mapping(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_mapping(v) for k, v in obj.items()}
    return obj


def first_difference(old: Any, new: Any, path: str) -> tuple[str, Any, Any] | None:
    """The first field (dotted path) where two plain records differ, with both values: what an
    error names when a saved record and the current one disagree."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in list(old) + [k for k in new if k not in old]:
            if found := first_difference(old.get(key), new.get(key), f"{path}.{key}"):
                return found
        return None
    return None if old == new else (path, old, new)


def load_spec(cls: type[T], path: str | Path, key: str | None = None, resolve: Resolve | None = None) -> T:
    """Load a spec from a YAML file (optionally from one top-level key); ``resolve`` as in from_mapping."""
    data = load_yaml(path)
    where = f"{path}:"
    if key is not None:
        if not isinstance(data, dict) or key not in data:
            raise SpecError(f"{path}: missing key '{key}'")
        data, where = data[key], child(where, key)
    return from_mapping(cls, data, where, resolve)


def save_spec(obj: Any, path: str | Path) -> Path:
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(yaml.safe_dump(to_mapping(obj), sort_keys=False))
    except OSError as exc:
        raise SpecError(f"{p}: cannot write ({exc.strerror})") from None
    return p
