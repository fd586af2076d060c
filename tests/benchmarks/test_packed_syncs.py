"""benchmarks.packed_syncs where it cannot run: one error line and exit 2 (it measures fla on a GPU)."""

from __future__ import annotations

import pytest

from benchmarks import packed_syncs


def test_refuses_a_machine_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert packed_syncs.main([]) == 2
    assert capsys.readouterr().err.startswith("error: benchmarks.packed_syncs needs a CUDA GPU")
