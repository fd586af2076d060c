"""Real verl GRPO on CPU: `engine run tiny_cpu` / `tiny_moe_cpu` train 2 steps through verl's main_ppo,
checkpoint, export with verl's model merger, and repeat bit-for-bit at step 1 with the same seed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

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


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.data import assets

    out = tmp_path_factory.mktemp("cpu-run-assets")
    assets.build_all(out, seed=0)
    return out


def _run(recipe: str, out: Path, assets_dir: Path, model: str) -> dict:
    sets = [
        f"model.path={assets_dir / model}",
        f"data.train_files={assets_dir / 'data/synthetic/train.parquet'}",
        f"data.val_files={assets_dir / 'data/synthetic/test.parquet'}",
    ]
    command = [sys.executable, "-m", "engine", "run", recipe, "--device", "cpu", "--out", str(out)]
    command += [arg for item in sets for arg in ("--set", item)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    log = (out / "train.log").read_text(errors="replace") if (out / "train.log").exists() else ""
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}\n{log[-5000:]}"
    record = json.loads((out / "run.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"record": record, "rows": rows, "stdout": done.stdout}


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory: pytest.TempPathFactory, tiny_assets: Path) -> dict:
    out = tmp_path_factory.mktemp("tiny_cpu")
    return _run("tiny_cpu", out, tiny_assets, "tiny-qwen35") | {"out": out}


def test_two_grpo_steps_learn_and_sync(dense_run: dict) -> None:
    record, rows = dense_run["record"], dense_run["rows"]
    assert record["status"] == "ok" and record["exit_code"] == 0
    assert [row["step"] for row in rows] == [1, 2]
    assert "step 1/2" in dense_run["stdout"] and "step 2/2" in dense_run["stdout"]
    for row in rows:
        data = row["data"]
        assert data["actor/grad_norm"] > 0
        assert data["critic/advantages/max"] > 0  # the shaped reward separates samples of a group
        assert data["training/rollout_probs_diff_max"] < 1e-3  # rollout weights == actor weights


def test_checkpoint_exports_and_differs_from_init(dense_run: dict, tiny_assets: Path, tmp_path: Path) -> None:
    import torch
    import transformers
    from safetensors.torch import load_file

    ckpt = dense_run["out"] / "checkpoints"
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


def test_same_seed_same_step1_metrics(dense_run: dict, tiny_assets: Path, tmp_path: Path) -> None:
    again = _run("tiny_cpu", tmp_path / "again", tiny_assets, "tiny-qwen35")
    first, second = dense_run["rows"][0]["data"], again["rows"][0]["data"]
    for key in STEP1_EXACT:
        assert second[key] == first[key], key
    for key in STEP1_MEANS:
        assert second[key] == pytest.approx(first[key], rel=1e-6), key
    for key in STEP1_REDUCTIONS:
        assert second[key] == pytest.approx(first[key], rel=2e-4, abs=1e-7), key


def test_moe_two_steps(tmp_path: Path, tiny_assets: Path) -> None:
    run = _run("tiny_moe_cpu", tmp_path / "moe", tiny_assets, "tiny-qwen35-moe")
    assert run["record"]["status"] == "ok"
    assert [row["step"] for row in run["rows"]] == [1, 2]
    assert all(row["data"]["actor/grad_norm"] > 0 for row in run["rows"])
    assert (tmp_path / "moe" / "checkpoints" / "global_step_2" / "actor").is_dir()
