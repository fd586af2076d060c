"""Real verl GRPO on CPU: `engine run tiny_cpu` / `tiny_moe_cpu` train 2 steps through verl's main_ppo,
checkpoint, export with verl's model merger, and repeat bit-for-bit at step 1 with the same seed (the
session's tiny run and its `engine rerun`, tests/conftest.py); a launcher killed alone takes verl with it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.hashing import sha256_file
from engine.run import rundir
from tests.conftest import ROOT, Launch, engine, run_recipe

pytestmark = pytest.mark.slow
MERGE = [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp"]

# Step metrics fixed by the sampled tokens and the rewards, whatever the order of samples: to the bit.
STEP1_EXACT = (
    "critic/score/max",
    "critic/score/min",
    "response_length/mean",
    "prompt_length/mean",
)
# Means over the batch: the same values, but the async rollout may return samples in another order,
# so float32 sums can differ in the last bit (seen: score/mean 0.07082699239 vs 0.07082699984).
STEP1_MEANS = ("critic/score/mean", "critic/advantages/max", "critic/advantages/min")
# Float32 reductions over the model, summed over micro-batches in that order (seen 7.5e-5 apart).
STEP1_REDUCTIONS = ("actor/pg_loss", "actor/grad_norm", "actor/entropy")


def test_two_grpo_steps_learn_and_sync(tiny_cpu_run: Launch) -> None:
    record, rows = tiny_cpu_run.record, tiny_cpu_run.rows
    assert record["status"] == "ok" and record["exit_code"] == 0
    assert [row["step"] for row in rows] == [1, 2]
    assert "step 1/2" in tiny_cpu_run.proc.stdout and "step 2/2" in tiny_cpu_run.proc.stdout
    for row in rows:
        data = row["data"]
        assert data["actor/grad_norm"] > 0
        assert data["critic/advantages/max"] > 0  # the shaped reward separates samples of a group
        assert data["training/rollout_probs_diff_max"] < 1e-3  # rollout weights == actor weights


def test_checkpoint_exports_and_differs_from_init(
    tiny_cpu_run: Launch, tiny_assets: Path, tmp_path: Path
) -> None:
    import torch
    import transformers
    from safetensors.torch import load_file

    ckpt = tiny_cpu_run.out / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    actor = ckpt / "global_step_2" / "actor"
    assert (actor / "model_world_size_1_rank_0.pt").exists()
    merged = tmp_path / "merged"
    done = subprocess.run(
        [*MERGE, "--local_dir", str(actor), "--target_dir", str(merged)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    config = transformers.AutoConfig.from_pretrained(merged)
    model = getattr(transformers, config.architectures[0]).from_pretrained(merged)
    trained = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    initial = load_file(str(tiny_assets / "tiny-qwen35" / "model.safetensors"))
    text_params = [name for name in initial if name.startswith(("model.language_model.", "lm_head."))]
    assert text_params and set(text_params) <= set(trained)
    changed = [
        name for name in text_params if not torch.equal(initial[name].to(trained[name].dtype), trained[name])
    ]
    # Every text-model matrix took an Adam step (the vision tower sees no images). The export is bf16, so
    # a 1-D parameter near 1.0 (e.g. dt_bias) can round back to its initial value after two lr=1e-3 steps.
    matrices = [name for name in text_params if initial[name].ndim >= 2]
    assert set(matrices) <= set(changed), sorted(set(matrices) - set(changed))[:5]
    assert len(changed) >= 0.9 * len(text_params)


def test_same_seed_same_step1_metrics(tiny_cpu_run: Launch, tiny_cpu_rerun: Launch) -> None:
    """`engine rerun` relaunches the recorded run; with the same seed step 1 repeats."""
    assert tiny_cpu_rerun.proc.returncode == 0, tiny_cpu_rerun.why()
    first, second = tiny_cpu_run.rows[0]["data"], tiny_cpu_rerun.rows[0]["data"]
    for key in STEP1_EXACT:
        assert second[key] == first[key], key
    for key in STEP1_MEANS:
        assert second[key] == pytest.approx(first[key], rel=1e-6), key
    for key in STEP1_REDUCTIONS:
        assert second[key] == pytest.approx(first[key], rel=2e-4, abs=1e-7), key


def test_moe_two_steps(tmp_path: Path, tiny_assets: Path) -> None:
    run = run_recipe("tiny_moe_cpu", tmp_path / "moe", tiny_assets, model="tiny-qwen35-moe")
    assert run.proc.returncode == 0, run.why()
    assert run.record["status"] == "ok"
    assert [row["step"] for row in run.rows] == [1, 2]
    assert all(row["data"]["actor/grad_norm"] > 0 for row in run.rows)
    assert (tmp_path / "moe" / "checkpoints" / "global_step_2" / "actor").is_dir()


def _earlier_run_files(run: Path) -> dict[str, str]:
    """sha256 of every file of a run directory but the hidden stage a launch writes into and the lock
    file naming the launch that holds the directory."""
    files = [p for p in sorted(run.rglob("*")) if p.is_file() and p.name != rundir.LOCK]
    return {
        str(p.relative_to(run)): sha256_file(p)
        for p in files
        if rundir.ATTEMPT_PREFIX not in str(p.relative_to(run))
    }


def _resumed(run: Path) -> bool:
    """verl printed that it loaded the run's checkpoint: from here on it trains into it."""
    return any("Resuming from" in log.read_text(errors="replace") for log in run.glob(".attempt.*/train.log"))


