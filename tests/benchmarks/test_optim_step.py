"""benchmarks.optim_step on the CPU: both optimizers timed on the same tensors, one JSON line."""

from __future__ import annotations

import json

import pytest

from benchmarks import optim_step
from engine import errors


def test_reports_each_optimizers_step_and_their_ratio(capsys: object) -> None:
    assert optim_step.main(["--tensors", "3", "--numel", "96", "--steps", "2", "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)  # type: ignore[attr-defined]
    assert result["tensors"] == 3 and result["device"] == "cpu"
    for name in ("torchao", "compiled"):
        assert result[name]["ms_per_step"] > 0 and result[name]["first_step_s"] >= 0
    assert result["speedup"] == round(result["torchao"]["ms_per_step"] / result["compiled"]["ms_per_step"], 2)


@pytest.mark.parametrize("argv", [["--tensors", "0"], ["--steps", "-1"]])
def test_refuses_empty_counts(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert errors.boundary(optim_step.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "give each >= 1" in err and len(err.strip().splitlines()) == 1
