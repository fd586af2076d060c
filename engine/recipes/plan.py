"""Recipe -> verl launch: Hydra overrides, environment and command, in the order of the upstream scripts.

Each verl key is emitted from exactly one place. Actor and ref share the FSDPTurbo block through one
loop over the roles, and the module-glob plans come from the model family (engine.recipes.models), so a
Qwen3.5 and a Qwen3.5-MoE plan can never disagree by a typo.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from engine.errors import UserError
from engine.recipes.hydra import Override
from engine.recipes.levers import ADDED_FSDP_KEYS, field_environment, fsdp_keys, optimizer_keys
from engine.recipes.models import Family, ModelSpec, lookup
from engine.recipes.schema import Recipe

ARF = "actor_rollout_ref"
ENTRYPOINT = ("-m", "verl.trainer.main_ppo")
EXTERNAL_MODULE = "engine.verl_ext"
# `ray.init` arguments that size the local Ray verl starts on one node. On N > 1 nodes verl joins the
# cluster `engine cluster` brought up (RAY_ADDRESS), whose resources `ray start` declares, and Ray
# refuses every one of them there ("When connecting to an existing cluster, num_cpus and num_gpus must
# not be provided"): the plan leaves them out, whether a recipe, a profile or --set gave them.
LOCAL_RAY_INIT = tuple(
    f"ray_kwargs.ray_init.{name}"
    for name in (
        "num_cpus",
        "num_gpus",
        "resources",
        "labels",
        "object_store_memory",
        "_system_config",
        "_enable_object_reconstruction",
        "_node_name",
    )
)


@dataclass
class Plan:
    recipe: Recipe
    model: ModelSpec
    entries: list[Override]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def overrides(self) -> list[str]:
        return [entry.text for entry in self.entries]

    @property
    def command(self) -> list[str]:
        return [sys.executable, *ENTRYPOINT, *self.overrides]

    @property
    def world_size(self) -> int:
        return self.recipe.cluster.nodes * self.recipe.cluster.devices_per_node

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different samples: CP ranks share a sample, verl SP ranks too."""
        return self.world_size // (self.recipe.parallel.cp * self.recipe.parallel.verl_sp)

    def value(self, key: str) -> Any:
        """The value emitted for a verl key (the first one, for actor/ref pairs ask the full key)."""
        for entry in self.entries:
            if entry.key == key:
                return entry.value
        raise KeyError(key)

    def digest(self) -> str:
        return overrides_digest(self.overrides)


def overrides_digest(overrides: list[str]) -> str:
    """The identity of a launch: the same hash in `render --format json` and in the provenance record."""
    return hashlib.sha256("\n".join(overrides).encode()).hexdigest()


def _path(text: str) -> str:
    """Absolute, expanded paths: Ray workers do not share the driver's working directory."""
    expanded = os.path.expanduser(os.path.expandvars(text))
    return str(Path(expanded).absolute()) if not Path(expanded).is_absolute() else expanded


def _reward_file(spec: str) -> tuple[str, str]:
    module, _, function = spec.partition(":")
    if not function:
        raise UserError(f"reward.custom_function '{spec}': expected 'module:function' or 'file.py:function'")
    if module.endswith(".py"):
        return _path(module), function
    try:
        found = find_spec(module)
    except (ImportError, ValueError):  # a parent package is missing, or the name is malformed
        found = None
    if found is None or found.origin is None:
        raise UserError(
            f"reward.custom_function: module '{module}' is not importable; install it or fix the name"
        )
    return found.origin, function


def _data(r: Recipe) -> list[Override]:
    d = r.data
    entries = [
        Override("algorithm.adv_estimator", r.algorithm.adv_estimator),
        Override("algorithm.use_kl_in_reward", r.algorithm.use_kl_in_reward),
        Override("data.train_files", _path(d.train_files)),
        Override("data.val_files", _path(d.val_files)),
        Override("data.train_batch_size", d.train_batch_size),
        Override("data.max_prompt_length", d.max_prompt_length),
        Override("data.max_response_length", d.max_response_length),
        Override("data.filter_overlong_prompts", d.filter_overlong_prompts),
        Override("data.truncation", d.truncation),
    ]
    if d.image_key is not None:
        entries.append(Override("data.image_key", d.image_key))
    entries.append(Override("data.shuffle", d.shuffle))
    if d.dataloader_num_workers is not None:
        entries.append(Override("data.dataloader_num_workers", d.dataloader_num_workers))
    return entries


