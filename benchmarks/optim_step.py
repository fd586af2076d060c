"""`python -m benchmarks.optim_step`: the bf16 stochastic-rounding AdamW step, torchao's per-tensor calls
against one compiled call over all tensors (engine.runtime.optim.BF16AdamW).

`--tensors` bf16 parameters of distinct shapes (the 6-layer 35B-A3B has 261), `--numel` elements in
all; each optimizer is warmed up (compiled) and then timed over `--steps` steps, synchronising the device
at the end. With small tensors the figure is the step's host time: what kept the H200 idle ~200 ms
of each bf16 step (docs/reference/trainer-levers.md). Prints one JSON line: ms per step of each, their
ratio, and the first step's seconds (compilation).
"""

from __future__ import annotations

import json
import time

from benchmarks.devices import add_device_argument, chosen_device
from engine import errors
from engine.errors import ArgumentParser, UserError


def _params(count: int, numel: int, device: str) -> list:
    import torch

    generator = torch.Generator().manual_seed(0)
    size = max(1, numel // count)
    # distinct shapes, as a model's tensors have: each gets its own compiled variant in torchao
    shapes = [(size + index,) for index in range(count)]
    return [
        torch.nn.Parameter(torch.randn(*shape, generator=generator).to(device, torch.bfloat16))
        for shape in shapes
    ]


def _timed(optimizer_cls: type, count: int, numel: int, steps: int, device: str) -> dict:
    import torch

    params = _params(count, numel, device)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = optimizer_cls(params, lr=1e-4, weight_decay=0.01, bf16_stochastic_round=True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    started = time.perf_counter()
    optimizer.step()
    sync()
    first_s = time.perf_counter() - started
    optimizer.step()  # a cache of compiled variants fully built before timing
    sync()
    started = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    sync()
    return {
        "ms_per_step": round(1000 * (time.perf_counter() - started) / steps, 2),
        "first_step_s": round(first_s, 1),
    }


def measure(count: int, numel: int, steps: int, device: str) -> dict:
    import torch
    from torchao.optim import _AdamW

    from engine.runtime.optim import BF16AdamW

    torchao = _timed(_AdamW, count, numel, steps, device)
    compiled = _timed(BF16AdamW, count, numel, steps, device)
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "tensors": count,
        "numel": numel,
        "torchao": torchao,
        "compiled": compiled,
        "speedup": round(torchao["ms_per_step"] / compiled["ms_per_step"], 2),
    }


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m benchmarks.optim_step", description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=261)
    parser.add_argument("--numel", type=int, default=261 * 256, help="elements over all tensors")
    parser.add_argument("--steps", type=int, default=20)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    if min(args.tensors, args.numel, args.steps) < 1:
        raise UserError("--tensors, --numel and --steps are counts: give each >= 1")
    device = chosen_device(args.device)
    print(json.dumps(measure(args.tensors, args.numel, args.steps, device)))
    return 0


if __name__ == "__main__":
    errors.entry(main)
