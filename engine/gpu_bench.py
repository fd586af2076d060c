"""`python -m engine bench-gpu`: training throughput and peak memory of Qwen3.5 through verl's engine.

Every configuration runs in its own `torch.distributed.run` process group, so an out-of-memory or a
kernel failure costs one row, not the table. Rows: plain FSDP2 (our own fully_shard + AdamW loop, the
ceiling) and verl's FSDP2 engine (`EngineRegistry`, GRPO's `ppo_loss`) padded and packed
(remove-padding), each with the gated-delta-net on transformers' torch fallback (`torch`) or on
flash-linear-attention with its Triton causal conv1d (`fla`). Throughput counts every token of the
batch; MFU uses 6 x text parameters x tokens/s against the device's dense bf16 peak.

`make-model` writes the random-init Qwen3.5-0.8B-shaped model (and the tiny tokenizer) the GPU recipe
and this benchmark use; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from engine.errors import UserError

console = Console(stderr=True, highlight=False)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
MODES = ("plain", "verl-padded", "verl-packed")
KERNELS = ("torch", "fla")
# Qwen3.5-0.8B text shape (the smoke recipe's model); vision tower kept small-but-real like the release.
TEXT_0P8B: dict[str, Any] = {
    "vocab_size": 248320,
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 24,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}
VISION_0P8B: dict[str, Any] = {"depth": 12, "hidden_size": 768, "intermediate_size": 3072, "num_heads": 12}


# ------------------------------------------------------------------------------------------ kernels
def fla_conv1d_fn(
    x: Any, weight: Any, bias: Any = None, activation: Any = None, seq_idx: Any = None, **_: Any
):
    """`causal_conv1d_fn` (causal-conv1d's signature, x as [B, D, T]) on fla's Triton causal conv1d.

    causal-conv1d is a CUDA source build; fla ships the same operation in Triton, varlen included:
    packed sequences arrive as `seq_idx` (sequence number per token) and go to fla as cu_seqlens.
    """
    import torch
    import torch.nn.functional as F

    if not x.is_cuda:  # the same operation in torch (what transformers does without a fast path)
        y = F.conv1d(x, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])
        y = y[..., : x.shape[-1]]
        return F.silu(y) if activation in ("silu", "swish") else y
    from fla.modules.causal_conv1d import causal_conv1d

    cu_seqlens = None
    if seq_idx is not None:
        counts = torch.bincount(seq_idx.reshape(-1).to(torch.long))
        cu_seqlens = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    y, _ = causal_conv1d(
        x.transpose(1, 2), weight=weight, bias=bias, activation=activation, cu_seqlens=cu_seqlens
    )
    return y.transpose(1, 2)


def select_kernels(kernels: str) -> str:
    """Before any Qwen3.5 model is built: hide fla (`torch`), or route the gated-delta-net through fla.

    With `fla`, each fast op dispatches on the tensor's device: CUDA tensors take fla's Triton kernels
    (conv1d included), CPU tensors (the hf rollout server, tests) keep transformers' torch code, so one
    environment serves both.
    """
    if kernels == "torch":
        for name in ("fla", "causal_conv1d"):
            sys.modules[name] = None  # type: ignore[assignment]  # find_spec() -> None: "not installed"
        return "torch fallback"
    import functools

    from fla.modules import FusedRMSNormGated
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    def on_device(fast: Any, slow: Any) -> Any:
        @functools.wraps(fast)
        def call(query: Any, *args: Any, **kwargs: Any) -> Any:
            if query.is_cuda:
                return fast(query, *args, **kwargs)
            kwargs = {k: v for k, v in kwargs.items() if not k.startswith("cu_seqlens")}
            return slow(query, *args, **kwargs)

        return call

    class GatedNorm(FusedRMSNormGated):
        def __init__(self, hidden_size: int, eps: float = 1e-6, activation: str = "swish", **_: Any) -> None:
            super().__init__(hidden_size, eps=eps, activation=activation)

        def forward(self, x: Any, g: Any, *args: Any, **kwargs: Any) -> Any:
            if x.is_cuda:
                return super().forward(x, g, *args, **kwargs)
            return qwen.Qwen3_5RMSNormGated.forward(self, x, g)  # type: ignore[arg-type]

        @property
        def variance_epsilon(self) -> float:
            return self.eps

    qwen.causal_conv1d_fn = fla_conv1d_fn
    qwen.chunk_gated_delta_rule = on_device(chunk_gated_delta_rule, qwen.torch_chunk_gated_delta_rule)
    qwen.fused_recurrent_gated_delta_rule = on_device(
        fused_recurrent_gated_delta_rule, qwen.torch_recurrent_gated_delta_rule
    )
    qwen.FusedRMSNormGated = GatedNorm
    if hasattr(qwen, "is_fast_path_available"):
        qwen.is_fast_path_available = True
    return f"fla {_version('fla-core')} + Triton conv1d (triton {_version('triton')})"


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


if os.environ.get("ENGINE_FLA_CONV1D") == "1":  # imported by verl workers through VERL_USE_EXTERNAL_MODULES
    select_kernels("fla")


# ------------------------------------------------------------------------------------------- model
def make_model(out: Path, seed: int = 0, device: str = "cpu", small: bool = False) -> Path:
    """Random-init Qwen3.5 (VL layout) in the 0.8B shape, bf16 safetensors, plus the tiny tokenizer."""
    import torch
    from transformers.models import qwen3_5

    from engine import assets

    tokenizer = assets.build_tokenizer(seed)
    text = dict(TEXT_0P8B)
    vision = dict(VISION_0P8B, out_hidden_size=text["hidden_size"])
    if small:  # CPU tests: same layer pattern and vocabulary handling, tiny widths
        text |= {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4}
        text |= {"layer_types": ["linear_attention"] * 3 + ["full_attention"], "head_dim": 16}
        text |= {"linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2}
        text |= {"linear_num_value_heads": 2}
        vision = {
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
        }
    text |= {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
    }
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in assets.SPECIAL_TOKENS}
    config = qwen3_5.Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=text["tie_word_embeddings"],
    )
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    torch.manual_seed(seed)
    with torch.device(device):
        model = qwen3_5.Qwen3_5ForConditionalGeneration(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def text_params(config: Any) -> int:
    """Parameters of the text model (embeddings included once when tied): the 6N of the MFU estimate."""
    t = config.get_text_config()
    h, layers = t.hidden_size, t.num_hidden_layers
    kinds = list(t.layer_types)
    full = h * (t.num_attention_heads * t.head_dim * 2) + 2 * h * t.num_key_value_heads * t.head_dim
    full += t.num_attention_heads * t.head_dim * h
    kd, vd = (
        t.linear_num_key_heads * t.linear_key_head_dim,
        t.linear_num_value_heads * t.linear_value_head_dim,
    )
    lin = h * (2 * kd + vd) + h * vd + 2 * h * t.linear_num_value_heads + vd * h
    lin += (2 * kd + vd) * t.linear_conv_kernel_dim
    mlp = 3 * h * t.intermediate_size
    per = sum((full if k == "full_attention" else lin) + mlp for k in kinds[:layers])
    embed = t.vocab_size * h * (1 if t.tie_word_embeddings else 2)
    return per + embed


# ------------------------------------------------------------------------------------------ workers
def _batch(vocab: int, batch: int, seq: int, device: Any, seed: int) -> Any:
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=generator).to(device)


def _plain_step_fn(model_path: str, args: argparse.Namespace, device: Any) -> tuple[Any, int]:
    """Our own FSDP2: one fully_shard per decoder layer, bf16 compute, fp32 master weights, fused AdamW."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    config = AutoConfig.from_pretrained(model_path)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation="sdpa"
    ).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.language_model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    vocab = config.get_text_config().vocab_size
    rank = int(os.environ.get("RANK", "0"))

    def step(index: int) -> None:
        ids = _batch(vocab, args.batch, args.seq, device, 1000 * rank + index)
        for micro in ids.split(args.mbs):
            model(input_ids=micro, labels=micro).loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    return step, text_params(config)


