"""Trainer-speed levers: opt-in recipe settings, the verl keys they render, and named bundles of them.

Every lever is an ordinary recipe field (so `--set` reaches it and run.json records it); this module
names bundles of them for `--levers` and for `python -m benchmarks.gpu_bench run --levers`, and turns
the optimizer fields into verl's keys in one place (the plan and the benchmark both use it). At their
defaults the fields render nothing, so recipes that match upstream keep rendering what upstream does.
What each lever changes and what it costs: docs/reference/trainer-levers.md.
"""

from __future__ import annotations

from typing import Any

from engine.errors import UserError
from engine.recipes.schema import Actor, Optim, Recipe

# verl's optimizer that keeps bf16 weights and moments and writes the fp32 update back with stochastic
# rounding (verl's build_optimizer documents it: optimizer_impl torchao.optim, _AdamW, bf16_stochastic_round).
TORCHAO_IMPL, TORCHAO_ADAMW = "torchao.optim", "_AdamW"
# the same update traced once over all tensors of a group (engine.runtime.optim): not host-bound
COMPILED_IMPL, COMPILED_ADAMW = "engine.runtime.optim", "BF16AdamW"

# the text-only lever's switch in the launch's environment, read in verl's processes (engine.runtime.vision)
TEXT_ONLY_ENV = "ENGINE_TEXT_ONLY"
# the compiled-logprobs lever's switch, read where token log-probs are computed (engine.runtime.kernels)
LOGPROBS_ENV = "ENGINE_LOGPROBS"
# how verl's step reads the device (engine.runtime.syncs): lean (the default), verl or deferred
HOST_SYNCS_ENV = "ENGINE_HOST_SYNCS"
# the switches the plan writes from recipe fields: a recipe's `env` setting one would run what the record
# (the field) does not say
FIELD_ENV = {
    TEXT_ONLY_ENV: "model.text_only",
    LOGPROBS_ENV: "actor.logprobs_kernel",
    HOST_SYNCS_ENV: "actor.host_syncs",
}


def field_environment(r: Recipe) -> dict[str, str]:
    """The FIELD_ENV switches the recipe's fields turn on, each read in verl's processes (engine.runtime's
    vision, kernels and syncs); the fields at their defaults write none. A recipe's `env` may not set
    them: the record keeps the field, and the run would do what the environment says."""
    for name, owner in FIELD_ENV.items():
        if name in r.env:
            raise UserError(f"env.{name}: written from the recipe field {owner}; set {owner} instead")
    env: dict[str, str] = {}
    if r.model.text_only:
        env[TEXT_ONLY_ENV] = "1"
    if r.actor.logprobs_kernel != "chunked":
        env[LOGPROBS_ENV] = r.actor.logprobs_kernel
    if r.actor.host_syncs != "lean":
        env[HOST_SYNCS_ENV] = r.actor.host_syncs
    return env


