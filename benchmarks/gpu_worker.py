"""One benchmark configuration on every rank of a `torch.distributed.run` group (see benchmarks.gpu_bench).

Run as `python -m torch.distributed.run ... -m benchmarks.gpu_worker ARGS` by `bench-gpu run`; the model
is built once and each shape of `--shapes` measured in turn; rank 0 appends one JSON row per shape.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from benchmarks.gpu_bench import (
    PEAK_TFLOPS,
    Shape,
    build_parser,
    flops_params,
    model_tag,
    shapes_of,
)
from benchmarks.host_syncs import profile_step
from benchmarks.phase_clock import PhaseClock, phase_lines
from engine.env.pins import dist_version
from engine.recipes.levers import (
    LOGPROBS_ENV,
    attn_implementation,
    engine_config_kwargs,
    logprobs_kernel,
    text_only,
)
from engine.runtime import reads, syncs
from engine.runtime.kernels import LOGPROBS_CALLS, select_kernels


def _batch(vocab: int, batch: int, seq: int, device: Any, seed: int) -> Any:
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=generator).to(device)


def _response_mask(fill: float, batch: int, seq: int, half: int, seed: int) -> Any:
    """Attention mask with full prompts and response lengths uniform in [fill, 1] x the response half.

    `--fill 1` is every token real (no padding to remove); below 1 it is a GRPO-like batch of ragged
    responses, right-padded, where packing (remove-padding) has work to skip.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    share = fill + (1 - fill) * torch.rand(batch, generator=generator)
    lengths = (share * (seq - half)).round().clamp(min=1).long()
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[:, half:] = (torch.arange(seq - half) < lengths[:, None]).long()
    return mask


def applied_settings(module: Any, optimizer: Any) -> dict[str, Any]:
    """What the step really ran with, read back from the model and optimizer (not from the arguments):
    the row's evidence that a lever took effect."""
    param = next(module.parameters())
    kernel = next((k for k in ("fused", "foreach") if optimizer.defaults.get(k)), "default")
    states = [t for state in optimizer.state.values() for t in state.values() if getattr(t, "ndim", 0) > 0]
    from torch.distributed.fsdp import FSDPModule

    inner = [m for m in module.modules() if isinstance(m, FSDPModule) and m is not module]
    group = getattr(inner[0]._get_fsdp_state(), "_fsdp_param_group", None) if inner else None
    # FSDP2 keeps a post-forward mesh only when it reshards after forward (a private field: None if gone)
    reshard = None if group is None else getattr(group, "post_forward_mesh_info", None) is not None
    # gradients reduce in reduce_dtype, else in the dtype they are computed in (FSDP2 clamps equal ones
    # to None): param_dtype, else the parameter's own
    first = group.fsdp_params[0] if group is not None and group.fsdp_params else None
    reduce = None if first is None else first.reduce_dtype or first.param_dtype or first.orig_dtype
    return {
        "optimizer": f"{type(optimizer).__module__}.{type(optimizer).__name__}",
        "optimizer_kernel": kernel,
        "param_dtype": str(param.dtype).removeprefix("torch."),
        "state_dtype": str(states[0].dtype).removeprefix("torch.") if states else None,
        "reshard_after_forward": reshard,
        "grad_reduce_dtype": None if reduce is None else str(reduce).removeprefix("torch."),
        "attn_implementation": getattr(getattr(module, "config", None), "_attn_implementation", None),
        "vision_tower_stepped": _vision_stepped(module, optimizer),
        # token_logprobs calls by kernel in this process; empty: verl computed log-probs itself
        "logprobs_calls": dict(LOGPROBS_CALLS),
    }


def _vision_stepped(module: Any, optimizer: Any) -> bool | None:
    """Whether the optimizer holds state for the vision tower (verl's placeholder pass gives it zero
    gradients; the text-only lever none); None for a model without one."""
    tower = [p for name, p in module.named_parameters() if ".visual." in f".{name}"]
    return any(p in optimizer.state for p in tower) if tower else None


def _plain_step_fn(
    model_path: str, args: argparse.Namespace, device: Any, clock: PhaseClock
) -> tuple[Any, int, Any]:
    """Our own FSDP2: one fully_shard per decoder layer, bf16 compute, fp32 master weights, fused AdamW."""
    import torch
    import transformers
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    config = transformers.AutoConfig.from_pretrained(model_path)
    model_cls = getattr(transformers, config.architectures[0])  # Qwen3_5(Moe)ForConditionalGeneration
    model = model_cls.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa").to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.language_model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    clock.attach(model, optim)
    vocab = config.get_text_config().vocab_size
    rank = int(os.environ.get("RANK", "0"))

    def step(index: int, shape: Shape) -> int:
        clock.begin_step()
        batch, mbs, seq = shape
        ids = _batch(vocab, batch, seq, device, 1000 * rank + index)
        for micro in ids.split(mbs):
            loss = model(input_ids=micro, labels=micro).loss
            clock.mark("backward")
            loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        clock.end_step()
        return ids.numel()

    return step, flops_params(config), lambda: {"model": model_tag(config)} | applied_settings(model, optim)


