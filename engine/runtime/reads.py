"""verl 0.9.1's training step with its per-micro-batch host reads deferred to the end of the step: the
same numbers, read once the device has the whole step queued (`ENGINE_HOST_SYNCS=deferred`).

verl reads each micro-batch's loss (`loss.detach().item()` in `FSDPEngineWithLMHead.forward_step`) and
each loss metric (`.item()` in `Metric.append`) before it queues that micro-batch's backward, and the
clipped grad norm's finiteness (`if not torch.isfinite(grad_norm)`) before it queues the optimizer.
Each read drains the device's queue, and the host then launches the next kernels onto an idle device;
on one H100 the phase clocks found the MoE step's host caught up with its device twice a step, at the
loss and at the end of backward (docs/reference/trainer-levers.md). Here, inside `train_batch` and
`forward_backward_batch`:

- the loss and every scalar-tensor metric stay on the device (a copy, so no later in-place operation
  changes what is read; the `vanilla` policy loss, GRPO's, is verl's function with the same operators
  returning its three metrics as tensors); when the step is queued they come to the host in one
  `.tolist()` per dtype and device, which gives the Python numbers `.item()` gives, and are put where
  verl put its floats;
- with an optimizer whose step takes torch's `found_inf` (torch's fused Adam/AdamW, as GradScaler uses
  it), the finiteness check moves into the kernel: a non-finite norm skips the update on the device
  (moments and step counts unchanged; a first step still creates the zero state), and once the norm is
  read verl's warning and `zero_grad` follow. Other optimizers keep verl's host check.

`train_batch` then returns the grad norm as verl does, as a float. Everything else is verl's: these
wrap its methods, and `forward_step` is verl's sequence of its own engine methods.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

IMPL = "verl.workers.engine.fsdp.transformer_impl"
METRIC = "verl.utils.metric.utils"
CORE_ALGOS = "verl.trainer.ppo.core_algos"
VERL_METHODS: dict[str, Any] = {}  # "Class.method" -> verl's own, once replaced


@dataclass
class Pending:
    """Device scalars of one step waiting for the host: Metric value slots, and the grad norm."""

    slots: list[tuple[list[Any], int]] = field(default_factory=list)
    copies: set[int] = field(default_factory=set)  # ids of the device copies made for this step
    grad_norm: Any = None


_PENDING: contextvars.ContextVar[Pending | None] = contextvars.ContextVar("pending_reads", default=None)


@contextlib.contextmanager
def deferring() -> Iterator[Pending]:
    """The reads of the step inside wait for `read_pending`; a nested step joins the outer one."""
    outer = _PENDING.get()
    if outer is not None:
        yield outer
        return
    token = _PENDING.set(Pending())
    try:
        yield _PENDING.get()  # type: ignore[misc]
    finally:
        _PENDING.reset(token)


def defer(value: Any) -> Any:
    """A detached device copy of a scalar tensor while a step defers (verl's aggregation passes the copy
    on as it is), else the host number, as verl reads it."""
    pending = _PENDING.get()
    if pending is None:
        return value.detach().item()
    if id(value) in pending.copies:
        return value
    copy = value.detach().clone()
    pending.copies.add(id(copy))
    return copy


def read_to_host(values: list[Any]) -> list[Any]:
    """Each scalar tensor as `.item()` gives it, one read per dtype and device; other values as they are."""
    import torch

    out = list(values)
    groups: dict[tuple[Any, Any], list[int]] = {}
    for index, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            groups.setdefault((value.dtype, value.device), []).append(index)
    for indices in groups.values():
        numbers = torch.stack([values[i].reshape(()) for i in indices]).tolist()
        for i, number in zip(indices, numbers, strict=True):
            out[i] = number
    return out


def read_pending(pending: Pending, output: Any) -> Any:
    """Read every deferred scalar of the step (its Metric slots, the output's losses, the grad norm)."""
    import torch

    losses = output.get("loss") if isinstance(output, dict) else None
    losses = losses if isinstance(losses, list) else []
    slots = [values[i] for values, i in pending.slots]
    norm = [pending.grad_norm] if isinstance(pending.grad_norm, torch.Tensor) else []
    numbers = read_to_host([*slots, *losses, *norm])
    for (values, i), number in zip(pending.slots, numbers[: len(slots)], strict=True):
        values[i] = number
    losses[:] = numbers[len(slots) : len(slots) + len(losses)]
    pending.slots.clear()
    pending.copies.clear()
    if norm:
        pending.grad_norm = numbers[-1]
    return output


def metric_append(self: Any, value: Any) -> None:
    """verl's `Metric.append`, keeping a scalar tensor on the device while a step defers."""
    import torch

    pending = _PENDING.get()
    if pending is None or not isinstance(value, torch.Tensor):
        return VERL_METHODS["Metric.append"](self, value)
    if value.numel() != 1:
        raise ValueError("Only scalar tensors can be converted to float")
    self.values.append(defer(value))
    pending.slots.append((self.values, len(self.values) - 1))


def vanilla_policy_loss(
    old_log_prob: Any,
    log_prob: Any,
    advantages: Any,
    response_mask: Any,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Any = None,
) -> tuple[Any, dict[str, Any]]:
    """verl's `compute_policy_loss_vanilla` (dual-clip PPO), its metrics left as device scalars while a
    step defers; otherwise verl's own function."""
    import sys

    import torch

    core = sys.modules[CORE_ALGOS]
    if _PENDING.get() is None:
        verl = VERL_METHODS["policy_loss.vanilla"]
        return verl(
            old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
        )
    from verl.trainer.config import AlgoConfig
    from verl.utils import torch_functional as verl_F

    assert config is not None
    assert not isinstance(config, AlgoConfig)
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    clip_ratio_c = config.get("clip_ratio_c", 3.0)
    assert clip_ratio_c > 1.0, (
        "The lower bound of the clip_ratio_c for dual-clip PPO should be greater than 1.0,"
        + f" but get the value: {clip_ratio_c}."
    )
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_F.masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = verl_F.masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = verl_F.masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask
    )
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = core.agg_loss(
        loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info
    )
    metrics = {
        "actor/pg_clipfrac": pg_clipfrac,
        "actor/ppo_kl": ppo_kl,
        "actor/pg_clipfrac_lower": pg_clipfrac_lower,
    }
    return pg_loss, {key: defer(value) for key, value in metrics.items()}


