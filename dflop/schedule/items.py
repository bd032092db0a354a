"""Reading items for `dflop schedule`: ``{"items": [{"id": ..., "cost": [c_enc, c_llm, ...]}, ...]}``.

Ids come back exactly as they were given (a string, a number or a boolean, JSON
types kept: ``1``, ``"1"`` and ``true`` are three different ids); an item
without one is named by its position. Duplicate ids are an error naming them,
since a schedule is applied by id. Costs are checked for shape and type here;
their values (finite, non-negative, representable sums) by PartitionProblem,
the one place every entry point shares.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from dflop.errors import DflopError
from dflop.specs.loading import load_json

SHOWN = 5
"""Duplicate ids named in the error, at most."""


def _id(item: dict[str, Any], index: int, where: str) -> Any:
    if "id" not in item:
        return index
    key = item["id"]
    if isinstance(key, float) and not math.isfinite(key):
        raise DflopError(f"{where}: field 'id': {key!r} is not a usable id")
    if not isinstance(key, (str, int, float, bool)):
        raise DflopError(f"{where}: field 'id': expected a string, a number or a boolean, got {json.dumps(key)}")
    return key


def _cost(item: dict[str, Any], where: str) -> list[float]:
    cost = item["cost"]
    if isinstance(cost, (int, float)) and not isinstance(cost, bool):
        cost = [cost]
    if (not isinstance(cost, list) or not cost
            or not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in cost)):
        raise DflopError(f"{where}: field 'cost': expected a number or a list of numbers, got {json.dumps(cost)}")
    try:
        return [float(c) for c in cost]
    except OverflowError:
        raise DflopError(f"{where}: field 'cost': a number beyond the float range; rescale the costs") from None


def _check_unique(path: str | Path, ids: list[Any]) -> None:
    """Ids compare as JSON writes them, so 1, 1.0, true and "1" stay apart."""
    places: dict[str, list[int]] = {}
    for i, key in enumerate(ids):
        places.setdefault(json.dumps(key), []).append(i)
    repeated = [(key, where) for key, where in places.items() if len(where) > 1]
    if repeated:
        shown = "; ".join(f"{key} (items {', '.join(map(str, where))})" for key, where in repeated[:SHOWN])
        more = f"; and {len(repeated) - SHOWN} more" if len(repeated) > SHOWN else ""
        raise DflopError(f"{path}: duplicate item ids: {shown}{more}")


def read_items(path: str | Path) -> tuple[list[Any], np.ndarray]:
    """(ids as given, costs (items, dimensions))."""
    data = load_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("items"), list):
        raise DflopError(f"{path}: expected an object with an 'items' list")
    ids, costs = [], []
    for i, item in enumerate(data["items"]):
        where = f"{path}: items[{i}]"
        if not isinstance(item, dict) or "cost" not in item:
            raise DflopError(f"{where}: expected an object with 'id' and 'cost'")
        cost = _cost(item, where)
        if costs and len(cost) != len(costs[0]):
            raise DflopError(f"{where}: field 'cost': {len(cost)} dimensions, earlier items have {len(costs[0])}")
        ids.append(_id(item, i, where))
        costs.append(cost)
    if not costs:
        raise DflopError(f"{path}: no items")
    _check_unique(path, ids)
    return ids, np.array(costs, dtype=float)
