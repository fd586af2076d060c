"""Recipes: one YAML file describes one full run; device profiles layer the device defaults under it.

Layering, lowest first: `recipes/profiles/<device>.yaml`, then the `extends:` chain (base first), then
`--set` paths. Every field is typed; an unknown key anywhere is an error with a "did you mean".
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine.errors import UserError
from engine.fsutil import UniqueKeyLoader, read_text, yaml_problem

Device = Literal["gpu", "npu", "cpu"]
Scalar = str | int | float | bool | None
HydraValue = Scalar | list[Any] | dict[str, Any]
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Model(Section):
    name: str = Field(description="model registry key (engine/recipes/models.py), e.g. Qwen3.5-35B-A3B")
    path: str = Field(
        min_length=1, description="local directory of the Hugging Face checkpoint (~ and $VARS expand)"
    )
    use_remove_padding: bool = Field(
        True, description="pack sequences without padding (rmpad) in the actor and ref forward"
    )
    gradient_checkpointing: bool = Field(
        False, description="activation checkpointing of the HF model (enable_gradient_checkpointing)"
    )
    attn_implementation: str | None = Field(None, description="override_config.attn_implementation")


class Data(Section):
    dataset: Literal["geo3k", "gsm8k", "synthetic"] = Field(
        description="what prepare-data writes for this run"
    )
    train_files: str = Field(
        min_length=1, description="verl RL parquet (~ and $VARS expand; relative to the working dir)"
    )
    val_files: str = Field(
        min_length=1, description="validation parquet, same expansion rules as train_files"
    )
    train_batch_size: int = Field(gt=0, description="prompts per GRPO step (each sampled rollout.n times)")
    max_prompt_length: int = Field(
        gt=0, description="prompt tokens; longer prompts are filtered or truncated (see truncation)"
    )
    max_response_length: int = Field(gt=0, description="generated tokens per response")
    filter_overlong_prompts: bool = Field(
        True, description="drop prompts longer than max_prompt_length before training"
    )
    truncation: Literal["error", "left", "right", "middle"] = Field(
        "error", description="what to do with an overlong prompt that was not filtered"
    )
    image_key: str | None = Field("images", description="column holding images; null for text-only data")
    shuffle: bool = Field(False, description="shuffle the training set each epoch")
    dataloader_num_workers: int | None = Field(
        None, ge=0, description="verl dataloader workers; null keeps verl's default"
    )


class Algorithm(Section):
    adv_estimator: Literal["grpo", "gae", "rloo", "reinforce_plus_plus", "remax"] = Field(
        "grpo", description="advantage estimator; grpo normalises rewards inside each prompt's group"
    )
    use_kl_in_reward: bool = Field(
        False, description="subtract a KL penalty from the reward (GRPO uses the KL loss instead)"
    )


class Optim(Section):
    lr: float = Field(gt=0, description="actor learning rate")
    optimizer: str = Field("AdamW", description="torch.optim class name used by verl")


class Actor(Section):
    strategy: Literal["fsdp_turbo", "fsdp2", "fsdp"] = Field(
        description="verl engine backend; ref follows it"
    )
    optim: Optim
    ppo_mini_batch_size: int = Field(
        gt=0, description="prompts per optimizer step; train_batch_size must be a multiple of it"
    )
    ppo_micro_batch_size_per_device: int = Field(
        gt=0, description="sequences per forward/backward on one device (gradient accumulation unit)"
    )
    use_kl_loss: bool = Field(
        True, description="add a KL term to the reference policy to the actor loss (GRPO)"
    )
    kl_loss_coef: float = Field(0.01, description="weight of the KL loss")
    kl_loss_type: str = Field("low_var_kl", description="KL estimator, e.g. low_var_kl (k3), kl, mse")
    entropy_coeff: float = Field(0, description="entropy bonus weight; 0 disables it")
    use_dynamic_bsz: bool = Field(
        False, description="pack micro-batches by token count instead of a fixed sequence count"
    )
    entropy_from_logits_with_chunking: bool = Field(
        True, description="compute entropy over chunks of the vocabulary (less peak memory)"
    )
    use_torch_compile: bool = Field(False, description="torch.compile the actor model")
    reshard_after_forward: bool = Field(
        True, description="FSDP frees gathered parameters after forward (less memory, more communication)"
    )
    entropy_checkpointing: bool = Field(
        True, description="recompute entropy in backward instead of keeping it"
    )
    offload_policy: bool = Field(
        True, description="FSDP2 CPU offload; with fsdp_turbo it alone decides offload"
    )
    param_offload: bool = Field(True, description="keep actor parameters in host memory between phases")
    optimizer_offload: bool = Field(True, description="keep optimizer state in host memory between steps")


class Ref(Section):
    log_prob_micro_batch_size_per_device: int = Field(
        gt=0, description="sequences per reference log-prob forward on one device"
    )
    entropy_from_logits_with_chunking: bool = Field(
        True, description="as actor.entropy_from_logits_with_chunking, for the reference model"
    )
    use_torch_compile: bool = Field(False, description="torch.compile the reference model")
    reshard_after_forward: bool = Field(
        True, description="FSDP frees gathered reference parameters after forward"
    )
    offload_policy: bool = Field(True, description="FSDP2 CPU offload of the reference model")
    param_offload: bool = Field(True, description="keep reference parameters in host memory between uses")


class Rollout(Section):
    name: Literal["vllm", "hf"] = Field(
        "vllm",
        description="generation engine: vllm (verl's async server) or hf (the engine's transformers rollout)",
    )
    n: int = Field(gt=0, description="responses per prompt (the GRPO group size)")
    gpu_memory_utilization: float = Field(
        0.5,
        gt=0,
        le=1,
        description="fraction of device memory the rollout engine may take (weights + KV cache)",
    )
    ignore_eos: bool = Field(
        False, description="keep generating past end-of-sequence up to max_response_length"
    )
    log_prob_micro_batch_size_per_device: int = Field(
        1, gt=0, description="sequences per old-log-prob forward on one device"
    )
    enable_chunked_prefill: bool = Field(True, description="vLLM chunked prefill")
    max_num_batched_tokens: int = Field(
        8192, gt=0, description="vLLM tokens per scheduler step; at least the longest prompt + response"
    )
    free_cache_engine: bool = Field(
        True, description="release the KV cache between rollouts so training can use the memory"
    )
    enforce_eager: bool = Field(False, description="vLLM without CUDA graphs (slower decode, faster start)")
    enable_prefix_caching: bool = Field(
        False, description="vLLM prefix caching across the n samples of a prompt"
    )
    update_weights_bucket_megabytes: int | None = Field(
        None, gt=0, description="bucket size of the actor-to-rollout weight sync; null keeps verl's default"
    )
    vllm_engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="+engine_kwargs.vllm.*")


class Parallel(Section):
    fsdp: int = Field(gt=0, description="FSDP shard group size (turbo fully_shard_parallel_size)")
    ep: int = Field(1, gt=0, description="expert parallel size (MoE only)")
    cp: int = Field(1, gt=0, description="context parallel size (Turbo Ulysses)")
    rollout_tp: int = Field(1, gt=0, description="rollout tensor parallel size")
    ep_dispatcher: Literal["eager", "fused", "mc2", "domino", "moonep"] = Field(
        "eager", description="FSDPTurbo token dispatcher of expert parallelism"
    )
    verl_sp: int = Field(1, gt=0, description="verl's own Ulysses SP; must stay 1 with fsdp_turbo")


class Turbo(Section):
    recompute: bool = Field(True, description="FSDPTurbo activation recompute of layers and vision blocks")


class Cluster(Section):
    device: Device = Field(description="set by --device")
    nodes: int = Field(
        1, gt=0, description="nodes of the run (trainer.nnodes); >1 needs a Ray cluster across them"
    )
    devices_per_node: int = Field(gt=0, description="trainer.n_gpus_per_node")
    device_memory_gib: float = Field(
        gt=0, description="memory of one accelerator, for the preflight estimate"
    )


class Trainer(Section):
    project_name: str = Field(description="experiment tracker project")
    experiment_name: str = Field(description="experiment tracker run name")
    total_epochs: int = Field(
        15, gt=0, description="passes over the training set (unless total_training_steps stops earlier)"
    )
    total_training_steps: int | None = Field(None, gt=0, description="stop after N steps (else epochs)")
    save_freq: int = Field(description="save every N steps (and at the last step); -1 never")
    test_freq: int = Field(-1, description="validate every N steps; -1 never")
    val_before_train: bool = Field(False, description="validate once before the first step")
    balance_batch: bool = Field(
        False, description="reorder sequences so each data-parallel rank gets similar token counts"
    )
    critic_warmup: int = Field(
        0, description="steps that train only the critic first (0 for GRPO, which has none)"
    )
    logger: list[str] = Field(
        default_factory=lambda: ["console"], description="verl trackers, e.g. console, wandb, tensorboard"
    )
    checkpoint_dir: str = Field(min_length=1, description="trainer.default_local_dir")
    resume_mode: Literal["auto", "disable", "resume_path"] = Field(
        "auto",
        description="auto: continue from the latest checkpoint in checkpoint_dir; disable: start fresh",
    )
    max_actor_ckpt_to_keep: int | None = Field(
        None, gt=0, description="keep only the newest N actor checkpoints; null keeps all"
    )
    save_hf_model: bool = Field(False, description="also save full HF weights in each checkpoint")


class Reward(Section):
    custom_function: str | None = Field(None, description="'module:function' used as verl's custom reward")


class Recipe(Section):
    name: str = Field(description="the file's stem; set by the loader, not written in YAML")
    description: str = Field(description="one line shown by `list`")
    devices: list[Device] = Field(
        min_length=1, description="devices this run is made for; the first is default"
    )
    model: Model
    data: Data
    algorithm: Algorithm = Algorithm()
    actor: Actor
    ref: Ref
    rollout: Rollout
    parallel: Parallel
    turbo: Turbo = Turbo()
    cluster: Cluster
    trainer: Trainer
    reward: Reward = Reward()
    env: dict[str, str] = Field(default_factory=dict, description="environment exports of the launch")
    verl_overrides: dict[str, HydraValue] = Field(
        default_factory=dict, description="extra verl keys, written with their Hydra prefix (+key, ++key)"
    )

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        bad = [name for name in env if not ENV_NAME.fullmatch(name)]
        if bad:  # bash would reject the launch script's `export` hours later
            raise ValueError(f"{bad[0]!r} is not a shell variable name; use letters, digits and _")
        return env


class _Loader(UniqueKeyLoader):
    """YAML 1.1 reads `1e-6` as a string; recipes mean the number (YAML 1.2 float syntax)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