def _verl_step_fn(model_path: str, args: argparse.Namespace, packed: bool) -> tuple[Any, int]:
    """verl's FSDP2 engine as its GRPO actor update drives it: train_batch with ppo_loss."""
    from functools import partial

    import torch
    from verl import DataProto
    from verl.trainer.config import CheckpointConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    model_config = HFModelConfig(
        path=model_path,
        load_tokenizer=False,
        use_remove_padding=packed,
        enable_gradient_checkpointing=args.recompute,
        override_config={"attn_implementation": "sdpa"},
    )
    engine_config = FSDPEngineConfig(
        forward_only=False,
        strategy="fsdp2",
        fsdp_size=world,
        use_remove_padding=packed,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=args.mbs,
        max_token_len_per_gpu=args.mbs * args.seq,
        ulysses_sequence_parallel_size=1,
    )
    engine = EngineRegistry.new(
        model_type="language_model",
        backend="fsdp2",
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=FSDPOptimizerConfig(lr=1e-6, lr_scheduler_type="constant"),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    actor = ActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=args.mbs)
    loss_fn = partial(ppo_loss, config=actor)
    vocab = model_config.hf_config.get_text_config().vocab_size
    half = args.seq // 2

    def step(index: int) -> None:
        ids = _batch(vocab, args.batch, args.seq, "cpu", 1000 * rank + index)
        ones = torch.ones_like(ids)
        data = DataProto.from_single_dict(
            {
                "input_ids": ids,
                "prompts": ids[:, :half],
                "attention_mask": ones,
                "position_ids": torch.arange(args.seq).expand(args.batch, args.seq).clone(),
                "responses": ids[:, half:],
                "response_mask": ones[:, half:],
                "old_log_probs": torch.full((args.batch, args.seq - half), -12.0),
                "advantages": torch.randn(args.batch, args.seq - half),
            },
            meta_info={"temperature": 1.0},
        )
        td = left_right_2_no_padding(data.to_tensordict())
        tu.assign_non_tensor(
            td,
            global_batch_size=args.batch * world,
            use_remove_padding=packed,
            use_dynamic_bsz=False,
            max_token_len_per_gpu=args.mbs * args.seq,
            micro_batch_size_per_gpu=args.mbs,
            use_fused_kernels=False,
        )
        with engine.train_mode():
            engine.train_batch(td, loss_function=loss_fn)

    return step, text_params(model_config.hf_config)


