"""Shared by every test folder: the repository root (tests are collected as the package `tests`), the
tiny assets and the one tiny CPU run (with its rerun) that several folders check, and the order and
grouping of test files for `pytest -n 2 --dist loadfile` (pytest-xdist; ci/test.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Files whose tests share the session's tiny CPU run: one xdist worker runs them all, so it runs once.
TINY_RUN_FILES = ("tests/run/test_cpu_run.py", "tests/records/test_provenance.py", "tests/test_slurm.py")
# The longest units of work, longest first (seconds on 2 workers of a 2-core machine, 2026-12-07, ef3258a:
# 1,032, 918, 408, 396; the next is 89). Handed out in path order, the 918 s file started last on one
# worker and the run took 2,166 s with the other worker idle for 850 of them; longest first, the two
# workers' shares come out within seconds of each other (~1,730 s each, replayed from that run's times).
LONGEST_FIRST = (
    "tiny_cpu_run",
    "tests/test_workflow.py",
    "tests/run/test_learning.py",
    "tests/run/test_resume.py",
)


def _scope(path: str) -> str:
    """The unit of work one xdist worker runs whole (a file, or the files of the tiny CPU run)."""
    return "tiny_cpu_run" if path in TINY_RUN_FILES else path


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest units first, then the other files with slow tests: a file of minutes must not start
    last on a worker. The sort is stable: files stay whole and keep their tests' order."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}

    def rank(item: pytest.Item) -> tuple[int, bool]:
        scope = _scope(item.nodeid.split("::", 1)[0])
        longest = LONGEST_FIRST.index(scope) if scope in LONGEST_FIRST else len(LONGEST_FIRST)
        return longest, item.path not in slow_files

    items.sort(key=rank)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`-n 2 --dist loadfile` (ci/test.sh): a file runs on one worker, so its module fixtures (a trained
    run, built assets) are made once, and the TINY_RUN_FILES run together. (xdist's `xdist_group` mark
    would say this, but it is lost under pytest 9.2, which no longer reads `item._nodeid`.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # keep the slow-first order above, not "most tests first"

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid.split("::", 1)[0])

    return FileScheduling(config, log)


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny models and the synthetic data set (engine.data.assets, seed 0, default sizes)."""
    from engine.data import assets

    out = tmp_path_factory.mktemp("tiny-assets")
    assets.build_all(out, seed=0)
    return out


@dataclass(frozen=True)
class Launch:
    """One `python -m engine ...` invocation and the run directory it wrote."""

    out: Path
    proc: subprocess.CompletedProcess[str]

    @property
    def record(self) -> dict:
        return json.loads((self.out / "run.json").read_text())

    @property
    def rows(self) -> list[dict]:
        from engine.run.rundir import read_metrics

        return read_metrics(self.out / "metrics.jsonl")

    def why(self) -> str:
        log = self.out / "train.log"
        tail = log.read_text(errors="replace")[-5000:] if log.exists() else ""
        return f"{self.proc.stdout[-3000:]}\n{self.proc.stderr[-3000:]}\n{tail}"


def engine(
    *args: str, env: dict[str, str] | None = None, timeout: float = 1200
) -> subprocess.CompletedProcess[str]:
    """`python -m engine ARGS` from the repository root, as a user types it."""
    return subprocess.run(
        [sys.executable, "-m", "engine", *args],
        cwd=ROOT,
        env=os.environ | (env or {}),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_recipe(
    recipe: str,
    out: Path,
    assets_dir: Path,
    *sets: str,
    model: str = "tiny-qwen35",
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
) -> Launch:
    """`engine run RECIPE --device cpu` on the tiny assets in assets_dir (engine.data.assets), sets and
    further `args` of `engine run`."""
    from engine.data import assets

    items = [arg for item in (*assets.recipe_sets(assets_dir, model), *sets) for arg in ("--set", item)]
    return Launch(out, engine("run", recipe, "--device", "cpu", "--out", str(out), *items, *args, env=env))


@pytest.fixture(scope="session")
def tiny_cpu_run(tmp_path_factory: pytest.TempPathFactory, tiny_assets: Path) -> Launch:
    """`engine run tiny_cpu` (2 GRPO steps through verl's main_ppo, checkpoint at step 2) with
    credentials planted in its environment (tests/support/runs.py SECRETS): the provenance tests check
    that none reaches disk, the run tests check what it trained."""
    from tests.support.runs import SECRETS

    launch = run_recipe("tiny_cpu", tmp_path_factory.mktemp("tiny-cpu-run") / "run", tiny_assets, env=SECRETS)
    assert launch.proc.returncode == 0, launch.why()
    return launch


@dataclass(frozen=True)
class Published:
    """The tiny run's checkpoint exported (`engine export --verify-logits`) and its provenance written."""

    export: Path
    exported: subprocess.CompletedProcess[str]
    wrote: subprocess.CompletedProcess[str]


@pytest.fixture(scope="session")
def tiny_cpu_published(tiny_cpu_run: Launch) -> Published:
    from tests.support.runs import SECRETS

    export = tiny_cpu_run.out.parent / "export"
    exported = engine(
        "export", str(tiny_cpu_run.out / "checkpoints"), "--out", str(export), "--verify-logits", env=SECRETS
    )
    assert exported.returncode == 0, exported.stderr[-2000:]
    wrote = engine("provenance", "write", str(tiny_cpu_run.out), "--export", str(export), env=SECRETS)
    assert wrote.returncode == 0, wrote.stderr[-2000:]
    return Published(export, exported, wrote)


@pytest.fixture(scope="session")
def tiny_cpu_rerun(
    tmp_path_factory: pytest.TempPathFactory, tiny_cpu_run: Launch, tiny_cpu_published: Published
) -> Launch:
    """`engine rerun` of that run from its provenance record (same seed, same recorded launch), with the
    same planted credentials."""
    from tests.support.runs import SECRETS

    out = tmp_path_factory.mktemp("tiny-cpu-rerun") / "rerun"
    return Launch(out, engine("rerun", str(tiny_cpu_run.out), "--out", str(out), env=SECRETS))
