"""engine/bounds.py: the one place measured numbers meet their bounds; NaN and infinity never pass."""

from __future__ import annotations

import argparse
import math

import pytest

from engine import bounds

BAD = [math.nan, math.inf, -math.inf, None, "0.1", True]


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_a_value_that_is_not_a_finite_number_fails_every_check(bad: object) -> None:
    assert bounds.finite(bad) is None
    assert not bounds.at_most(bad, 1.0) and not bounds.at_least(bad, -1.0) and not bounds.above(bad, -1.0)
    assert not bounds.close(bad, 0.5, rtol=1.0, atol=1.0) and not bounds.close(0.5, bad, rtol=1.0, atol=1.0)


@pytest.mark.parametrize("bound", [math.nan, math.inf, -math.inf], ids=repr)
def test_a_bound_that_is_not_finite_passes_nothing(bound: float) -> None:
    assert not bounds.at_most(0.5, bound) and not bounds.at_least(0.5, bound) and not bounds.above(0.5, bound)
    assert not bounds.close(0.5, 0.5, rtol=bound, atol=0.0) and not bounds.close(0.5, 0.5, 0.0, bound)


def test_finite_numbers_compare_as_usual() -> None:
    assert bounds.finite(3) == 3.0 and bounds.at_most(1e-4, 1e-4) and not bounds.at_most(2e-4, 1e-4)
    assert bounds.at_least(0.99, 0.99) and not bounds.above(0.0, 0.0) and bounds.above(1e-12, 0.0)
    assert bounds.close(1.0, 1.0005, rtol=1e-3, atol=0.0) and not bounds.close(1.0, 1.01, 1e-3, 0.0)


def test_bounds_on_the_command_line_must_be_finite() -> None:
    assert bounds.finite_float("0.01") == 0.01
    for text in ("nan", "inf", "-inf", "tight"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"invalid float value: '{text}'"):
            bounds.finite_float(text)