# name -> (recipe --set assignments, what it is for). Later names win where two set the same field.
LEVERS: dict[str, tuple[dict[str, Any], str]] = {
    "baseline": ({}, "verl's trainer defaults: fp32 master weights, torch's AdamW kernels, reshard, sync"),
    "foreach": ({"actor.optim.implementation": "foreach"}, "AdamW's foreach kernels asked for explicitly"),
    "fused": ({"actor.optim.implementation": "fused"}, "AdamW in one fused kernel: no fp32 temporaries"),
    "no-reshard": (
        {"actor.reshard_after_forward": False},
        "keep the gathered bf16 parameters from forward to backward: one gather (and cast) per step, not two",
    ),
    "no-sync": (
        {"actor.defer_gradient_sync": True},
        "reduce a step's gradients once, after its last micro-batch, not after each",
    ),
    "bf16-reduce": (
        {"actor.reduce_dtype": "bf16"},
        "reduce gradients in bf16, as computed: no cast before the reduce-scatter (nor back, with bf16-sr)",
    ),
    "bf16-sr": (
        {"actor.optim.precision": "bf16_sr"},
        "bf16 weights, gradients and moments, fp32 update with stochastic rounding: no cast at gather",
    ),
    "bf16-sr-compiled": (
        {"actor.optim.precision": "bf16_sr", "actor.optim.implementation": "compiled"},
        "bf16-sr with its step traced once over all tensors, not one compiled call (a cache walk) per tensor",
    ),
    "varlen-attn": (
        {"model.attn_implementation": "torch_varlen"},
        "attention per packed sequence with torch's varlen flash kernel, not SDPA under a block mask",
    ),
    "sdpa-no-cudnn": (
        {"model.attn_implementation": "sdpa_no_cudnn"},
        "SDPA under its mask without cuDNN's kernel, which builds a graph for every new packed length",
    ),
    "text-only": (
        {"model.text_only": True},
        "text batches skip verl's placeholder pass through the vision tower (data without images)",
    ),
    "compiled-logprobs": (
        {"actor.logprobs_kernel": "compiled"},
        "token log-probs in two compiled kernels per chunk of rows, not separate fp32 passes per step",
    ),
    "fast": (
        {"actor.optim.implementation": "fused", "actor.reshard_after_forward": False},
        "fused + no-reshard: the exact-numerics bundle for one GPU",
    ),
    "fast-text": (
        {
            "actor.optim.implementation": "fused",
            "actor.reshard_after_forward": False,
            "model.attn_implementation": "torch_varlen",
            "model.text_only": True,
            "actor.logprobs_kernel": "compiled",
        },
        "fast + varlen-attn + text-only + compiled-logprobs: packed text data, fp32 master weights "
        "(verl's dense step at 1.007x plain FSDP2 on one H100)",
    ),
    "fast-text-bf16": (
        {
            "actor.optim.precision": "bf16_sr",
            "actor.optim.implementation": "compiled",
            "actor.reshard_after_forward": False,
            "actor.reduce_dtype": "bf16",
            "model.attn_implementation": "torch_varlen",
            "model.text_only": True,
            "actor.logprobs_kernel": "compiled",
        },
        "fast-bf16-reduce + bf16-sr-compiled + varlen-attn + text-only + compiled-logprobs: packed text "
        "data, bf16 weights and moments (the 35B-A3B-6L step at 15.3% MFU on one H100)",
    ),
    "fast-bf16": (
        {"actor.optim.precision": "bf16_sr", "actor.reshard_after_forward": False},
        "bf16-sr + no-reshard: the smallest-memory, fewest-casts bundle",
    ),
    "fast-bf16-reduce": (
        {
            "actor.optim.precision": "bf16_sr",
            "actor.reshard_after_forward": False,
            "actor.reduce_dtype": "bf16",
        },
        "fast-bf16 + bf16-reduce: no dtype cast left in a step on one GPU",
    ),
}


# FSDP's mixed precision with gradients reduced in bf16 (verl's FSDPEngineConfig.mixed_precision; its
# default is param bf16, reduce fp32, buffers fp32)
BF16_REDUCE = {"param_dtype": "bf16", "reduce_dtype": "bf16", "buffer_dtype": "fp32"}
# fsdp_config keys of FSDPEngineConfig that verl's trainer yaml leaves out: rendered with Hydra's `+`
ADDED_FSDP_KEYS = frozenset({"mixed_precision"})


def fsdp_keys(defer_gradient_sync: bool, reduce_dtype: str) -> dict[str, Any]:
    """verl keys under `fsdp_config` for the gradient levers; empty at the defaults. The one mapping the
    plan renders and the benchmarks build verl's engine from."""
    keys: dict[str, Any] = {}
    if defer_gradient_sync:
        keys["use_no_sync_for_gradient_accumulation"] = True
    if reduce_dtype == "bf16":
        keys["mixed_precision"] = dict(BF16_REDUCE)
    return keys


