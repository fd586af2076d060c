"""benchmarks.logprobs_kernels on the CPU: both kernels timed on the same logits, one JSON line, the
compiled log-probs and gradients those of the chunked ones."""

from __future__ import annotations

import json

import pytest

from benchmarks import logprobs_kernels


def test_both_kernels_are_timed_and_agree(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.recipes.levers import LOGPROBS_ENV

    monkeypatch.setenv(LOGPROBS_ENV, "chunked")  # restored after the benchmark sets it
    argv = ["--rows", "37", "--vocab", "1000", "--repeats", "2", "--device", "cpu"]
    assert logprobs_kernels.main(argv) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["chunked"]["ms"] > 0 and row["compiled"]["ms"] > 0 and row["speedup"] > 0
    assert row["max_abs_logprob_diff"] < 1e-4 and row["max_abs_grad_diff"] < 1e-2  # bf16 gradients


def test_counts_must_be_positive() -> None:
    from engine.errors import UserError

    with pytest.raises(UserError, match="counts"):
        logprobs_kernels.main(["--rows", "0", "--device", "cpu"])
