"""A run directory shaped like `engine run` output, with a small checkpoint and planted credentials."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

SECRETS = {
    "HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyz0123",
    "WANDB_API_KEY": "0123456789abcdef0123456789abcdef",
    "NCCL_SOCKET_TOKEN": "nccl-secret-value-42",
    "MY_DB_PASSWORD": "correct-horse-battery",
    "ENGINE_MIRROR_URL": "https://alice:s3cr3tpw@mirror.example.com/simple",
}


def run_record(**fields: Any) -> str:
    """A run.json as `engine run` writes it (engine.run.record), with `fields` changed."""
    from engine.run.record import RunRecord

    base: dict[str, Any] = {
        "recipe": "tiny_cpu",
        "device": "cpu",
        "command": ["python", "-m", "verl.trainer.main_ppo"],
        "command_line": "python -m verl.trainer.main_ppo",
        "sets": [],
        "env": {},
        "start": "2025-01-01T00:00:00+00:00",
        "end": "2025-01-01T00:01:00+00:00",
        "wall_s": 60.0,
        "exit_code": 0,
        "steps_done": 2,
        "last_step": 2,
        "checkpoint_step": 2,
        "target_steps": 2,
        "status": "ok",
        "gates": [],
    }
    return RunRecord(**(base | fields)).to_json()


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
    env = {"VERL_PLATFORM": "cpu", "HF_TOKEN": SECRETS["HF_TOKEN"]}
    (run / "run.json").write_text(run_record(env=env, checkpoint_step=1, last_step=2))
    return run
