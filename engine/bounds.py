"""Measured numbers against their bounds, in one place: NaN and infinity fail every check.

Every comparison with NaN is false, so `value > limit` never trips on a NaN and `value >= floor` lets
+inf through. Export verification, the run gates, smoke-report and rerun ask here instead of comparing
themselves, so a non-finite figure (or a non-finite bound) can only ever fail.
"""

from __future__ import annotations

import argparse
import math
from typing import Any


def finite(value: Any) -> float | None:
    """The value as a float when it is a finite real number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def at_most(value: Any, limit: float) -> bool:
    """value <= limit, both finite."""
    v, bound = finite(value), finite(limit)
    return v is not None and bound is not None and v <= bound


def at_least(value: Any, floor: float) -> bool:
    """value >= floor, both finite."""
    v, bound = finite(value), finite(floor)
    return v is not None and bound is not None and v >= bound


def above(value: Any, floor: float) -> bool:
    """value > floor, both finite."""
    v, bound = finite(value), finite(floor)
    return v is not None and bound is not None and v > bound


def close(a: Any, b: Any, rtol: float, atol: float) -> bool:
    """|a - b| <= atol + rtol * max(|a|, |b|), all finite."""
    x, y = finite(a), finite(b)
    return x is not None and y is not None and at_most(abs(x - y), atol + rtol * max(abs(x), abs(y)))


def finite_float(text: str) -> float:
    """argparse type of a bound given on the command line: `nan` or `inf` would turn its check off."""
    try:
        number = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r} (a bound must be finite)")
    return number
