"""Test-only ways to break the GRPO loop, to show that the gates in `engine.run.gates` catch them.

A correctness check that never failed proves nothing; these switches break the loop the way real bugs
do, so tests and docs/reference/gates.md can show the learning and agreement gates failing. They are chosen
only by the environment variable `ENGINE_TEST_BREAK` (never by a recipe) and are read in every verl
process through `engine.verl_ext`:

- `no_weight_sync`: the rollout server accepts every weight update but keeps its initial weights
  (the silent sync failure verl users report after the first update): in the hf server, and in verl's
  vLLM rollout, whose trainer-side adapter gathers every tensor and sends none;
- `negate_advantages`: GRPO advantages come out with the wrong sign (the loop unlearns the reward);
- `zero_lr`: the actor's optimizer gets learning rate 0 (gradients flow, weights never move).
"""

from __future__ import annotations

import functools
import os
from importlib.util import find_spec
from typing import Any

ENV = "ENGINE_TEST_BREAK"
NO_WEIGHT_SYNC = "no_weight_sync"
NEGATE_ADVANTAGES = "negate_advantages"
ZERO_LR = "zero_lr"
KNOWN = (NO_WEIGHT_SYNC, NEGATE_ADVANTAGES, ZERO_LR)


def selected() -> str | None:
    """The breakage named in the environment, None when unset; an unknown name is an error."""
    name = os.environ.get(ENV, "").strip()
    if not name:
        return None
    if name not in KNOWN:
        known = ", ".join(KNOWN)
        raise ValueError(f"{ENV}={name!r} is not a known breakage; choose one of {known} or unset it")
    return name


def active(name: str) -> bool:
    return selected() == name


def _negated(func: Any) -> Any:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        advantages, returns = func(*args, **kwargs)
        return -advantages, -returns

    wrapper.__engine_broken__ = True  # type: ignore[attr-defined]
    return wrapper


def _zero_lr(func: Any) -> Any:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        optimizer = func(*args, **kwargs)
        for group in optimizer.param_groups:  # before verl builds the scheduler: its base lr is 0 too
            group["lr"] = 0.0
        return optimizer

    wrapper.__engine_broken__ = True  # type: ignore[attr-defined]
    return wrapper


def _unsent(func: Any) -> Any:
    @functools.wraps(func)
    async def wrapper(self: Any, weights: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_engine_first_sync_done", False):  # vLLM starts on dummy weights
            self._engine_first_sync_done = True
            return await func(self, weights, *args, **kwargs)
        # drain the generator: on several ranks it drives FSDP's all-gathers, which must still happen
        if hasattr(weights, "__aiter__"):
            async for _ in weights:
                pass
        else:
            for _ in weights:
                pass
        return None

    wrapper.__engine_broken__ = True  # type: ignore[attr-defined]
    return wrapper


def _break_vllm_sync() -> None:
    """verl's vLLM rollout keeps the weights of its first sync; a no-op without vLLM.

    The trainer-side adapter sends the start-up sync and drops every later one; the server sleeps at
    level 1 (weights kept in host memory) instead of 2 (weights discarded, refilled by each sync), so
    the rollout samples from stale weights rather than from freed memory.
    """
    if find_spec("vllm") is None:
        return
    from verl.workers.rollout.vllm_rollout import vllm_async_server, vllm_rollout

    adapter = vllm_rollout.ServerAdapter
    if not getattr(adapter.update_weights, "__engine_broken__", False):
        adapter.update_weights = _unsent(adapter.update_weights)
        vllm_async_server.vLLMHttpServer._resolve_sleep_level = lambda self: 1


def install() -> str | None:
    """Apply the selected breakage to verl in this process (the hf server checks its own)."""
    name = selected()
    if name == NO_WEIGHT_SYNC:
        _break_vllm_sync()
    elif name == NEGATE_ADVANTAGES:
        # verl's compute_advantage calls core_algos.compute_grpo_outcome_advantage by module attribute
        from verl.trainer.ppo import core_algos

        if not getattr(core_algos.compute_grpo_outcome_advantage, "__engine_broken__", False):
            core_algos.compute_grpo_outcome_advantage = _negated(core_algos.compute_grpo_outcome_advantage)
    elif name == ZERO_LR:
        # the FSDP engine imports build_optimizer from this module when it builds the actor
        from verl.workers.config import optimizer

        if not getattr(optimizer.build_optimizer, "__engine_broken__", False):
            optimizer.build_optimizer = _zero_lr(optimizer.build_optimizer)
    return name
