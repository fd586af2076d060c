"""Resume equivalence: a run stopped by SIGKILL and relaunched trains what an uninterrupted run trains.

`tiny_cpu_learn` on 8 prompts (4 per step: 2 steps per epoch), 2 epochs, 4 steps, a checkpoint each
step. Once straight through; once killed after step 1 (mid-epoch), relaunched, killed after step 2
(exactly at the epoch boundary, where verl #7401 reports resumes that exit 0 without training),
relaunched to step 4. The four steps are compared one by one: metrics fixed by the sampled tokens and
rewards to the bit, batch reductions within the tolerance of `engine rerun` (docs/reference/gates.md:
the async rollout may hand the batch over in another order, so float32 sums differ in the last bits).
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import fsutil
from engine.checkpoint.layout import saved_step
from engine.data import assets as tiny_assets
from engine.records.rerun import compare_metrics
from engine.run.rundir import read_metrics
from tests.conftest import ROOT

pytestmark = pytest.mark.slow
STEPS, PER_EPOCH = 4, 2
SETS = ("trainer.total_training_steps=4", "trainer.total_epochs=2", "trainer.save_freq=1")
# fixed by the sampled tokens and their rewards, whatever the order of samples in the batch
EXACT = (
    "critic/score/max",
    "critic/score/min",
    "response_length/mean",
    "response_length/max",
    "response_length/min",
    "prompt_length/mean",
    "training/epoch",
    "actor/lr",
)
# batch means and float32 reductions over the model: `engine rerun`'s default tolerance
FLOAT = (
    "critic/score/mean",
    "critic/advantages/max",
    "critic/advantages/min",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/entropy",
)
RTOL, ATOL = 1e-3, 1e-6


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.data import assets as tiny

    out = tmp_path_factory.mktemp("resume-assets")
    tiny.build_all(out, seed=0, train_size=STEPS * PER_EPOCH, test_size=4)
    return out


def command(out: Path, assets: Path) -> list[str]:
    argv = [sys.executable, "-m", "engine", "run", "tiny_cpu_learn", "--device", "cpu", "--out", str(out)]
    for item in (*tiny_assets.recipe_sets(assets), *SETS):
        argv += ["--set", item]
    return argv


def finish(out: Path, assets: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command(out, assets), cwd=ROOT, capture_output=True, text=True, timeout=900)
    log = (out / "train.log").read_text(errors="replace")[-4000:] if (out / "train.log").exists() else ""
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-2000:]}\n{log}"
    return done


def _stages(out: Path) -> set[Path]:
    """The hidden directories `engine run` writes a launch's files into until the launch ends."""
    return set(out.glob(f".attempt.*{fsutil.PARTIAL}"))


def kill_after(out: Path, assets: Path, step: int) -> list[dict]:
    """Launch, wait until `step` is checkpointed and logged, SIGKILL every process of the run at once
    (a node lost mid-step); returns the steps this launch logged (in its stage: nothing is published)."""
    import psutil

    before = _stages(out) if out.exists() else set()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    proc = subprocess.Popen(command(out, assets), cwd=ROOT, start_new_session=True, **quiet)
    ckpt, deadline = out / "checkpoints", time.monotonic() + 900

    def logged() -> list[dict]:
        new = sorted(_stages(out) - before) if out.exists() else []
        return read_metrics(new[0] / "metrics.jsonl") if new else []

    while not (saved_step(ckpt) >= step and any(row["step"] == step for row in logged())):
        assert proc.poll() is None, f"the launch ended ({proc.returncode}) before step {step}"
        assert time.monotonic() < deadline, f"step {step} never logged"
        time.sleep(0.1)
    root = psutil.Process(proc.pid)
    tree = [root, *root.children(recursive=True)]
    for item in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            item.send_signal(signal.SIGKILL)
    _, alive = psutil.wait_procs(tree, timeout=60)
    assert not alive, f"survived SIGKILL: {alive}"
    proc.wait(timeout=60)
    # the next step's checkpoint would move the resume point: the kill must land before it
    assert saved_step(ckpt) == step, f"checkpoint {saved_step(ckpt)} written before the kill landed"
    assert not (out / "run.json").exists()  # nothing recorded the killed launch as finished
    return logged()


def test_sigkilled_and_resumed_run_equals_an_uninterrupted_one(assets: Path, tmp_path: Path) -> None:
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    finish(straight_dir, assets)
    straight = read_metrics(straight_dir / "metrics.jsonl")
    assert [row["step"] for row in straight] == [1, 2, 3, 4]

    first = kill_after(resumed_dir, assets, 1)  # mid-epoch
    second = kill_after(resumed_dir, assets, 2)  # resumed at 1, killed at the epoch boundary
    assert [row["step"] for row in second] == [2]
    done = finish(resumed_dir, assets)  # resumed at the epoch boundary
    record = json.loads((resumed_dir / "run.json").read_text())
    assert record["status"] == "ok" and record["steps_done"] == 2 and record["last_step"] == STEPS
    assert record["hardware"]["host"] == socket.gethostname() and record["hardware"]["accelerator"] == "cpu"
    assert "gate learning: SKIP" in done.stdout  # this launch began at step 3

    last = read_metrics(resumed_dir / "metrics.jsonl")
    resumed = [row for row in first if row["step"] == 1] + second + last
    assert [row["step"] for row in resumed] == [1, 2, 3, 4]
    assert [row["data"]["training/epoch"] for row in straight] == [0, 0, 1, 1]
    assert compare_metrics(straight, resumed, list(EXACT), rtol=0.0) == []
    assert compare_metrics(straight, resumed, list(FLOAT), rtol=RTOL, atol=ATOL) == []
    # the weights moved between steps (lr 1e-2), so agreeing after the resume is not agreeing by default
    assert len({row["data"]["actor/grad_norm"] for row in straight}) == STEPS