def forward_step(self: Any, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
    """verl's `FSDPEngineWithLMHead.forward_step` (its own methods, in its order, under its autocast)
    with the loss left on the device while the step defers."""
    import sys
    from contextlib import nullcontext

    import torch
    from verl.utils.device import get_device_id, get_device_name

    detach_tree = sys.modules[IMPL].detach_tree  # verl's, as its forward_step calls it
    device_name = get_device_name()
    micro_batch = micro_batch.to(get_device_id())
    model_inputs, output_args = self.prepare_model_inputs(micro_batch=micro_batch)
    autocast_dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
    autocast = (
        nullcontext()
        if autocast_dtype == torch.float32
        else torch.autocast(device_type=device_name, dtype=autocast_dtype)
    )
    with autocast:
        raw_output = self.module(**model_inputs, use_cache=False)
        model_output = self.prepare_model_outputs(
            output=raw_output,
            output_args=output_args,
            micro_batch=micro_batch,
            logits_processor_func=loss_function,
        )
        if loss_function is not None:
            loss, metrics = loss_function(
                model_output=model_output, data=micro_batch, dp_group=self.get_data_parallel_group()
            )
        else:
            assert forward_only, "forward_only must be True when loss_function is None"
            loss, metrics = torch.tensor(1.0, device=device_name), {}
        output = {"model_output": detach_tree(model_output), "loss": defer(loss), "metrics": metrics}
        return loss, output


def forward_backward_batch(self: Any, data: Any, loss_function: Any, forward_only: bool = False) -> Any:
    """verl's, with the micro-batches' reads made once, after the last one is queued (or, inside
    `train_batch`, after the optimizer step)."""
    verl = VERL_METHODS["FSDPEngine.forward_backward_batch"]
    if _PENDING.get() is not None:
        return verl(self, data, loss_function, forward_only)
    with deferring() as pending:
        return read_pending(pending, verl(self, data, loss_function, forward_only))


def optimizer_step(self: Any) -> Any:
    """verl's `FSDPEngine.optimizer_step`; while a step defers, with a `found_inf`-taking optimizer the
    finiteness check is the kernel's, and the norm stays on the device for `train_batch` to read."""
    import torch

    verl = VERL_METHODS["FSDPEngine.optimizer_step"]
    pending = _PENDING.get()
    optimizer = self.optimizer
    if (
        pending is None
        or getattr(self, "scaler", None) is not None
        or getattr(self, "_qat_enabled", False)
        or not getattr(optimizer, "_step_supports_amp_scaling", False)
        or hasattr(optimizer, "found_inf")
    ):
        return verl(self)
    import sys

    impl = sys.modules[IMPL]  # the names verl's optimizer_step uses
    if not isinstance(self.module, impl.FSDPModule):  # FSDP1 and unwrapped modules: verl's step, whole
        return verl(self)
    clip = self.optimizer_config.clip_grad
    assert clip is not None
    grad_norm = impl.fsdp2_clip_grad_norm_(self.module.parameters(), max_norm=clip)
    if isinstance(grad_norm, impl.DTensor):
        grad_norm = grad_norm.full_tensor()
    optimizer.found_inf = (~torch.isfinite(grad_norm)).to(torch.float32)
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf
    pending.grad_norm = grad_norm
    return grad_norm


def train_batch(self: Any, data: Any, loss_function: Any) -> Any:
    """verl's `train_batch` with one read of the step's deferred scalars, after the optimizer is queued;
    a non-finite norm then gets verl's warning and `zero_grad` (the kernel skipped the update)."""
    import math

    verl = VERL_METHODS["FSDPEngine.train_batch"]
    with deferring() as pending:
        output = read_pending(pending, verl(self, data, loss_function))
        norm = pending.grad_norm
    if norm is None:  # verl's own optimizer step ran and returned the float
        return output
    metrics = output.get("metrics") if isinstance(output, dict) else None
    if isinstance(metrics, dict) and "grad_norm" in metrics:
        metrics["grad_norm"] = norm
    if not math.isfinite(norm):
        print(f"WARN: grad_norm is not finite: {norm}")
        self.optimizer.zero_grad()
    return output


def _patch(cls: Any, name: str, ours: Any) -> None:
    key = f"{cls.__name__}.{name}"
    current = getattr(cls, name)
    if current is ours:
        return
    VERL_METHODS.setdefault(key, current)
    setattr(cls, name, ours)


def install(module: Any) -> None:
    """Put the deferred-read methods on verl's FSDP engine classes, on `Metric` and in the policy-loss
    registry (each module when it is imported)."""
    if module.__name__ == METRIC:
        _patch(module.Metric, "append", metric_append)
        return
    if module.__name__ == CORE_ALGOS:
        registry = module.POLICY_LOSS_REGISTRY
        if registry["vanilla"] is not vanilla_policy_loss:
            VERL_METHODS.setdefault("policy_loss.vanilla", registry["vanilla"])
            registry["vanilla"] = vanilla_policy_loss
        return
    _patch(module.FSDPEngine, "train_batch", train_batch)
    _patch(module.FSDPEngine, "forward_backward_batch", forward_backward_batch)
    _patch(module.FSDPEngine, "optimizer_step", optimizer_step)
    _patch(module.FSDPEngineWithLMHead, "forward_step", forward_step)


def installed() -> bool:
    import sys

    impl = sys.modules.get(IMPL)
    return impl is not None and vars(impl.FSDPEngine).get("train_batch") is train_batch