def worker_main(argv: list[str]) -> int:
    """One configuration on every rank of a torch.distributed.run group; rank 0 appends a JSON row."""
    args = _parser().parse_args(["run", *argv])
    kernels = select_kernels(args.kernels[0])
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    mode = args.modes[0]
    if mode == "plain":
        step, n_params = _plain_step_fn(str(args.model), args, device)
    else:
        step, n_params = _verl_step_fn(str(args.model), args, packed=mode == "verl-packed")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for index in range(args.warmup):
        step(index)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    start = time.perf_counter()
    for index in range(args.steps):
        step(args.warmup + index)
    sync()
    dist.barrier()
    elapsed = (time.perf_counter() - start) / args.steps
    world = dist.get_world_size()
    peak = torch.tensor([torch.cuda.max_memory_allocated() if cuda else 0.0], device=device)
    reserved = torch.tensor([torch.cuda.max_memory_reserved() if cuda else 0.0], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    dist.all_reduce(reserved, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        tokens = args.batch * args.seq * world / elapsed
        name = torch.cuda.get_device_name() if cuda else "cpu"
        peak_tflops = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
        row = {
            "mode": mode,
            "kernels": args.kernels[0],
            "kernel_detail": kernels,
            "gpus": world,
            "batch": args.batch,
            "mbs": args.mbs,
            "seq": args.seq,
            "step_ms": round(1000 * elapsed, 1),
            "tokens_per_s": round(tokens, 1),
            "tokens_per_s_per_gpu": round(tokens / world, 1),
            "mfu": round(6 * n_params * tokens / world / (peak_tflops * 1e12), 4) if peak_tflops else None,
            "peak_alloc_gib": round(float(peak) / 1024**3, 2),
            "peak_reserved_gib": round(float(reserved) / 1024**3, 2),
            "text_params": n_params,
            "device": name,
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "verl": _version("verl"),
        }
        with open(args.out, "a") as handle:
            handle.write(json.dumps(row) + "\n")
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------- driver
def run_matrix(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (mode, kernels) pair in a fresh process group; failures become rows with the last error line."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for kernels in args.kernels:
        for mode in args.modes:
            before = args.out.read_text().count("\n") if args.out.exists() else 0
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={args.gpus}",
            ]
            cmd += ["-m", "engine.gpu_bench", "_worker", "--model", str(args.model), "--out", str(args.out)]
            cmd += ["--modes", mode, "--kernels", kernels, "--batch", str(args.batch), "--mbs", str(args.mbs)]
            cmd += ["--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup)]
            cmd += ["--recompute"] if args.recompute else []
            label = f"{mode}/{kernels} x{args.gpus} b{args.batch} mbs{args.mbs} s{args.seq}"
            console.print(f"[bold]bench[/bold] {label}")
            started = time.monotonic()
            log = args.out.with_suffix(f".{mode}.{kernels}.g{args.gpus}.b{args.batch}.m{args.mbs}.log")
            with log.open("w") as handle:
                try:
                    code = subprocess.run(
                        cmd, stdout=handle, stderr=subprocess.STDOUT, timeout=args.timeout
                    ).returncode
                except subprocess.TimeoutExpired:
                    code = f"timeout after {args.timeout:.0f} s"
            lines = args.out.read_text().splitlines() if args.out.exists() else []
            if code == 0 and len(lines) > before:
                row = json.loads(lines[-1])
            else:
                tail = [ln for ln in log.read_text(errors="replace").splitlines() if "Error" in ln][-1:]
                row = {"mode": mode, "kernels": kernels, "gpus": args.gpus, "batch": args.batch}
                row |= {
                    "mbs": args.mbs,
                    "seq": args.seq,
                    "error": (tail or [f"exit {code}"])[0],
                }
                with args.out.open("a") as handle:
                    handle.write(json.dumps(row) + "\n")
            row["wall_s"] = round(time.monotonic() - started, 1)
            rows.append(row)
            console.print(f"  {_cell(row)}")
    return rows


def _cell(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"failed: {row['error'][:160]}"
    mfu = f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "-"
    speed = f"{row['tokens_per_s']:,.0f} tok/s, {row['step_ms']:,.0f} ms/step"
    return f"{speed}, MFU {mfu}, peak {row['peak_alloc_gib']} GiB"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The table docs/performance.md carries."""
    head = "| run | kernels | GPUs | batch/mbs/seq | tokens/s | tokens/s/GPU | step ms | MFU | peak GiB |\n"
    head += "|---|---|---|---|---|---|---|---|---|\n"
    body = []
    for r in rows:
        shape = f"{r['batch']}/{r['mbs']}/{r['seq']}"
        if "error" in r:
            body.append(
                f"| {r['mode']} | {r['kernels']} | {r['gpus']} | {shape} | failed: {r['error'][:80]} |||||"
            )
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        body.append(
            f"| {r['mode']} | {r['kernels']} | {r['gpus']} | {shape} | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s_per_gpu']:,.0f} | {r['step_ms']:,.0f} | {mfu} | {r['peak_alloc_gib']} |"
        )
    return head + "\n".join(body) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine bench-gpu", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    mk = sub.add_parser("make-model", help="write the random-init Qwen3.5-0.8B-shaped model + tokenizer")
    mk.add_argument("--out", type=Path, required=True)
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--small", action="store_true", help="tiny widths (tests on CPU)")
    run = sub.add_parser("run", help="run the benchmark matrix")
    run.add_argument("--model", type=Path, required=True, help="model directory (make-model writes one)")
    run.add_argument("--out", type=Path, default=Path("results/bench-gpu/bench.jsonl"))
    run.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    run.add_argument("--kernels", type=lambda s: s.split(","), default=list(KERNELS))
    run.add_argument("--gpus", type=int, default=1)
    run.add_argument("--batch", type=int, default=4, help="sequences per GPU per step")
    run.add_argument("--mbs", type=int, default=4, help="micro-batch per GPU")
    run.add_argument("--seq", type=int, default=2048)
    run.add_argument("--steps", type=int, default=3, help="timed steps")
    run.add_argument("--warmup", type=int, default=1)
    run.add_argument("--recompute", action="store_true", help="gradient checkpointing")
    run.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    return parser


def _validate(args: argparse.Namespace) -> None:
    bad = [m for m in args.modes if m not in MODES] + [k for k in args.kernels if k not in KERNELS]
    if bad:
        raise UserError(f"unknown --modes/--kernels {bad}; choose from {list(MODES)} and {list(KERNELS)}")
    if min(args.gpus, args.batch, args.mbs, args.seq, args.steps) < 1 or args.warmup < 0:
        raise UserError("--gpus, --batch, --mbs, --seq and --steps must be positive (--warmup >= 0)")
    if args.batch % args.mbs:
        raise UserError(f"--batch {args.batch} is not a multiple of --mbs {args.mbs}; make it one")
    if args.seq < 2:
        raise UserError("--seq must be at least 2 (half prompt, half response)")
    if not (args.model / "config.json").is_file():
        raise UserError(
            f"--model {args.model}: no config.json; write one with `bench-gpu make-model --out DIR`"
        )


def cli_main(argv: list[str]) -> int:
    if argv[:1] == ["_worker"]:
        return worker_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.action == "make-model":
        import torch

        device = "cuda" if torch.cuda.is_available() and not args.small else "cpu"
        path = make_model(args.out, args.seed, device, small=args.small)
        print(f"model {path}")
        return 0
    _validate(args)
    rows = run_matrix(args)
    table = Table(title=f"bench-gpu ({args.out})")
    for column in ("run", "kernels", "GPUs", "b/mbs/seq", "result"):
        table.add_column(column)
    for r in rows:
        table.add_row(
            r["mode"], r["kernels"], str(r["gpus"]), f"{r['batch']}/{r['mbs']}/{r['seq']}", _cell(r)
        )
    console.print(table)
    md = args.out.with_suffix(".md")
    md.write_text(markdown_table(rows))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))
