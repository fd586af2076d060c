"""A run directory shaped like `engine run` output, with a small checkpoint and planted credentials."""

from __future__ import annotations

import json
import os
from pathlib import Path

SECRETS = {
    "HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyz0123",
    "WANDB_API_KEY": "0123456789abcdef0123456789abcdef",
    "NCCL_SOCKET_TOKEN": "nccl-secret-value-42",
    "MY_DB_PASSWORD": "correct-horse-battery",
    "ENGINE_MIRROR_URL": "https://alice:s3cr3tpw@mirror.example.com/simple",
}


def fake_run(root: Path) -> Path:
    """A run directory shaped like `engine run` output, with a small checkpoint."""
    run = root / "run"
    actor = run / "checkpoints" / "global_step_1" / "actor"
    actor.mkdir(parents=True)
    (actor / "model_world_size_1_rank_0.pt").write_bytes(os.urandom(4096))
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("1")
    (run / "recipe.yaml").write_text(
        "name: tiny_cpu\ntrainer: {total_training_steps: 2}\ndata: {}\nmodel: {}\n"
    )
    (run / "overrides.txt").write_text("algorithm.adv_estimator=grpo\ntrainer.total_training_steps=2\n")
    (run / "launch.sh").write_text("#!/bin/sh\npython -m verl.trainer.main_ppo\n")
    rows = [
        {"step": s, "data": {"actor/pg_loss": 0.1 * s, "critic/score/mean": 0.5, "note": "x"}} for s in (1, 2)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = {"recipe": "tiny_cpu", "device": "cpu", "command": ["python", "-m", "verl.trainer.main_ppo"],
              "start": "2025-01-01T00:00:00+00:00", "end": "2025-01-01T00:01:00+00:00", "exit_code": 0,
              "status": "ok", "env": {"VERL_PLATFORM": "cpu", "HF_TOKEN": SECRETS["HF_TOKEN"]}}  # fmt: skip
    (run / "run.json").write_text(json.dumps(record))
    return run