def _model(r: Recipe) -> list[Override]:
    entries = [
        Override(f"{ARF}.model.path", _path(r.model.path)),
        Override(f"{ARF}.model.use_remove_padding", r.model.use_remove_padding),
        Override(f"{ARF}.model.enable_gradient_checkpointing", r.model.gradient_checkpointing),
    ]
    if r.model.attn_implementation is not None:
        key = f"{ARF}.model.override_config.attn_implementation"
        entries.append(Override(key, r.model.attn_implementation, "+"))
    return entries


def _turbo(r: Recipe, family: Family, role: str) -> list[Override]:
    """The FSDPTurbo block; identical for actor and ref (the upstream scripts set both)."""
    t = f"{ARF}.{role}.fsdp_config.turbo_config"
    p = r.parallel
    entries = [Override(f"{t}.distributed.fully_shard_parallel_size", p.fsdp)]
    if p.ep > 1:
        entries.append(Override(f"{t}.distributed.expert_parallel_size", p.ep))
    entries += [
        Override(f"{t}.distributed.ulysses_parallel_size", p.cp),
        Override(f"{t}.distributed.fsdp_plan.apply_modules", {m: {} for m in family.fsdp_apply_modules}, "+"),
        Override(f"{t}.distributed.fsdp_plan.hook_modules", list(family.hook_modules), "+"),
    ]
    if p.ep > 1:
        entries += [
            Override(f"{t}.distributed.ep_plan.apply_modules", list(family.expert_modules), "+"),
            Override(f"{t}.distributed.ep_plan.dispatcher", p.ep_dispatcher, "+"),
        ]
    if r.turbo.recompute:
        entries += [
            Override(f"{t}.memory.recompute", True, "+"),
            Override(f"{t}.memory.recompute_plan", list(family.recompute_modules), "+"),
        ]
    return entries


def _turbo_cp(family: Family, role: str) -> list[Override]:
    t = f"{ARF}.{role}.fsdp_config.turbo_config"
    return [
        Override(f"{t}.distributed.cp_plan.ulysses_function_patches", family.ulysses_function_patches(), "+"),
        Override(f"{t}.distributed.cp_plan.loss_function_patches", family.loss_function_patches(), "+"),
        Override(f"{t}.module_patches", family.module_patches(), "+"),
    ]


def _actor(r: Recipe, family: Family) -> list[Override]:
    a, actor = r.actor, f"{ARF}.actor"
    levers = optimizer_keys(a.optim)  # opt-in trainer levers; nothing at their defaults
    entries = [
        Override(f"{actor}.optim.lr", a.optim.lr),
        Override(f"{actor}.optim.optimizer", levers.pop("optim.optimizer", a.optim.optimizer)),
        Override(f"{actor}.ppo_mini_batch_size", a.ppo_mini_batch_size),
        Override(f"{actor}.ppo_micro_batch_size_per_gpu", a.ppo_micro_batch_size_per_device),
        Override(f"{actor}.use_kl_loss", a.use_kl_loss),
        Override(f"{actor}.entropy_coeff", a.entropy_coeff),
        Override(f"{actor}.kl_loss_coef", a.kl_loss_coef),
        Override(f"{actor}.kl_loss_type", a.kl_loss_type),
        Override(f"{actor}.use_dynamic_bsz", a.use_dynamic_bsz),
        Override(f"{actor}.strategy", a.strategy),
    ]
    if a.strategy == "fsdp_turbo":
        entries += _turbo(r, family, "actor")
    entries += [
        Override(f"{actor}.fsdp_config.reshard_after_forward", a.reshard_after_forward),
        Override(f"{actor}.fsdp_config.entropy_checkpointing", a.entropy_checkpointing),
        Override(f"{actor}.entropy_from_logits_with_chunking", a.entropy_from_logits_with_chunking),
        Override(f"{actor}.use_torch_compile", a.use_torch_compile),
        Override(f"{actor}.fsdp_config.offload_policy", a.offload_policy),
        Override(f"{actor}.fsdp_config.param_offload", a.param_offload),
        Override(f"{actor}.fsdp_config.optimizer_offload", a.optimizer_offload),
    ]
    for key, value in fsdp_keys(a.defer_gradient_sync, a.reduce_dtype).items():
        entries.append(Override(f"{actor}.fsdp_config.{key}", value, "+" if key in ADDED_FSDP_KEYS else ""))
    entries += [Override(f"{actor}.{key}", value) for key, value in levers.items()]
    if a.strategy != "fsdp_turbo":
        entries.append(Override(f"{actor}.fsdp_config.fsdp_size", r.parallel.fsdp))
    if r.trainer.save_hf_model:
        contents = ["model", "optimizer", "extra", "hf_model"]
        entries.append(Override(f"{actor}.checkpoint.save_contents", contents))
    if a.strategy == "fsdp_turbo" and r.parallel.cp > 1:
        entries += _turbo_cp(family, "actor")
    return entries


