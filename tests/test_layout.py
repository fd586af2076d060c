"""The package layout: each concern in its own subpackage, small modules, and the command-line and
record paths free of torch, verl and Ray (they run on login nodes and in CI without them)."""

from __future__ import annotations

import ast
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

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


# The flow, first to last: a package imports only the packages before it (and the shared utilities);
# `engine.cli` and the names verl loads (verl_ext, kernels, rewards) sit on top and may import any.
FLOW = ["env", "recipes", "data", "preflight", "checkpoint", "runtime", "run", "records"]
UTILITIES = {"errors", "fsutil", "paths", "hashing", "bounds", "procs"}


def _engine_imports(path: Path) -> set[str]:
    """Every engine module a file imports, also inside functions (a lazy import still ties them)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "engine":
            base = node.module
            found |= {f"{base}.{a.name}" if base == "engine" else base for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "engine"}
    return found


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def test_imports_follow_the_flow_and_form_no_circle() -> None:
    graph = {_module(p): _engine_imports(p) for p in (ROOT / "engine").rglob("*.py")}
    backwards = []
    for module, imports in sorted(graph.items()):
        parts = module.split(".")
        if len(parts) == 2 and parts[1] in UTILITIES:  # the shared utilities lean on nothing else
            assert {t.split(".")[1] for t in imports} <= UTILITIES, f"{module} imports {sorted(imports)}"
        if len(parts) < 3 or parts[1] not in FLOW:
            assert len(parts) < 3, f"{module}: a subpackage outside the flow {FLOW}"
            continue
        for target in sorted(imports):
            tparts = target.split(".")
            if len(tparts) < 2 or tparts[1] in UTILITIES or tparts[1] == parts[1]:
                continue
            if tparts[1] not in FLOW or FLOW.index(tparts[1]) > FLOW.index(parts[1]):
                backwards.append(f"{module} -> {target}")
    assert not backwards, f"imports against the flow {FLOW}: {backwards}"

    modules = set(graph)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges = {m: {t for t in map(resolve, graph[m]) if t and t != m and t != "engine"} for m in modules}
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(edges[node]):
            assert seen.get(nxt) != 1, f"import circle: {' -> '.join([*path, node, nxt])}"
            if nxt not in seen:
                visit(nxt, [*path, node])
        seen[node] = 2

    for module in sorted(modules):
        if module not in seen:
            visit(module, [])


def test_the_scheduling_hints_name_test_files_that_exist() -> None:
    """tests/conftest.py's order for xdist names files: a renamed file would silently fall back to path
    order and leave a worker idle again."""
    from tests.conftest import LONGEST_FIRST, TINY_RUN_FILES

    named = [f for f in (*TINY_RUN_FILES, *LONGEST_FIRST) if f != "tiny_cpu_run"]
    missing = [f for f in named if not (ROOT / f).is_file()]
    assert not missing, missing
