"""`python -m engine check-imports`: a missing module is found before a run, and a fallback wheel fixes it."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from engine.env import imports


def _wheel(folder: Path, module: str) -> Path:
    """A minimal pure-Python wheel shipping `module` (what pip needs to install it)."""
    dist = f"{module}-1.0.dist-info"
    path = folder / f"{module}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{module}.py", "ANSWER = 42\n")
        whl.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
        whl.writestr(
            f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        whl.writestr(f"{dist}/RECORD", "")
    return path


def test_missing_module_fails_then_the_fallback_wheel_is_added(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    site, wheels = tmp_path / "site", tmp_path / "wheels"
    site.mkdir()
    wheels.mkdir()
    _wheel(wheels, "engine_probe_module")
    monkeypatch.setenv("PYTHONPATH", str(site))  # as on the target: the installed stack is on the path
    assert imports.cli_main(["--module", "engine_probe_module", "--module", "json"]) == 1
    failed = json.loads(capsys.readouterr().out)
    assert failed["imports"] == "failed" and failed["missing"] == ["engine_probe_module"]

    out = tmp_path / "imports.json"
    args = [
        "--module",
        "engine_probe_module",
        "--site",
        str(site),
        "--fallback",
        str(wheels),
        "--out",
        str(out),
    ]
    assert imports.cli_main(args) == 0
    report = json.loads(out.read_text())
    assert report == {
        "imports": "ok",
        "modules": ["engine_probe_module"],
        "added": ["engine_probe_module-1.0-py3-none-any.whl"],
    }
    assert (site / "engine_probe_module.py").is_file()


def test_the_workflow_imports_here() -> None:
    """The CPU environment runs Snakemake: the `workflow` list imports (what a GPU target must carry)."""
    assert imports.check(imports.WORKFLOW_MODULES, None, {})["imports"] == "ok"


def test_the_trainer_selection_needs_no_vllm_and_imports_here() -> None:
    """`--what train`/`bench` (what a wheelhouse of containers/wheelhouse-gpu.txt alone must satisfy) names
    no vLLM module, is part of the GRPO run's set, and, fla aside (GPU only), imports on this stack."""
    assert not [m for m in imports.TRAIN_MODULES if m.split(".")[0] == "vllm"]
    assert set(imports.TRAIN_MODULES) <= set(imports.RUN_MODULES)
    here = tuple(m for m in imports.TRAIN_MODULES if not m.startswith("fla."))
    assert imports.check(here, None, {}) == {"imports": "ok", "modules": list(here), "added": []}


def test_the_wheelhouse_selections_split_trainer_and_rollout() -> None:
    """The rollout's names are only in wheelhouse-vllm.txt, the trainer's only in wheelhouse-gpu.txt."""
    from engine.env.wheelhouse import read_names
    from tests.conftest import ROOT

    train = read_names(str(ROOT / "containers/wheelhouse-gpu.txt"))
    rollout = read_names(str(ROOT / "containers/wheelhouse-vllm.txt"))
    assert {"verl", "ray", "flash-linear-attention", "triton"} <= train
    assert "vllm" in rollout and not train & rollout
