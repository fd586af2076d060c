"""The package layout: each concern in its own subpackage, small modules, and the command-line and
record paths free of torch, verl and Ray (they run on login nodes and in CI without them)."""

from __future__ import annotations

import pkgutil
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

HEAVY = ("torch", "verl", "ray")
# Packages whose every module imports without torch/verl/Ray; engine.runtime runs inside verl processes
# and engine.checkpoint's merge/export need torch when they run (they import it lazily, but not all).
LIGHT = ["engine.recipes", "engine.preflight", "engine.run", "engine.records", "engine.env", "engine.data"]


def _modules(package: str) -> list[str]:
    path = ROOT / package.replace(".", "/")
    return [f"{package}.{m.name}" for m in pkgutil.iter_modules([str(path)])]


@pytest.mark.parametrize("package", LIGHT)
def test_package_imports_no_torch_verl_or_ray(package: str) -> None:
    names = [package, *_modules(package)]
    code = (
        f"import importlib, sys\nfor name in {names!r}:\n    importlib.import_module(name)\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"{package}: {done.stdout}"


def test_modules_are_small_and_have_no_banner_comments() -> None:
    banner = re.compile(r"^\s*# ?-{10,}", re.M)
    for path in sorted((ROOT / "engine").rglob("*.py")):
        text = path.read_text()
        assert text.count("\n") <= 400, f"{path.relative_to(ROOT)} has {text.count(chr(10))} lines"
        assert not banner.search(text), f"{path.relative_to(ROOT)} has a banner comment"


def test_the_wheel_declares_every_engine_package_and_nothing_else() -> None:
    tomllib = pytest.importorskip("tomllib")
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"engine"} | {
        ".".join(p.relative_to(ROOT).parent.parts) for p in (ROOT / "engine").rglob("__init__.py")
    }
    assert found <= declared, f"not in the wheel: {sorted(found - declared)}"
    assert all(name.split(".")[0] == "engine" for name in declared), (
        declared
    )  # benchmarks, containers stay out