def _live_in_session(sid: int | None) -> list:
    import psutil

    found = []
    for proc in psutil.process_iter(["status"]) if sid is not None else []:
        try:
            if os.getsid(proc.pid) == sid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (OSError, psutil.Error):
            continue
    return found


def test_killing_the_launcher_alone_stops_verl_and_keeps_the_earlier_run(
    tiny_cpu_run: Launch, tiny_assets: Path, tmp_path: Path
) -> None:
    """`kill -9` of `engine run` (no other process) while it resumes an earlier, recorded run. Before,
    verl (in a session of its own) trained on for half a minute, saved steps and moved the checkpoint
    tracker of the earlier run, and `provenance verify` reported it changed."""
    import psutil

    from engine.data import assets

    skip = shutil.ignore_patterns("provenance.json", "ro-crate-metadata.json", "README.md")
    run = shutil.copytree(tiny_cpu_run.out, tmp_path / "run", ignore=skip)  # checkpoint at step 2 of 2
    wrote = engine("provenance", "write", str(run))
    assert wrote.returncode == 0, wrote.stderr[-2000:]
    before = _earlier_run_files(run)
    sets = [*assets.recipe_sets(tiny_assets, "tiny-qwen35"), "trainer.total_training_steps=3"]
    argv = [sys.executable, "-m", "engine", "run", "tiny_cpu", "--device", "cpu", "--out", str(run)]
    argv += [arg for item in [*sets, "trainer.save_freq=1"] for arg in ("--set", item)]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    launcher = subprocess.Popen(argv, cwd=ROOT, start_new_session=True, **quiet)
    deadline, sid = time.monotonic() + 900, None
    try:
        while not _resumed(run):
            assert launcher.poll() is None, f"the launch ended ({launcher.returncode}) before it resumed"
            assert time.monotonic() < deadline, "verl never resumed"
            time.sleep(0.2)
        (verl,) = [c for c in psutil.Process(launcher.pid).children() if "main_ppo" in " ".join(c.cmdline())]
        sid = os.getsid(verl.pid)  # Ray's processes stay in the session of verl's driver
        assert len(_live_in_session(sid)) > 3  # the driver, Ray's GCS, raylet, workers
        launcher.kill()  # the launcher alone
        launcher.wait()
        deadline = time.monotonic() + 15
        while (left := _live_in_session(sid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"outlived the launcher: {[(p.pid, p.name()) for p in left]}"
    finally:
        for proc in _live_in_session(sid):
            proc.kill()
    assert _earlier_run_files(run) == before
    verified = engine("provenance", "verify", str(run))
    assert verified.returncode == 0, verified.stderr[-2000:]
