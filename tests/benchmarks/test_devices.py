"""The kernel benchmarks' `--device`: CUDA when present; asking for an absent GPU is refused."""

from __future__ import annotations

import pytest
import torch

from benchmarks.devices import chosen_device
from engine.errors import UserError


def test_the_default_is_the_gpu_when_there_is_one() -> None:
    assert chosen_device(None) == ("cuda" if torch.cuda.is_available() else "cpu")
    assert chosen_device("cpu") == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_cuda_asked_for_where_there_is_none_is_refused() -> None:
    with pytest.raises(UserError, match="--device cuda: no CUDA GPU here"):
        chosen_device("cuda")
