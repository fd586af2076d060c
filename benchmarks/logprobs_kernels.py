"""`python -m benchmarks.logprobs_kernels`: the project's token log-probs of one micro-batch, chunked eager
passes against the compiled kernels of the compiled-logprobs lever (engine.runtime.kernels).

Random logits of `--rows` tokens over a `--vocab` vocabulary (default: one 4 x 2,048 micro-batch of
Qwen3.5), forward and backward of `token_logprobs` weighted per token, as the policy loss uses it. Each
kernel is warmed up (the compiled one compiles) and then timed over `--repeats` calls, synchronising the
device at the end. Prints one JSON line: ms per forward+backward of each, their ratio, the first call's
seconds, and how far the compiled log-probs and gradients are from the chunked ones.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from benchmarks.devices import add_device_argument, chosen_device
from engine import errors
from engine.errors import ArgumentParser, UserError
from engine.recipes.levers import LOGPROBS_ENV


def _timed(kernel: str, logits: Any, labels: Any, weights: Any, repeats: int) -> tuple[dict, Any, Any]:
    import torch

    from engine.runtime.kernels import token_logprobs

    os.environ[LOGPROBS_ENV] = kernel
    sync = torch.cuda.synchronize if logits.is_cuda else (lambda: None)

    def call() -> tuple[Any, Any]:
        leaf = logits.detach().requires_grad_()
        out = token_logprobs(leaf, labels)
        (out * weights).sum().backward()
        return out.detach(), leaf.grad

    started = time.perf_counter()
    out, grad = call()
    sync()
    first_s = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    sync()
    figures = {
        "ms": round(1000 * (time.perf_counter() - started) / repeats, 2),
        "first_call_s": round(first_s, 1),
    }
    return figures, out, grad


def measure(rows: int, vocab: int, repeats: int, device: str) -> dict:
    import torch

    generator = torch.Generator(device=device).manual_seed(0)
    logits = (4 * torch.randn(rows, vocab, generator=generator, device=device)).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), generator=generator, device=device)
    weights = torch.randn(rows, generator=generator, device=device)
    chunked, out_c, grad_c = _timed("chunked", logits, labels, weights, repeats)
    compiled, out_f, grad_f = _timed("compiled", logits, labels, weights, repeats)
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "rows": rows,
        "vocab": vocab,
        "chunked": chunked,
        "compiled": compiled,
        "speedup": round(chunked["ms"] / compiled["ms"], 2),
        "max_abs_logprob_diff": float((out_f - out_c).abs().max()),
        "max_abs_grad_diff": float((grad_f.float() - grad_c.float()).abs().max()),
    }


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m benchmarks.logprobs_kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192, help="tokens of the micro-batch")
    parser.add_argument("--vocab", type=int, default=248320)
    parser.add_argument("--repeats", type=int, default=5)
    add_device_argument(parser)
    args = parser.parse_args(argv)
    if min(args.rows, args.vocab, args.repeats) < 1:
        raise UserError("--rows, --vocab and --repeats are counts: give each >= 1")
    device = chosen_device(args.device)
    print(json.dumps(measure(args.rows, args.vocab, args.repeats, device)))
    return 0


if __name__ == "__main__":
    errors.entry(main)
