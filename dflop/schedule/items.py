"""Reading items for `dflop schedule`: ``{"items": [{"id": ..., "cost": [c_enc, c_llm, ...]}, ...]}``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflop.errors import DflopError
from dflop.specs.loading import load_json


def read_items(path: str | Path) -> tuple[list[str], np.ndarray]:
    data = load_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("items"), list):
        raise DflopError(f"{path}: expected an object with an 'items' list")
    ids, costs = [], []
    width = None
    for i, item in enumerate(data["items"]):
        where = f"{path}: items[{i}]"
        if not isinstance(item, dict) or "cost" not in item:
            raise DflopError(f"{where}: expected an object with 'id' and 'cost'")
        cost = item["cost"]
        if isinstance(cost, (int, float)) and not isinstance(cost, bool):
            cost = [cost]
        if (not isinstance(cost, list) or not cost
                or not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in cost)):
            raise DflopError(f"{where}: field 'cost': expected a number or a list of numbers, got {cost!r}")
        if width is not None and len(cost) != width:
            raise DflopError(f"{where}: field 'cost': {len(cost)} dimensions, earlier items have {width}")
        if any(c < 0 or c != c or c in (float("inf"), float("-inf")) for c in cost):
            raise DflopError(f"{where}: field 'cost': costs must be finite and >= 0")
        width = len(cost)
        ids.append(str(item.get("id", i)))
        costs.append(cost)
    if not costs:
        raise DflopError(f"{path}: no items")
    if len(set(ids)) != len(ids):
        raise DflopError(f"{path}: item ids must be unique")
    return ids, np.array(costs, dtype=float)