# Fields whose values are free-form mappings: their sub-keys are data, not schema.
MAPPING_FIELDS = {"env", "verl_overrides", "vllm_engine_kwargs"}
FLAT_MAPPINGS = {"env", "verl_overrides"}


def recipe_dir() -> Path:
    """The recipes shipped with the engine: package data in a wheel, `recipes/` in a checkout."""
    package = Path(__file__).resolve().parents[1]  # engine/
    packaged = package / "_recipes"
    return packaged if packaged.is_dir() else package.parent / "recipes"


def recipe_dirs() -> list[Path]:
    """Where recipe names are looked up, first match wins: ENGINE_RECIPE_DIR (user recipes, one or
    more directories separated by os.pathsep, each holding recipes), then the shipped recipes."""
    dirs = []
    for entry in filter(None, os.environ.get("ENGINE_RECIPE_DIR", "").split(os.pathsep)):
        if not Path(entry).is_dir():
            raise UserError(f"ENGINE_RECIPE_DIR: '{entry}' is not a directory; fix or unset it")
        if not any(Path(entry).glob("*.yaml")):
            raise UserError(f"ENGINE_RECIPE_DIR: '{entry}' holds no *.yaml recipe; fix or unset it")
        dirs.append(Path(entry))
    return [*dirs, recipe_dir()]


