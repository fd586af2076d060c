"""One packed PPO step of verl's FSDP2 engine on the CPU, in a fresh process: what the runtime tests that
compare a replacement or a lever with verl's own step share.

A test's script (run by `run_script`, with the small dense model's path as argv[1]) calls `start()`
before it imports verl, builds its engines with `benchmarks.gpu_worker.build_verl_engine`, steps each
with `ppo_step` and prints one JSON line of results as its last output.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any


def start() -> None:
    """torch kernels (no fla on the CPU) and a one-rank gloo group at the file argv[2] names."""
    import torch.distributed as dist

    from engine.runtime.kernels import select_kernels

    select_kernels("torch")
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)


def ppo_step(engine: Any, config: Any, entropy_coeff: float = 0.0) -> Any:
    """verl's actor update on one fixed batch: 4 ragged responses of up to 16 tokens after 16 prompt
    tokens, two micro-batches, old log-probs near the model's (few ratios clipped); entropy computed
    when `entropy_coeff` is set. Returns train_batch's output."""
    import torch
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    from benchmarks.gpu_worker import _batch, _response_mask, verl_batch

    vocab = config.hf_config.get_text_config().vocab_size
    ids, mask = _batch(vocab, 4, 32, "cpu", 7), _response_mask(0.3, 4, 32, 16, 7)
    advantages = torch.randn(4, 16, generator=torch.Generator().manual_seed(7))
    td = verl_batch(ids, mask, advantages, 1, 2, True)
    if entropy_coeff:
        tu.assign_non_tensor(td, calculate_entropy=True)  # ppo_loss pads the entropy too
    td["old_log_probs"] = torch.full_like(td["old_log_probs"], -7.0)
    actor = ActorConfig(
        strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=2, entropy_coeff=entropy_coeff
    )
    with engine.train_mode():
        return engine.train_batch(td, loss_function=partial(ppo_loss, config=actor))


def run_script(script: str, tmp_path: Path, env: dict[str, str] | None = None) -> dict:
    """`script` in a fresh Python on the small dense model, as a one-rank verl worker; its last line."""
    from benchmarks.gpu_bench import worker_env
    from engine.data import random_model
    from tests.conftest import ROOT

    model = random_model.make_model(tmp_path / "dense", small=True)
    full_env = worker_env() | {"PYTHONPATH": str(ROOT), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(model), str(tmp_path / "pg")],
        cwd=ROOT, env=full_env | (env or {}), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])
