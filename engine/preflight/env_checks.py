"""`preflight --check-env`: what needs the machine: paths, imports, patch targets, versions, pins."""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import importlib.util
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from engine.preflight.plan_checks import check_rollout_env
from engine.recipes.models import compare_config
from engine.recipes.plan import Plan

HOPPER = ("H100", "H200", "H800", "H20", "GH200")
# flash-linear-attention #640: Triton >= 3.4.0, < 3.7.1 give wrong gated-delta-rule gradients on Hopper.
BAD_TRITON_ON_HOPPER = (Version("3.4.0"), Version("3.7.1"))


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


def resolve(dotted: str) -> bool:
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
        if not resolve(t)
    ]


def transformers_range(plan: Plan | None = None) -> list[str]:
    try:
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
        triton = Version(metadata.version("triton"))
    except metadata.PackageNotFoundError:
        return []
    low, high = BAD_TRITON_ON_HOPPER
    if not (low <= triton < high) or _is_hopper() is False:
        return []
    return [
        f"flash-linear-attention with Triton {triton} computes wrong gated-delta-rule "
        "gradients on Hopper GPUs (fla #640); install Triton >= 3.7.1 or the tilelang backend"
    ]


def _pins(plan: Plan) -> list[str]:
    try:
        from engine.env import pins
    except ImportError:
        return []
    stack = pins.stack_for(plan.recipe.cluster.device)
    launch_env = {**os.environ, **plan.env}  # what verl's processes will see: the plan exports its own
    return [f"pins: {line}" for line in pins.drift(stack, env=launch_env)]


def _lever_imports(plan: Plan) -> list[str]:
    """bf16_sr's optimizer is torchao's: the pinned version must be where verl runs (extra `levers`)."""
    if plan.recipe.actor.optim.precision != "bf16_sr":
        return []
    if importlib.util.find_spec("torchao") is None:
        return [
            "actor.optim.precision=bf16_sr needs torchao (its _AdamW), not importable here: "
            "pip install -e '.[levers]' (or the wheel in the GPU wheelhouse)"
        ]
    return []


ENV_CHECKS: list[Callable[[Plan], list[str]]] = [
    check_paths,
    check_rollout_env,
    _fsdp_turbo,
    _patch_targets,
    transformers_range,
    _kernel_pairing,
    _pins,
    _lever_imports,
]
