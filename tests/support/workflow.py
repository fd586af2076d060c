"""A scratch copy of the Snakemake workflow for tests that run Snakemake."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.conftest import ROOT


def workflow_copy(tmp_path: Path) -> Path:
    """The Snakefile, workflow/, recipes/ and profiles/ under tmp_path/wf: Snakemake reads and writes
    results/ and .snakemake/ there, never in the checkout, whatever a user (or another test) left in it."""
    work = tmp_path / "wf"
    work.mkdir()
    for name in ("Snakefile", "workflow", "recipes", "profiles"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, work / name)
    return work
