"""The engine as a user installs it: a wheel built from the checkout, used from another directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding only the built wheel; its base dependencies come from this environment
    through a path entry (no .pth of this environment runs there, so its editable engine stays out)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("engine", "recipes"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
        check=True, capture_output=True,
    )  # fmt: skip
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()
    )  # fmt: skip
    (site / "base_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wheel = next((tmp / "dist").glob("*.whl"))
    subprocess.run(
        [*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)], check=True
    )
    return python


def engine(python: Path, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`python -m engine ...` (or `python -c CODE` with args '-c', CODE) as a user's shell would run it."""
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ENGINE_RECIPE_DIR")}
    command = list(args) if args[0] == "-c" else ["-m", "engine", *args]
    return subprocess.run([str(python), *command], cwd=cwd, env=clean | env, capture_output=True, text=True)


def test_installed_wheel_lists_and_renders_from_any_directory(installed: Path, tmp_path: Path) -> None:
    where = engine(installed, "-c", "import engine; print(engine.__file__)", cwd=tmp_path)
    assert where.stdout.startswith(str(installed.parent.parent)), where.stdout
    listed = engine(installed, "list", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert {"qwen35_35b", "qwen35_27b", "tiny_cpu"} <= {
        line.split()[0] for line in listed.stdout.splitlines() if line.strip()
    }
    render = engine(
        installed, "render", "qwen35_35b", "--device", "gpu", "--format", "overrides", cwd=tmp_path
    )
    assert render.returncode == 0, render.stderr
    assert "actor_rollout_ref.actor.strategy=fsdp_turbo" in render.stdout


def test_user_recipes_are_added_not_substituted(installed: Path, tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "my_27b.yaml").write_text(
        "extends: qwen35_27b\ndescription: my variant\ntrainer:\n  save_freq: 5\n"
    )
    listed = engine(installed, "list", cwd=tmp_path, ENGINE_RECIPE_DIR=str(mine))
    names = {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}
    assert {"my_27b", "qwen35_35b"} <= names, listed.stdout + listed.stderr
    render = engine(installed, "render", "my_27b", "--device", "npu", "--format", "overrides", cwd=tmp_path,
                    ENGINE_RECIPE_DIR=str(mine))  # fmt: skip
    assert render.returncode == 0 and "trainer.save_freq=5" in render.stdout, render.stderr


def test_a_missing_user_recipe_dir_is_an_error(installed: Path, tmp_path: Path) -> None:
    typo = engine(installed, "list", cwd=tmp_path, ENGINE_RECIPE_DIR=str(tmp_path / "nope"))
    assert typo.returncode != 0
    assert typo.stderr.strip().splitlines() == [
        f"error: ENGINE_RECIPE_DIR: '{tmp_path / 'nope'}' is not a directory; fix or unset it"
    ]


def test_an_install_without_recipes_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.errors import UserError
    from engine.recipes import loader

    monkeypatch.setattr(loader, "recipe_dir", lambda: tmp_path)
    monkeypatch.delenv("ENGINE_RECIPE_DIR", raising=False)
    with pytest.raises(
        UserError, match=r"no recipes found in .*; reinstall the engine or set ENGINE_RECIPE_DIR"
    ):
        loader.list_recipes()
