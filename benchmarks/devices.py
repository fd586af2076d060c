"""The `--device` choice of the single-process kernel benchmarks: CUDA when present, unless told."""

from __future__ import annotations

from argparse import ArgumentParser

from engine.errors import UserError


def add_device_argument(parser: ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")


def chosen_device(requested: str | None) -> str:
    """The device to time on; asking for CUDA where there is none is the caller's error, not a CPU run."""
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU here; leave --device out or pass --device cpu")
    return requested or ("cuda" if torch.cuda.is_available() else "cpu")
