"""`python -m benchmarks.packed_syncs`: device syncs and time of one packed gated-delta-net layer on a GPU.

verl's packed Qwen3.5 forward (verl.models.transformers.qwen3_5) on one layer of the 0.8B, fla kernels
(engine.runtime.kernels.select_kernels), forward and backward over `--seqs` sequences of `--length`
tokens, in two ways: the conv1d takes the packed lengths verl hands the layer (`forwarded`, what runs)
or derives them from `seq_idx` (`derived`, before). A sync stalls the host until the device drains, so
the host's launch latency is no longer hidden behind device work. Prints one JSON line: syncs counted by
torch's sync debug mode, ms per forward+backward, and the largest output and gradient difference
between the two ways (same kernels on the same lengths: 0).
"""

from __future__ import annotations

import json
import warnings
from typing import Any

from engine import errors
from engine.errors import ArgumentParser, UserError


class _Forgetful(list):
    """A stand-in for the lengths stack that never holds anything: the `derived` way."""

    def append(self, item: Any) -> None:
        pass

    def pop(self, index: int = -1) -> Any:
        return None


def _count_syncs(run: Any) -> int:
    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught)


def _time_ms(run: Any, repeats: int) -> float:
    import torch

    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        run()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / repeats


def _layer_step(
    layer: Any, hidden: Any, cu_seqlens: Any, cu_seqlens_cpu: Any, outputs: dict, way: str
) -> Any:
    """One forward and backward of the layer; its output and input gradient kept under `way`."""
    x = hidden.detach().requires_grad_(True)

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out = layer(x, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        out.float().square().mean().backward()
        outputs[way] = (out.detach(), x.grad.detach())

    return step


def measure(seqs: int, length: int, repeats: int) -> dict:
    import torch
    import transformers
    from verl.models.transformers.qwen3_5 import qwen3_5_gated_delta_net_forward

    from engine.recipes import models
    from engine.runtime import kernels

    detail = kernels.select_kernels("fla")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    qwen.Qwen3_5GatedDeltaNet.forward = qwen3_5_gated_delta_net_forward  # what verl's monkey patch does
    config = transformers.AutoConfig.for_model("qwen3_5_text", **models.lookup("Qwen3.5-0.8B").text_config())
    torch.manual_seed(0)
    layer = qwen.Qwen3_5GatedDeltaNet(config, layer_idx=0).to("cuda", torch.bfloat16)
    hidden = torch.randn(1, seqs * length, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    cu_seqlens_cpu = torch.arange(0, seqs * length + 1, length)
    cu_seqlens = cu_seqlens_cpu.to("cuda")
    if _count_syncs(lambda: torch.ones(1, device="cuda").item()) < 1:  # the counter itself, on a known sync
        raise UserError("torch's sync debug mode reported no sync for .item(); the counts would read 0")
    results: dict[str, Any] = {}
    outputs = {}
    stack = kernels._PACKED_LENGTHS
    for way in ("forwarded", "derived"):
        kernels._PACKED_LENGTHS = stack if way == "forwarded" else _Forgetful()
        step = _layer_step(layer, hidden, cu_seqlens, cu_seqlens_cpu, outputs, way)
        step()  # Triton compiles and autotunes (which syncs) on the first call
        torch.cuda.synchronize()
        results[way] = {"syncs": _count_syncs(step), "ms": round(_time_ms(step, repeats), 3)}
    kernels._PACKED_LENGTHS = stack
    out_diff = (outputs["forwarded"][0].float() - outputs["derived"][0].float()).abs().max().item()
    grad_diff = (outputs["forwarded"][1].float() - outputs["derived"][1].float()).abs().max().item()
    return {
        "kernels": detail,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": {"seqs": seqs, "length": length, "hidden": config.hidden_size},
        **results,
        "max_abs_diff": {"output": out_diff, "input_grad": grad_diff},
    }


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m benchmarks.packed_syncs", description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if min(args.seqs, args.length, args.repeats) < 1:
        raise UserError("--seqs, --length and --repeats count sequences, tokens and runs: give each >= 1")
    import torch

    if not torch.cuda.is_available():
        raise UserError("benchmarks.packed_syncs needs a CUDA GPU (fla's Triton kernels); run it on one")
    print(json.dumps(measure(args.seqs, args.length, args.repeats)))
    return 0


if __name__ == "__main__":
    errors.entry(main)
