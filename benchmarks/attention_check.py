"""`python -m benchmarks.attention_check`: `torch_varlen` against transformers' masked SDPA on one packed row.

The model's own forward and backward (no verl, no FSDP) on one row of `--seqs` sequences of `--seq`
tokens with position ids restarting at each, in the model's dtype, first with `sdpa` (transformers builds
the block-diagonal mask), then with `torch_varlen` (engine.runtime.attention; torch's varlen flash
kernel on a GPU). Prints the differences (logits, and the gradients as a relative L2 norm over all of
them, and the parameter that differs most) and each implementation's forward+backward time; one JSON
line to `--out`. Exit 1 when the logits' or all gradients' relative difference exceeds `--tolerance`:
bf16 kernels that round differently stay well inside 5%; attention across the sequence boundaries is
off by far more. A single small parameter's gradient (a sum with much cancellation, e.g. the gated-delta
rule's `A_log`) can differ by tens of percent from rounding alone, so it is reported, not gated.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from engine import errors, fsutil
from engine.errors import ArgumentParser


def fwd_bwd(model: Any, ids: Any, positions: Any) -> tuple[Any, dict[str, Any]]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    logits.float().square().mean().backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().float(), grads


def timed(model: Any, ids: Any, positions: Any, repeats: int) -> float:
    """Median seconds of forward+backward, after one untimed call."""
    import torch

    times = []
    for index in range(repeats + 1):
        torch.cuda.synchronize() if ids.is_cuda else None
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        model(
            input_ids=ids, position_ids=positions, use_cache=False
        ).logits.float().square().mean().backward()
        torch.cuda.synchronize() if ids.is_cuda else None
        if index:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def check(model_path: Path, seqs: int, seq: int, device: str, repeats: int) -> dict[str, Any]:
    import torch
    import transformers

    from engine.runtime import attention

    attention.register()
    config = transformers.AutoConfig.from_pretrained(model_path)
    model_cls = getattr(transformers, config.architectures[0])
    model = model_cls.from_pretrained(model_path, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    vocab = config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, seqs * seq), generator=generator).to(device)
    positions = torch.arange(seq).repeat(seqs)[None].to(device)
    found: dict[str, Any] = {}
    for name in ("sdpa", attention.NAME):
        model.set_attn_implementation(name)
        found[name] = (*fwd_bwd(model, ids, positions), timed(model, ids, positions, repeats))
    (ref_logits, ref_grads, ref_s), (logits, grads, s) = found["sdpa"], found[attention.NAME]
    relative = {
        n: float((grads[n] - g).norm() / g.norm()) for n, g in ref_grads.items() if float(g.norm()) > 0
    }
    worst = max(relative, key=relative.__getitem__)
    return {
        "model": str(model_path), "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "torch": torch.__version__, "dtype": "bfloat16", "seqs": seqs, "seq": seq,
        "logits_max_abs_diff": float((logits - ref_logits).abs().max()),
        "logits_max_abs": float(ref_logits.abs().max()),
        "logits_rel_l2": float((logits - ref_logits).norm() / ref_logits.norm()),
        "grad_rel_l2_max": relative[worst], "grad_rel_l2_worst_param": worst,
        "grad_rel_l2_global": float(
            sum((grads[n] - g).square().sum() for n, g in ref_grads.items()).sqrt()
            / sum(g.square().sum() for g in ref_grads.values()).sqrt()
        ),
        "sdpa_fwd_bwd_ms": round(1000 * ref_s, 2), "varlen_fwd_bwd_ms": round(1000 * s, 2),
    }  # fmt: skip


def cli_main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m benchmarks.attention_check", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a model directory (engine make-model)")
    parser.add_argument("--seqs", type=int, default=4, help="sequences packed into the row")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=5, help="timed forward+backward calls each")
    parser.add_argument("--tolerance", type=float, default=0.05, help="largest relative difference")
    parser.add_argument("--out", type=Path, default=None, help="append the JSON line here")
    args = parser.parse_args(argv)
    row = check(args.model, args.seqs, args.seq, args.device, args.repeats)
    row["tolerance"] = args.tolerance
    row["ok"] = max(row["logits_rel_l2"], row["grad_rel_l2_global"]) <= args.tolerance
    print(json.dumps(row))
    if args.out is not None:
        previous = args.out.read_text() if args.out.exists() else ""
        fsutil.atomic_write(args.out, previous + json.dumps(row) + "\n")
    return 0 if row["ok"] else 1


if __name__ == "__main__":
    errors.entry(cli_main)