def _ref(r: Recipe, family: Family) -> list[Override]:
    f, ref = r.ref, f"{ARF}.ref"
    entries = [
        Override(f"{ref}.log_prob_micro_batch_size_per_gpu", f.log_prob_micro_batch_size_per_device),
        Override(f"{ref}.strategy", r.actor.strategy),
    ]
    if r.actor.strategy == "fsdp_turbo":
        entries += _turbo(r, family, "ref")
    entries += [
        Override(f"{ref}.fsdp_config.reshard_after_forward", f.reshard_after_forward),
        Override(f"{ref}.entropy_from_logits_with_chunking", f.entropy_from_logits_with_chunking),
        Override(f"{ref}.use_torch_compile", f.use_torch_compile),
        Override(f"{ref}.fsdp_config.offload_policy", f.offload_policy),
        Override(f"{ref}.fsdp_config.param_offload", f.param_offload),
    ]
    if r.actor.strategy == "fsdp_turbo" and r.parallel.cp > 1:
        entries += _turbo_cp(family, "ref")
    return entries


def _flatten(prefix: str, tree: dict[str, Any]) -> list[tuple[str, Any]]:
    leaves: list[tuple[str, Any]] = []
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            leaves += _flatten(f"{prefix}.{key}", value)
        else:
            leaves.append((f"{prefix}.{key}", value))
    return leaves


def _rollout(r: Recipe) -> list[Override]:
    o, ro = r.rollout, f"{ARF}.rollout"
    entries = [
        Override(f"{ro}.name", o.name),
        Override(f"{ro}.ignore_eos", o.ignore_eos),
        Override(f"{ro}.log_prob_micro_batch_size_per_gpu", o.log_prob_micro_batch_size_per_device),
        Override(f"{ro}.tensor_model_parallel_size", r.parallel.rollout_tp),
        Override(f"{ro}.gpu_memory_utilization", o.gpu_memory_utilization),
        Override(f"{ro}.n", o.n),
        Override(f"{ro}.enable_chunked_prefill", o.enable_chunked_prefill),
        Override(f"{ro}.max_num_batched_tokens", o.max_num_batched_tokens),
        Override(f"{ro}.free_cache_engine", o.free_cache_engine),
        Override(f"{ro}.enforce_eager", o.enforce_eager),
        Override(f"{ro}.enable_prefix_caching", o.enable_prefix_caching),
    ]
    if o.update_weights_bucket_megabytes is not None:
        key = f"{ro}.checkpoint_engine.update_weights_bucket_megabytes"
        entries.append(Override(key, o.update_weights_bucket_megabytes))
    for key, value in _flatten(f"{ro}.engine_kwargs.vllm", o.vllm_engine_kwargs):
        entries.append(Override(key, value, "+"))
    return entries


def _reward(r: Recipe) -> list[Override]:
    if r.reward.custom_function is None:
        return []
    path, name = _reward_file(r.reward.custom_function)
    return [
        Override("reward.custom_reward_function.path", path),
        Override("reward.custom_reward_function.name", name),
    ]


