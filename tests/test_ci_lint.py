"""GitHub Actions workflows (.github/workflows/) pass actionlint (with shellcheck on `run:` scripts), with the
configuration actionlint finds by itself (.github/actionlint.yaml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

BIN = Path(sys.executable).parent
WORKFLOWS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / ".github" / "workflows").glob("*.yml"))


def actionlint(*files: str) -> subprocess.CompletedProcess[str]:
    for tool in ("actionlint", "shellcheck"):
        if not (BIN / tool).exists():
            pytest.fail(f"{tool} missing from {BIN}: install the dev extra (pyproject.toml)")
    command = [str(BIN / "actionlint"), "-shellcheck", str(BIN / "shellcheck")]
    return subprocess.run([*command, *files], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_workflows_are_actionlint_clean() -> None:
    assert WORKFLOWS == [
        ".github/workflows/gpu-smoke.yml",
        ".github/workflows/images.yml",
        ".github/workflows/lock-drift.yml",
        ".github/workflows/npu-nightly.yml",
    ]
    result = actionlint()  # no arguments: the workflows and the config it finds itself
    assert result.returncode == 0, result.stdout + result.stderr
    assert actionlint(*WORKFLOWS).returncode == 0
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_flags_old_actions_undeclared_labels_and_shell_bugs(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text(
        "on: push\njobs:\n  t:\n    runs-on: [self-hosted, tpu]\n    steps:\n"
        "      - uses: actions/checkout@v4\n      - run: echo $UNQUOTED_VAR\n"
    )
    out = actionlint(str(bad)).stdout
    assert 'label "tpu" is unknown' in out
    assert 'runtime "node20" is deprecated' in out and "actions/checkout@v4" in out
    assert "SC2086" in out  # shellcheck ran on the run: script
