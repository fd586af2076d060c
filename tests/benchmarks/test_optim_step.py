"""benchmarks.optim_step on the CPU: both optimizers timed on the same tensors, one JSON line."""

from __future__ import annotations

import json

from benchmarks import optim_step


def test_reports_each_optimizers_step_and_their_ratio(capsys: object) -> None:
    assert optim_step.main(["--tensors", "3", "--numel", "96", "--steps", "2", "--device", "cpu"]) == 0
    result = json.loads(capsys.readouterr().out)  # type: ignore[attr-defined]
    assert result["tensors"] == 3 and result["device"] == "cpu"
    for name in ("torchao", "compiled"):
        assert result[name]["ms_per_step"] > 0 and result[name]["first_step_s"] >= 0
    assert result["speedup"] == round(result["torchao"]["ms_per_step"] / result["compiled"]["ms_per_step"], 2)
