"""`python -m benchmarks.gdn_grad`: are fla's gated-delta-rule gradients right with the installed Triton?

fla #640: with Triton >= 3.4.0, < 3.7.1 the chunk backward gives wrong db/dg on Hopper. fla 0.5.2 and
0.6.0 both refuse that backward; this measures what the refusal protects against and whether a stack
computes correct gradients: fla's `chunk_gated_delta_rule` (bf16 inputs, Qwen3.5's GDN head sizes)
against transformers' torch implementation in fp32 on the same inputs, as relative errors
||grad_fla - grad_ref|| / ||grad_ref|| for q, k, v, g and beta. `--bypass-guard` runs the refused
kernel anyway (measurement only). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys


def measure(batch: int, length: int, heads: int, dim: int, bypass_guard: bool, seed: int) -> dict:
    import torch
    import triton
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    if bypass_guard:
        import fla.ops.common.chunk_o as chunk_o

        chunk_o.TRITON_ABOVE_3_7_1 = True
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen)

    base = {
        "q": rand(batch, length, heads, dim),
        "k": rand(batch, length, heads, dim),
        "v": rand(batch, length, heads, dim),
        "g": torch.nn.functional.logsigmoid(rand(batch, length, heads)),
        "beta": torch.sigmoid(rand(batch, length, heads)),
    }
    weight = rand(batch, length, heads, dim)
    grads = {}
    for name, dtype in (("fla", torch.bfloat16), ("ref", torch.float32)):
        inputs = {k: v.to(dtype).requires_grad_(True) for k, v in base.items()}
        fn = chunk_gated_delta_rule if name == "fla" else torch_chunk_gated_delta_rule
        out, _ = fn(
            inputs["q"], inputs["k"], inputs["v"], g=inputs["g"], beta=inputs["beta"],
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        (out.float() * weight).sum().backward()
        grads[name] = {k: v.grad.float() for k, v in inputs.items()}
    errors = {k: ((grads["fla"][k] - grads["ref"][k]).norm() / grads["ref"][k].norm()).item() for k in base}
    return {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fla": __import__("fla").__version__,
        "device": torch.cuda.get_device_name(),
        "bypass_guard": bypass_guard,
        "shape": [batch, length, heads, dim],
        "rel_error": errors,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gdn_grad", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bypass-guard", action="store_true", help="run the backward fla refuses")
    args = parser.parse_args(argv)
    try:
        result = measure(args.batch, args.length, args.heads, args.dim, args.bypass_guard, args.seed)
    except RuntimeError as err:
        result = {"refused": str(err).splitlines()[0]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
