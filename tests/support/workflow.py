"""A scratch copy of the Snakemake workflow for tests that run Snakemake."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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


SNAKEMAKE = Path(sys.executable).parent / "snakemake"


def snakemake_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a workflow test runs Snakemake in: this checkout's engine on PYTHONPATH."""
    return os.environ | {"PYTHONPATH": str(ROOT)} | (extra or {})


def snakemake(
    work: Path, *args: str, timeout: int = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Snakemake of this venv in the scratch copy `work`, output captured; `env` adds to snakemake_env."""
    argv, env = [str(SNAKEMAKE), *args], snakemake_env(env)
    return subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