def _recipe_files() -> dict[str, Path]:
    """name -> file of every known recipe; a user recipe hides a shipped one of the same name."""
    found: dict[str, Path] = {}
    for folder in recipe_dirs():
        for path in sorted(folder.glob("*.yaml")):
            found.setdefault(path.stem, path)
    if not found:
        where = ", ".join(str(d) for d in recipe_dirs())
        raise UserError(f"no recipes found in {where}; reinstall the engine or set ENGINE_RECIPE_DIR")
    return found


def list_recipes() -> list[tuple[str, str]]:
    rows = []
    for name, path in sorted(_recipe_files().items()):
        description = str(_read_yaml(path).get("description", "")).strip().splitlines()
        rows.append((name, description[0] if description else ""))
    return rows


def _read_yaml(path: Path) -> dict[str, Any]:
    text = read_text(path, "recipe", "pass a recipe name (see `list`) or a readable YAML file")
    try:
        data = _yaml(text)
    except yaml.YAMLError as err:
        raise UserError(f"{path}: {yaml_problem(err)}; fix the YAML") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: a recipe must be a mapping of keys, got {type(data).__name__}")
    return data


def _resolve_path(ref: str, relative_to: Path | None) -> Path:
    if ref.endswith((".yaml", ".yml")) or "/" in ref:
        path = Path(ref)
        if not path.is_absolute() and relative_to is not None and not path.exists():
            path = relative_to / path
        return path
    known = _recipe_files()
    if ref not in known:
        close = difflib.get_close_matches(ref, list(known), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f"; known: {', '.join(sorted(known))}"
        raise UserError(f"unknown recipe '{ref}'{hint}")
    return known[ref]


def _check_keys(data: dict[str, Any], model: type[BaseModel], source: str, prefix: str = "") -> None:
    """Unknown keys fail here, per layer, so the error names the file that has the typo."""
    for key, value in data.items():
        if not isinstance(key, str):
            raise UserError(f"{source}: key {key!r} under '{prefix or '<top>'}' must be a string")
        fields = model.model_fields
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise UserError(f"{source}: unknown key '{prefix}{key}'{hint}")
        sub = _section_type(model, key)
        if sub is not None and key not in MAPPING_FIELDS:
            if not isinstance(value, dict):
                raise UserError(f"{source}: '{prefix}{key}' must be a mapping, got {type(value).__name__}")
            _check_keys(value, sub, source, f"{prefix}{key}.")


def _section_type(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    annotation = model.model_fields[key].annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _load_layers(ref: str, relative_to: Path | None, seen: tuple[Path, ...]) -> tuple[dict[str, Any], Path]:
    path = _resolve_path(ref, relative_to).resolve()
    if path in seen:
        chain = " -> ".join(p.stem for p in (*seen, path))
        raise UserError(f"{path}: 'extends' cycle ({chain}); remove one link")
    raw = _read_yaml(path)
    parent = raw.pop("extends", None)
    _check_keys(raw, Recipe, str(path))
    if parent is None:
        return raw, path
    if not isinstance(parent, str):
        raise UserError(f"{path}: 'extends' must be a recipe name or path, got {type(parent).__name__}")
    base, _ = _load_layers(parent, path.parent, (*seen, path))
    base.pop("description", None)  # a description belongs to one file only
    return _merge(base, raw), path


def parse_set(item: str) -> tuple[list[str], Any]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set '{item}': expected KEY=VALUE, e.g. --set parallel.ep=4")
    if not value.strip():  # an empty path would silently become the working directory
        raise UserError(f"--set '{item}': empty value; give one (write {key.strip()}='' for an empty string)")
    try:
        parsed = _yaml(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    return key.strip().split("."), parsed


def _apply_set(data: dict[str, Any], item: str) -> None:
    parts, value = parse_set(item)
    model: type[BaseModel] | None = Recipe
    node = data
    for depth, part in enumerate(parts):
        dotted = ".".join(parts[: depth + 1])
        last = depth == len(parts) - 1
        if model is not None:
            fixed = ("name", "devices") if model is Recipe else ()
            if part not in model.model_fields or part in fixed:
                choices = [f for f in model.model_fields if f not in fixed]
                close = difflib.get_close_matches(part, choices, n=1)
                stem = ".".join(parts[:depth])
                hint = f" (did you mean '{stem + '.' if stem else ''}{close[0]}'?)" if close else ""
                raise UserError(f"--set {item}: unknown recipe path '{dotted}'{hint}")
            section = _section_type(model, part)
            if section is not None and last and part not in MAPPING_FIELDS:
                raise UserError(f"--set {item}: '{dotted}' is a section; set one of its fields")
            model = None if part in MAPPING_FIELDS else section
            if part in FLAT_MAPPINGS and not last:  # verl keys and env names are single keys
                node.setdefault(part, {})[".".join(parts[depth + 1 :])] = value
                return
        if last:
            node[part] = value
        else:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"--set {item}: '{dotted}' is not a mapping")


def _format_validation(err: ValidationError, source: str) -> str:
    problems = []
    for item in err.errors():
        loc = ".".join(str(p) for p in item["loc"])
        if item["type"] == "missing":
            problems.append(f"missing required key '{loc}'")
        else:
            given = item.get("input")
            shown = repr(given) if not isinstance(given, dict) else "a mapping"
            problems.append(f"'{loc}': {item['msg'][:1].lower() + item['msg'][1:]} (got {shown[:60]})")
    more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
    return f"{source}: " + "; ".join(problems[:3]) + more


def load(ref: str, device: str | None = None, sets: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Resolve a recipe name or YAML path for one device into a validated Recipe."""
    data, path = _load_layers(ref, Path.cwd(), ())
    devices = data.get("devices") or []
    if not isinstance(devices, list) or not devices:
        raise UserError(f"{path}: 'devices' must list at least one of gpu, npu, cpu")
    device = device or devices[0]
    if device not in devices:
        raise UserError(
            f"recipe '{path.stem}' supports devices {', '.join(map(str, devices))}; "
            f"pass --device {devices[0]}"
        )
    profile_path = next(
        (p for d in recipe_dirs() if (p := d / "profiles" / f"{device}.yaml").exists()),
        recipe_dir() / "profiles" / f"{device}.yaml",
    )
    profile = _read_yaml(profile_path) if profile_path.exists() else {}
    _check_keys(profile, Recipe, str(profile_path))
    data = _merge(_merge(profile, data), {"name": path.stem, "cluster": {"device": device}})
    for item in sets:
        _apply_set(data, item)
    chosen = data["cluster"].get("device") if isinstance(data.get("cluster"), dict) else device
    if chosen != device:
        raise UserError(
            f"--set cluster.device={chosen} contradicts --device {device}: the device comes from "
            f"--device alone; pass --device {chosen}"
        )
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise UserError(_format_validation(err, str(path))) from None


def to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, width=110)