def lever_names(text: str) -> list[str]:
    """`fused,no-reshard` -> the names, each checked; `fast+no-sync` is one name made of two levers
    (for the benchmark, whose rows are one name each)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [part for name in names for part in name.split("+") if part not in LEVERS]
    if unknown or not names:
        choices = ", ".join(LEVERS)
        raise UserError(f"--levers {text!r}: unknown lever {unknown or text!r}; choose from {choices}")
    return names


def lever_sets(names: list[str]) -> list[str]:
    """The `--set KEY=VALUE` items of the levers, in order (a later lever wins)."""
    fields = lever_fields(names)
    return [
        f"{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in fields.items()
    ]


def canonical(text: str) -> str:
    """One spelling of what a row's `--levers` name sets (`fast` and `fused+no-reshard` alike): the
    recipe assignments sorted by field, `baseline` where none; the name itself where it is not a lever
    name (rows recorded under a name since retired)."""
    try:
        fields = lever_fields(lever_names(text))
    except UserError:
        return text
    return "+".join(f"{key}={value}" for key, value in sorted(fields.items())) or "baseline"


def lever_fields(names: list[str]) -> dict[str, Any]:
    """Recipe field -> value of the levers together (a later one wins)."""
    merged: dict[str, Any] = {}
    for name in names:
        for part in name.split("+"):
            merged |= LEVERS[part][0]
    return merged


def optimizer_keys(optim: Optim) -> dict[str, Any]:
    """verl keys under `actor_rollout_ref.actor` for the optimizer levers; empty at the defaults.

    fp32 master weights: torch's AdamW, with `fused`/`foreach` passed through override_optimizer_config
    (verl's build_optimizer sets neither). bf16_sr: the model is loaded in bf16 and torchao's _AdamW
    updates it (default), or the same update traced over all tensors at once (compiled); torch's kernel
    choices do not apply there, nor does `compiled` to fp32 weights (fused is their one-kernel step).
    """
    keys: dict[str, Any] = {}
    if optim.precision == "bf16_sr":
        if optim.optimizer != "AdamW" or optim.implementation not in ("default", "compiled"):
            raise UserError(
                f"actor.optim.precision=bf16_sr needs optimizer AdamW with implementation default or "
                f"compiled (got {optim.optimizer}, {optim.implementation}): torchao's _AdamW has its own "
                "kernel; set actor.optim.implementation=default"
            )
        compiled = optim.implementation == "compiled"
        keys["fsdp_config.model_dtype"] = "bf16"
        keys["optim.optimizer_impl"] = COMPILED_IMPL if compiled else TORCHAO_IMPL
        keys["optim.optimizer"] = COMPILED_ADAMW if compiled else TORCHAO_ADAMW
        keys["optim.override_optimizer_config"] = {"bf16_stochastic_round": True}
    elif optim.implementation == "compiled":
        raise UserError(
            "actor.optim.implementation=compiled is the bf16_sr step (set actor.optim.precision=bf16_sr); "
            "for fp32 weights use implementation=fused"
        )
    elif optim.implementation != "default":
        keys["optim.override_optimizer_config"] = {optim.implementation: True}
    return keys


def attn_implementation(names: list[str], default: str = "sdpa") -> str:
    """The attention the levers select for the model (`override_config.attn_implementation`), else
    `default` (the GPU recipes' sdpa): for driving verl's engine without a recipe."""
    return lever_fields(names).get("model.attn_implementation", default)


def text_only(names: list[str]) -> bool:
    """Whether the levers skip the vision tower's placeholder pass (`model.text_only`)."""
    return bool(lever_fields(names).get("model.text_only", False))


def logprobs_kernel(names: list[str]) -> str:
    """How the levers have token log-probs computed (`actor.logprobs_kernel`): chunked or compiled."""
    return str(lever_fields(names).get("actor.logprobs_kernel", "chunked"))


def engine_config_kwargs(names: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(FSDPEngineConfig, FSDPOptimizerConfig) keyword arguments of the levers, exactly the keys a recipe
    with them renders: for driving verl's engine without a recipe (the benchmarks)."""
    merged = lever_fields(names)
    optim_fields = {
        k.removeprefix("actor.optim."): v for k, v in merged.items() if k.startswith("actor.optim.")
    }
    engine: dict[str, Any] = {}
    if "actor.reshard_after_forward" in merged:
        engine["reshard_after_forward"] = merged["actor.reshard_after_forward"]
    defaults = Actor.model_fields
    engine |= fsdp_keys(
        merged.get("actor.defer_gradient_sync", defaults["defer_gradient_sync"].default),
        merged.get("actor.reduce_dtype", defaults["reduce_dtype"].default),
    )
    optimizer: dict[str, Any] = {}
    for key, value in optimizer_keys(Optim(lr=1.0, **optim_fields)).items():
        section, _, field = key.partition(".")
        (engine if section == "fsdp_config" else optimizer)[field] = value
    return engine, optimizer
