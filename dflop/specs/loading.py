"""Frozen dataclass specs to and from plain mappings (YAML/JSON).

One generic converter serves every spec so that every spec reports bad input
the same way: ``<file>: <key.path>: <what is wrong>`` on one line.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

from dflop.errors import SpecError

T = TypeVar("T")


def require(condition: bool, message: str) -> None:
    """Raise SpecError(message) unless condition holds (used in __post_init__)."""
    if not condition:
        raise SpecError(message)


def read_text(path: str | Path) -> str:
    p = Path(path)
    try:
        return p.read_text()
    except FileNotFoundError:
        raise SpecError(f"{p}: file not found") from None
    except IsADirectoryError:
        raise SpecError(f"{p}: is a directory, expected a file") from None
    except OSError as exc:
        raise SpecError(f"{p}: cannot read ({exc.strerror})") from None


def load_yaml(path: str | Path) -> Any:
    """Parse a YAML (or JSON) file; a syntax error names the file and line."""
    text = read_text(path)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(f"{at(where)}: not valid YAML ({problem})") from None


def load_json(path: str | Path) -> Any:
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None


def child(where: str, key: Any) -> str:
    """Extend an error location: ``"cfg.yaml:"`` + ``llm`` -> ``"cfg.yaml: llm"``."""
    return f"{where} {key}" if where.endswith(":") else f"{where}.{key}"


def at(where: str) -> str:
    return where[:-1] if where.endswith(":") else where


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def convert(tp: Any, value: Any, where: str) -> Any:
    """Convert a plain value to type ``tp``; errors name ``where``."""
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
                return convert(option, value, where)
            except SpecError as exc:
                errors.append(str(exc))
        raise SpecError(errors[0])
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise SpecError(f"{at(where)}: {value!r} is not one of {', '.join(map(repr, allowed))}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(f"{at(where)}: expected true or false, got {_type_name(value)} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise SpecError(f"{at(where)}: expected an integer, got {_type_name(value)} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if isinstance(value, str):
                try:
                    return float(value)  # YAML reads 1e9 (no dot) as a string
                except ValueError:
                    pass
            raise SpecError(f"{at(where)}: expected a number, got {_type_name(value)} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(f"{at(where)}: expected a string, got {_type_name(value)} {value!r}")
        return value
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise SpecError(f"{at(where)}: expected a list, got {_type_name(value)} {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise SpecError(f"{at(where)}: expected {len(args)} items, got {len(value)}")
        return tuple(convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        key_t, val_t = get_args(tp)
        if not isinstance(value, dict):
            raise SpecError(f"{at(where)}: expected a mapping, got {_type_name(value)}")
        return {convert(key_t, k, where): convert(val_t, v, child(where, k)) for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in tp)
            raise SpecError(f"{at(where)}: {value!r} is not one of {allowed}") from None
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict) and hasattr(tp, "coerce"):
            return tp.coerce(value, where)
        return from_mapping(tp, value, where)
    raise TypeError(f"unsupported spec field type {tp!r}")


def from_mapping(cls: type[T], data: Any, where: str) -> T:
    """Build the frozen dataclass ``cls`` from a mapping, validating every key."""
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
        kwargs[name] = convert(hints[name], data[name], child(where, name))
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


def load_spec(cls: type[T], path: str | Path, key: str | None = None) -> T:
    """Load a spec from a YAML file (optionally from one top-level key)."""
    data = load_yaml(path)
    where = f"{path}:"
    if key is not None:
        if not isinstance(data, dict) or key not in data:
            raise SpecError(f"{path}: missing key '{key}'")
        data, where = data[key], child(where, key)
    return from_mapping(cls, data, where)


def save_spec(obj: Any, path: str | Path) -> Path:
    p = Path(path)
    p.write_text(yaml.safe_dump(to_mapping(obj), sort_keys=False))
    return p
