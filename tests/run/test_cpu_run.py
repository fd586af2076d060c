"""Real verl GRPO on CPU: `engine run tiny_cpu` / `tiny_moe_cpu` train 2 steps through verl's main_ppo,
checkpoint, export with verl's model merger, and repeat bit-for-bit at step 1 with the same seed (the
session's tiny run and its `engine rerun`, tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, Launch, run_recipe

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
