"""Checks on a plan before any allocation: what verl, FSDPTurbo or the hardware would reject hours later.

Each check is a small function of the plan returning problems (one line each, naming the key and the
fix). `check_env` adds what needs the machine: paths, imports, patch targets, versions.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import importlib.util
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from engine.errors import UserError
from engine.preflight.memory import memory_estimate
from engine.recipes.models import compare_config
from engine.recipes.plan import Plan

HOPPER = ("H100", "H200", "H800", "H20", "GH200")
# flash-linear-attention #640: Triton >= 3.4.0, < 3.7.1 give wrong gated-delta-rule gradients on Hopper.
BAD_TRITON_ON_HOPPER = ((3, 4, 0), (3, 7, 1))


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
]


def check_paths(plan: Plan) -> list[str]:
    model_dir = Path(plan.value("actor_rollout_ref.model.path"))
    problems = []
    if not (model_dir / "config.json").is_file():
        problems.append(f"model.path {model_dir}: no config.json there; download the model or fix model.path")
    else:
        problems += compare_config(plan.model, model_dir)
    for key in ("data.train_files", "data.val_files"):
        path = Path(plan.value(key))
        if not path.is_file():
            problems.append(
                f"{key} {path}: file not found; run `python -m engine prepare-data` or fix the path"
            )
    return problems


def _fsdp_turbo(plan: Plan) -> list[str]:
    if plan.recipe.actor.strategy != "fsdp_turbo" or importlib.util.find_spec("fsdp_turbo"):
        return []
    return [
        "actor.strategy=fsdp_turbo but the fsdp_turbo package is not importable; use the project's "
        "GPU/Ascend image (it installs FSDPTurbo at the pinned commit) or pip install it from its git"
        " repository"
    ]


def _resolve(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def _patch_targets(plan: Plan) -> list[str]:
    if plan.recipe.actor.strategy != "fsdp_turbo" or plan.recipe.parallel.cp == 1:
        return []
    targets = plan.model.family.patch_targets()
    if importlib.util.find_spec("fsdp_turbo"):
        targets += [p["replacement"] for p in plan.model.family.module_patches()]
    return [
        f"CP patch target {t} does not resolve in the installed packages; pin a transformers that has it"
        for t in targets
        if not _resolve(t)
    ]


def _version_tuple(text: str) -> tuple[int, ...]:
    digits = []
    for part in text.split("+")[0].split(".")[:3]:
        num = "".join(ch for ch in part if ch.isdigit())
        digits.append(int(num or 0))
    return tuple(digits)


def _transformers_range(plan: Plan | None = None) -> list[str]:
    try:
        from packaging.requirements import Requirement

        requirements = [Requirement(req) for req in metadata.requires("verl") or []]
        installed = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return []
    for req in requirements:
        if req.name == "transformers" and req.marker is None and not req.specifier.contains(installed, True):
            return [
                f"transformers {installed} is outside verl's supported range {req.specifier}; "
                f"install a transformers in that range (the pinned image has one)"
            ]
    return []


def _is_hopper() -> bool | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return any(tag in out for tag in HOPPER)


def _kernel_pairing(plan: Plan) -> list[str]:
    if plan.recipe.cluster.device != "gpu":
        return []
    try:
        metadata.version("flash-linear-attention")
        triton = _version_tuple(metadata.version("triton"))
    except metadata.PackageNotFoundError:
        return []
    low, high = BAD_TRITON_ON_HOPPER
    if not (low <= triton < high) or _is_hopper() is False:
        return []
    return [
        f"flash-linear-attention with Triton {'.'.join(map(str, triton))} computes wrong gated-delta-rule "
        "gradients on Hopper GPUs (fla #640); install Triton >= 3.7.1 or the tilelang backend"
    ]


def _pins(plan: Plan) -> list[str]:
    try:
        from engine.env import pins
    except ImportError:
        return []
    stack = (
        os.environ.get("ENGINE_STACK")
        or {"gpu": "gpu", "npu": "ascend-a3", "cpu": "cpu"}[plan.recipe.cluster.device]
    )
    launch_env = {**os.environ, **plan.env}  # what verl's processes will see: the plan exports its own
    return [f"pins: {line}" for line in pins.drift(stack, env=launch_env)]


ENV_CHECKS: list[Callable[[Plan], list[str]]] = [
    check_paths,
    check_rollout_env,
    _fsdp_turbo,
    _patch_targets,
    _transformers_range,
    _kernel_pairing,
    _pins,
]


def check(plan: Plan, check_env: bool = False) -> list[str]:
    checks = PLAN_CHECKS + (ENV_CHECKS if check_env else [])
    return [problem for run in checks for problem in run(plan)]


def require_ok(plan: Plan, paths: bool = False, rollout_env: bool = False) -> None:
    """For commands that launch or orchestrate: the plan checks (and the paths, and whether this
    environment can run the rollout engine) as one UserError."""
    problems = check(plan) + (check_paths(plan) if paths else [])
    problems += check_rollout_env(plan) if rollout_env else []
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise UserError(
            "preflight: " + "; ".join(problems[:3]) + more + "; fix the recipe or --set (see `preflight`)"
        )