def build_verl_engine(
    model_path: str,
    packed: bool,
    mbs: int,
    seq: int,
    recompute: bool,
    levers: list[str],
    lr: float = 1e-6,
    engine_overrides: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """verl's FSDP2 engine as its GRPO actor builds it, with the levers' settings as a recipe renders them
    (engine.recipes.levers) and any `engine_overrides` (controls that are no lever): (engine,
    model_config). Gradient sync per micro-batch as verl's trainer config has it
    (use_no_sync_for_gradient_accumulation: false)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    from engine.runtime import attention, vision

    attention.register()  # as engine.verl_ext does in every verl process of `engine run`
    vision.install()
    # read at every forward: this engine's steps run with its own setting (the numerics check builds
    # engines with and without the lever, one after the other, in one process)
    os.environ[vision.ENV] = "1" if text_only(levers) else "0"
    os.environ[LOGPROBS_ENV] = logprobs_kernel(levers)
    engine_levers, optimizer_levers = engine_config_kwargs(levers)
    engine_levers |= engine_overrides or {}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model_config = HFModelConfig(
        path=model_path,
        load_tokenizer=False,
        use_remove_padding=packed,
        enable_gradient_checkpointing=recompute,
        override_config={"attn_implementation": attn_implementation(levers)},
    )
    settings = {"use_no_sync_for_gradient_accumulation": False} | engine_levers  # verl trainer's default
    engine_config = FSDPEngineConfig(
        forward_only=False,
        strategy="fsdp2",
        fsdp_size=world,
        use_remove_padding=packed,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=mbs,
        max_token_len_per_gpu=mbs * seq,
        ulysses_sequence_parallel_size=1,
        **settings,
    )
    engine = EngineRegistry.new(
        model_type="language_model",
        backend="fsdp2",
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=FSDPOptimizerConfig(lr=lr, lr_scheduler_type="constant", **optimizer_levers),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine, model_config


def verl_batch(ids: Any, mask: Any, advantages: Any, world: int, mbs: int, packed: bool) -> Any:
    """The TensorDict verl's actor update passes to train_batch: half prompt, half response."""
    import torch
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    batch, seq = ids.shape
    half = seq // 2
    data = DataProto.from_single_dict(
        {
            "input_ids": ids,
            "prompts": ids[:, :half],
            "attention_mask": mask,
            "position_ids": torch.arange(seq).expand(batch, seq).clone(),
            "responses": ids[:, half:],
            "response_mask": mask[:, half:],
            "old_log_probs": torch.full((batch, seq - half), -12.0),
            "advantages": advantages,
        },
        meta_info={"temperature": 1.0},
    )
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(
        td,
        global_batch_size=batch * world,
        use_remove_padding=packed,
        use_dynamic_bsz=False,
        max_token_len_per_gpu=mbs * seq,
        micro_batch_size_per_gpu=mbs,
        use_fused_kernels=False,
    )
    return td


def _verl_step_fn(
    model_path: str, args: argparse.Namespace, packed: bool, clock: PhaseClock
) -> tuple[Any, int, Any]:
    """verl's FSDP2 engine as its GRPO actor update drives it: train_batch with ppo_loss."""
    from functools import partial

    import torch
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    if args.logprobs == "chunked":  # what engine.verl_ext does in every verl process of `engine run`
        from engine.runtime.kernels import install_token_logprobs

        install_token_logprobs()
    if args.host_syncs != "verl":  # engine.runtime.syncs, as engine.verl_ext installs it
        syncs.install_host_syncs()
    if syncs.installed() != (args.host_syncs != "verl") or syncs.selected() != args.host_syncs:
        raise RuntimeError(f"--host-syncs {args.host_syncs} and {syncs.ENV}={syncs.selected()} disagree")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    _, first_mbs, first_seq = shapes_of(args)[0]  # each step passes its own micro-batch to the engine
    engine, model_config = build_verl_engine(
        model_path, packed, first_mbs, first_seq, args.recompute, args.levers
    )
    if reads.installed() != (args.host_syncs == "deferred"):
        raise RuntimeError(f"--host-syncs {args.host_syncs}: verl's engine steps are not what it names")
    actor = ActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=first_mbs)
    loss_fn = clock.attach(engine.module, engine.optimizer, partial(ppo_loss, config=actor))
    vocab = model_config.hf_config.get_text_config().vocab_size

    def step(index: int, shape: Shape) -> int:
        clock.begin_step()
        batch, mbs, seq = shape
        half = seq // 2
        ids = _batch(vocab, batch, seq, "cpu", 1000 * rank + index)
        mask = _response_mask(args.fill, batch, seq, half, 1000 * rank + index)
        td = verl_batch(ids, mask, torch.randn(batch, seq - half), world, mbs, packed)
        with engine.train_mode():
            engine.train_batch(td, loss_function=loss_fn)
        clock.end_step()
        return int(mask.sum())

    tag = model_tag(model_config.hf_config)
    sync = {"defer_gradient_sync": engine.engine_config.use_no_sync_for_gradient_accumulation}
    settings = lambda: {"model": tag} | applied_settings(engine.module, engine.optimizer) | sync  # noqa: E731
    return step, flops_params(model_config.hf_config), settings