def _trainer(r: Recipe) -> list[Override]:
    t = r.trainer
    entries = [
        Override("trainer.critic_warmup", t.critic_warmup),
        Override("trainer.logger", list(t.logger)),
        Override("trainer.project_name", t.project_name),
        Override("trainer.experiment_name", t.experiment_name),
        Override("trainer.n_gpus_per_node", r.cluster.devices_per_node),
        Override("trainer.nnodes", r.cluster.nodes),
        Override("trainer.balance_batch", t.balance_batch),
        Override("trainer.val_before_train", t.val_before_train),
        Override("trainer.save_freq", t.save_freq),
        Override("trainer.test_freq", t.test_freq),
        Override("trainer.total_epochs", t.total_epochs),
    ]
    if t.total_training_steps is not None:
        entries.append(Override("trainer.total_training_steps", t.total_training_steps))
    entries += [
        Override("trainer.default_local_dir", _path(t.checkpoint_dir)),
        Override("trainer.resume_mode", t.resume_mode),
    ]
    if t.max_actor_ckpt_to_keep is not None:
        entries.append(Override("trainer.max_actor_ckpt_to_keep", t.max_actor_ckpt_to_keep))
    if r.cluster.device == "cpu":
        entries.append(Override("trainer.device", "cpu"))
        if r.cluster.nodes == 1:
            # verl counts only GPU/NPU resources: CPU ranks are declared to Ray as logical GPU slots
            # (on N nodes `engine cluster` declares them at `ray start`)
            entries.append(Override("ray_kwargs.ray_init.num_gpus", r.cluster.devices_per_node, "+"))
    return entries


def _extra(r: Recipe) -> list[Override]:
    entries = []
    for raw_key, value in r.verl_overrides.items():
        prefix = raw_key[: len(raw_key) - len(raw_key.lstrip("+"))]
        if prefix not in ("", "+", "++"):
            raise UserError(f"verl_overrides '{raw_key}': prefix must be '', '+' or '++'")
        key = raw_key[len(prefix) :]
        if r.cluster.nodes > 1 and any(key == k or key.startswith(f"{k}.") for k in LOCAL_RAY_INIT):
            continue
        entries.append(Override(key, value, prefix))
    return entries


def _environment(r: Recipe) -> dict[str, str]:
    env = dict(r.env)
    modules = [m for m in env.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m]
    if EXTERNAL_MODULE not in modules:
        modules.append(EXTERNAL_MODULE)
    env["VERL_USE_EXTERNAL_MODULES"] = ",".join(modules)
    return env | field_environment(r)


def compile_recipe(recipe: Recipe) -> Plan:
    model = lookup(recipe.model.name)
    family = model.family
    rendered = [
        *_data(recipe),
        *_model(recipe),
        *_actor(recipe, family),
        *_ref(recipe, family),
        *_rollout(recipe),
        *_reward(recipe),
        *_trainer(recipe),
    ]
    fields = {e.key for e in rendered}
    entries = rendered + _extra(recipe)
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        if entry.key in seen:
            raise UserError(
                f"verl key '{entry.key}' is emitted twice by the recipe's fields; report this"
                if i < len(rendered)
                else f"verl_overrides.{entry.key}: a recipe field renders this key too (a lever's, or the "
                "recipe's own); remove it from verl_overrides, or leave that field at its default"
                if entry.key in fields
                else f"verl_overrides.{entry.key}: named twice, under different '+' prefixes; keep one"
            )
        seen.add(entry.key)
        try:
            entry.text  # noqa: B018 - fail here, with the key named, not in the middle of a render
        except ValueError as err:
            raise UserError(f"verl key '{entry.key}': {err}") from None
    return Plan(recipe=recipe, model=model, entries=entries, env=_environment(recipe))


def _script(plan: Plan) -> str:
    r = plan.recipe
    lines = [
        "#!/usr/bin/env bash",
        f"# {r.name} on {r.cluster.device}: {r.description}",
        f"# {r.cluster.nodes} node(s) x {r.cluster.devices_per_node} {r.cluster.device}(s); "
        f"generated by `python -m engine render {r.name} --device {r.cluster.device} --format script`",
        "set -euo pipefail",
        "",
    ]
    lines += [f"export {key}={shlex.quote(value)}" for key, value in plan.env.items()]
    lines += ["", f'exec "${{PYTHON:-python3}}" {" ".join(ENTRYPOINT)} \\']
    lines += [f"    {shlex.quote(text)} \\" for text in plan.overrides]
    lines.append('    "$@"')
    return "\n".join(lines) + "\n"


def render(plan: Plan, fmt: str) -> str:
    if fmt == "overrides":
        return "".join(f"{text}\n" for text in plan.overrides)
    if fmt == "script":
        return _script(plan)
    if fmt == "json":
        doc = {
            "recipe": plan.recipe.name,
            "device": plan.recipe.cluster.device,
            "world_size": plan.world_size,
            "env": plan.env,
            "entrypoint": ["python3", *ENTRYPOINT],
            "overrides": plan.overrides,
            "overrides_sha256": plan.digest(),
        }
        return json.dumps(doc, indent=2) + "\n"
    raise UserError(f"--format {fmt}: choose overrides, script or json")
