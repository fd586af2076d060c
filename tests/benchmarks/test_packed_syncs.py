"""benchmarks.packed_syncs where it cannot run: one error line and exit 2 (it measures fla on a GPU)."""

from __future__ import annotations

import pytest

from benchmarks import packed_syncs
from engine import errors


@pytest.mark.parametrize(
    "argv,says",
    [([], "needs a CUDA GPU"), (["--seqs", "0"], "give each >= 1"), (["--length", "x"], "invalid int")],
)
def test_refuses_what_it_cannot_measure(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert errors.boundary(packed_syncs.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and len(err.strip().splitlines()) == 1