def _measure(
    step: Any, shape: Shape, first: int, args: argparse.Namespace, cuda: bool, clock: PhaseClock
) -> tuple[int, float]:
    """Warm-up steps, then the timed ones, their phases clocked: (non-padding tokens per rank, s/step)."""
    import torch
    import torch.distributed as dist

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for index in range(args.warmup):
        step(first + index, shape)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    clock.start()
    start = time.perf_counter()
    real_tokens = sum(step(first + args.warmup + index, shape) for index in range(args.steps))
    sync()
    clock.stop()
    dist.barrier()
    return real_tokens, (time.perf_counter() - start) / args.steps


def _row(shape: Shape, tokens: float, elapsed: float, n_params: int, args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    peak = torch.tensor([torch.cuda.max_memory_allocated() if cuda else 0.0], device=device)
    reserved = torch.tensor([torch.cuda.max_memory_reserved() if cuda else 0.0], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    dist.all_reduce(reserved, op=dist.ReduceOp.MAX)
    world = dist.get_world_size()
    per_gpu = tokens * world / args.steps / elapsed / world  # non-padding tokens (same count per rank)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak_tflops = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    batch, mbs, seq = shape
    mode = args.modes[0]
    return {
        "mode": mode,
        "kernels": args.kernels[0],
        "levers": args.levers[0],
        "repeat": args.repeat,
        "kernel_detail": select_kernels(args.kernels[0]),
        "logprobs": args.logprobs if mode != "plain" else "model loss",
        "host_syncs": args.host_syncs if mode != "plain" else None,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") if cuda else None,
        "gpus": world,
        "batch": batch,
        "mbs": mbs,
        "seq": seq,
        "fill": args.fill,
        "step_ms": round(1000 * elapsed, 1),
        "tokens_per_s": round(per_gpu * world, 1),
        "tokens_per_s_per_gpu": round(per_gpu, 1),
        "tflops_per_gpu": round(6 * n_params * per_gpu / 1e12, 2),
        "mfu": round(6 * n_params * per_gpu / (peak_tflops * 1e12), 4) if peak_tflops else None,
        "peak_alloc_gib": round(float(peak) / 1024**3, 2),
        "peak_reserved_gib": round(float(reserved) / 1024**3, 2),
        "flops_params": n_params,
        "device": name,
        "torch": torch.__version__,
        "transformers": dist_version("transformers"),
        "verl": dist_version("verl"),
    }


def worker_main(argv: list[str]) -> int:
    """One configuration on every rank of a torch.distributed.run group; rank 0 writes a row per shape."""
    args = build_parser().parse_args(["run", *argv])
    select_kernels(args.kernels[0])
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    mode, clock = args.modes[0], PhaseClock(cuda)
    if mode == "plain":
        step, n_params, settings = _plain_step_fn(str(args.model), args, device, clock)
    else:
        step, n_params, settings = _verl_step_fn(str(args.model), args, mode == "verl-packed", clock)
    shapes = shapes_of(args)
    for number, shape in enumerate(shapes):
        tokens, elapsed = _measure(step, shape, 100 * number, args, cuda, clock)
        row = _row(shape, tokens, elapsed, n_params, args) | settings() | {"phases": clock.summary()}
        if dist.get_rank() == 0:
            print(f"phases of {mode} {shape}:\n{phase_lines(row['phases'])}", flush=True)
            with open(args.out, "a") as handle:
                handle.write(json.dumps(row) + "\n")
    if args.profile is not None:
        profile_step(step, 100 * len(shapes), shapes[-1], args, mode, cuda)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
