"""bf16 AdamW with stochastic rounding whose whole step is one compiled call: the `compiled` optimizer
implementation of `actor.optim.precision=bf16_sr`.

torchao's `_AdamW` runs `torch.compile(single_param_adam)` once per parameter tensor. With hundreds of
tensors of distinct shapes each call walks dynamo's cache of compiled variants before it launches one
kernel, so on an H200 its step spanned 172-219 ms of host time for 31 ms of kernels (the 6-layer
35B-A3B, 261 tensors; docs/reference/trainer-levers.md). `BF16AdamW` is that optimizer with the same
update per tensor (torchao's own `single_param_adam`) traced once over all of a group's tensors: one
guard check and one launch pass per step. verl builds it like any optimizer it is named
(`optim.optimizer_impl=engine.runtime.optim`, `optim.optimizer=BF16AdamW`); its state is torchao's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torchao.optim import _AdamW
from torchao.optim.adam import single_param_adam


def _local(tensor: Any) -> Any:
    """A DTensor's shard (the update is elementwise, so shards update alone), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def all_params_adam(
    params: list[Any],
    grads: list[Any],
    steps: list[Any],
    exp_avgs: list[Any],
    exp_avg_sqs: list[Any],
    lr: Any,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    stochastic_round: bool,
) -> None:
    """torchao's AdamW update for every tensor of a group, in one traced function."""
    for p, grad, step, exp_avg, exp_avg_sq in zip(params, grads, steps, exp_avgs, exp_avg_sqs, strict=True):
        single_param_adam(
            p,
            grad,
            step,
            exp_avg,
            exp_avg_sq,
            None,
            lr,
            beta1,
            beta2,
            weight_decay,
            eps,
            True,
            stochastic_round,
        )


class BF16AdamW(_AdamW):
    """torchao's `_AdamW` (AdamW, fp32 arithmetic, bf16 stochastic rounding of bf16 weights) stepping all
    of a parameter group's tensors in one compiled call instead of one per tensor."""

    def __init__(self, params: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        if any(group["amsgrad"] for group in self.param_groups):
            raise ValueError("BF16AdamW: amsgrad is not supported; use torchao.optim._AdamW")
        self._step_fn = torch.compile(all_params_adam, fullgraph=True, dynamic=False)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                raise RuntimeError(
                    "BF16AdamW: change lr with param_groups[i]['lr'].fill_(new_lr), as torchao's"
                )
            batch: dict[str, list[Any]] = {"params": [], "grads": [], "steps": [], "m": [], "v": []}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("BF16AdamW: sparse gradients are not supported")
                state = self.state[p]
                if not state:  # torchao's layout, so its checkpoints and ours are one format
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = self._new_buffer(p, True)
                    state["exp_avg_sq"] = self._new_buffer(p, False)
                state["step"] += 1
                batch["params"].append(_local(p.detach()))
                batch["grads"].append(_local(p.grad))
                batch["steps"].append(state["step"])
                batch["m"].append(_local(state["exp_avg"]))
                batch["v"].append(_local(state["exp_avg_sq"]))
            if not batch["params"]:
                continue
            rounding = self.bf16_stochastic_round and all(p.dtype is torch.bfloat16 for p in batch["params"])
            beta1, beta2 = group["betas"]
            with torch._dynamo.utils.disable_cache_limit():
                self._step_fn(
                    batch["params"], batch["grads"], batch["steps"], batch["m"], batch["v"],
                    group["lr"], beta1, beta2, group["weight_decay"], group["eps"], rounding,
                )  # fmt: skip
        return loss
