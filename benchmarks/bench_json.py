"""The one JSON line every `scripts/bench_*.py` prints: numpy values, tuples and paths made JSON-safe."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np


def json_safe(value):
    """`value` with numpy arrays and scalars as Python lists and numbers, tuples as lists, paths as strings and
    non-finite floats as None (strict JSON has no NaN or Infinity)."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, np.ndarray):
        return json_safe(value.tolist())
    if isinstance(value, np.generic):
        return json_safe(value.item())
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def json_line(result: dict) -> str:
    """`result` as one strict JSON line (raises TypeError on a value json_safe cannot convert)."""
    return json.dumps(json_safe(result), allow_nan=False)
