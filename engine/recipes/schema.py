"""The typed recipe (pydantic): every section and field of a recipe, with its description and bounds.

`engine.recipes.loader` reads YAML into it; `engine.recipes.reference` renders it as the markdown reference.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Device = Literal["gpu", "npu", "cpu"]
Scalar = str | int | float | bool | None
HydraValue = Scalar | list[Any] | dict[str, Any]
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# engine.runtime.syncs reads it in verl's processes; the plan writes it from `actor.host_syncs`
HostSyncs = Literal["lean", "verl", "deferred"]


class Section(BaseModel):
    # allow_inf_nan: `.inf` and `.nan` are floats to YAML; every bound lets one of them through
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


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
    attn_implementation: str | None = Field(
        None,
        description="override_config.attn_implementation (verl's default: flash_attention_2); sdpa where "
        "flash-attn is absent; torch_varlen: the project's per-sequence attention for packed rows (the "
        "varlen-attn lever); sdpa_no_cudnn: sdpa without cuDNN's kernel (the sdpa-no-cudnn lever)",
    )
    text_only: bool = Field(
        False,
        description="the data has no images: text batches skip verl's placeholder pass through the vision "
        "tower (ENGINE_TEXT_ONLY=1, the text-only lever); needs data.image_key: null",
    )
    init: Literal["pretrained", "random"] = Field(
        "pretrained",
        description="pretrained: path holds released weights; random: the workflow writes a seeded "
        "random-init model of the registry shape (`python -m engine make-model`), for rehearsals without "
        "weights",
    )


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
    implementation: Literal["default", "foreach", "fused", "compiled"] = Field(
        "default",
        description="AdamW's kernels (override_optimizer_config): default leaves the choice to torch "
        "(foreach on GPU/NPU, a loop per tensor on CPU); fused runs the whole update in one kernel per "
        "group, with no fp32 temporaries; compiled (bf16_sr only) traces torchao's per-tensor update "
        "once over all tensors instead of one compiled call per tensor (docs/reference/trainer-levers.md)",
    )
    precision: Literal["fp32", "bf16_sr"] = Field(
        "fp32",
        description="fp32: fp32 master weights, gradients and AdamW moments (verl's default); bf16_sr: "
        "all three in bf16 (fsdp_config.model_dtype=bf16, so FSDP gathers without an fp32->bf16 cast), "
        "the update computed in fp32 and rounded stochastically by torchao's _AdamW (needs torchao)",
    )


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
    logprobs_kernel: Literal["chunked", "compiled"] = Field(
        "chunked",
        description="the project's token log-probs where verl has no fused cross-entropy (no flash-attn): "
        "chunked eager fp32 passes, or compiled (two fused kernels per chunk; ENGINE_LOGPROBS=compiled, "
        "the compiled-logprobs lever, which reaches the ref and the log-prob recomputation too)",
    )
    host_syncs: HostSyncs = Field(
        "lean",
        description="how verl's trainer step reads the device from the host (ENGINE_HOST_SYNCS): lean, the "
        "project's one-read replacements of verl's packing helpers; verl, verl's own code; deferred, lean "
        "plus the step's losses, metrics and grad-norm check read once at its end (no gain measured)",
    )
    use_torch_compile: bool = Field(False, description="torch.compile the actor model")
    reshard_after_forward: bool = Field(
        True, description="FSDP frees gathered parameters after forward (less memory, more communication)"
    )
    entropy_checkpointing: bool = Field(
        True, description="recompute entropy in backward instead of keeping it"
    )
    defer_gradient_sync: bool = Field(
        False,
        description="keep a step's gradients unsharded over its micro-batches and reduce them once, at the "
        "last (fsdp_config.use_no_sync_for_gradient_accumulation; verl's trainer default false): fewer "
        "reduce-scatters and gradient casts, the unsharded gradients held meanwhile",
    )
    reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="dtype FSDP reduces (and, deferred, accumulates) gradients in: fp32 is verl's default, "
        "a cast of every bf16 gradient before its reduce-scatter (and back with bf16_sr); bf16 reduces the "
        "gradients as computed: the same sum on one device with one micro-batch per step, a bf16 sum across "
        "devices and micro-batches otherwise (fsdp_config.mixed_precision)",
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


# Fields whose values are free-form mappings: their sub-keys are data, not schema.
MAPPING_FIELDS = {"env", "verl_overrides", "vllm_engine_kwargs"}
FLAT_MAPPINGS = {"env", "verl_overrides"}


def section_type(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    """The sub-model of a field that is itself a section, else None."""
    annotation = model.model_fields[key].annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
