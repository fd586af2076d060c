"""Architecture facts of the supported models, and the module-glob plans of their families.

Preflight reads these before anything is allocated; `--check-env` compares them with the real
`config.json` when the model directory exists. Each figure names its source in `source`.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.errors import UserError
from engine.recipes.params import count_text_params

LAYERS = "model.language_model.layers.{*}"
VISION_BLOCKS = "model.visual.blocks.{*}"


@dataclass(frozen=True)
class Family:
    """A transformers model family as FSDPTurbo sees it (VL layout: model.visual, model.language_model)."""

    model_type: str  # transformers model_type and module name
    class_prefix: str  # Qwen3_5 / Qwen3_5Moe
    turbo_forward: str  # FSDPTurbo's replacement for <prefix>Model.forward
    moe: bool

    @property
    def modeling(self) -> str:
        return f"transformers.models.{self.model_type}.modeling_{self.model_type}"

    fsdp_apply_modules: tuple[str, ...] = (
        VISION_BLOCKS,
        "model.visual.patch_embed",
        "model.visual.pos_embed",
        "model.language_model.embed_tokens",
        LAYERS,
        "lm_head",
    )
    hook_modules: tuple[str, ...] = (LAYERS,)
    recompute_modules: tuple[str, ...] = (LAYERS, VISION_BLOCKS)

    @property
    def expert_modules(self) -> tuple[str, ...]:
        return (f"{LAYERS}.mlp.experts",) if self.moe else ()

    def ulysses_function_patches(self) -> list[dict[str, Any]]:
        return [
            {"target_functions": [f"{self.modeling}.eager_attention_forward"], "type": "full_attention"},
            {
                "target_functions": [f"{self.modeling}.{self.class_prefix}GatedDeltaNet.forward"],
                "type": "gated_delta_net",
            },
        ]

    def loss_function_patches(self) -> list[dict[str, Any]]:
        return [
            {"target_functions": ["transformers.loss.loss_utils.ForCausalLMLoss"], "type": "causal_lm_loss"}
        ]

    def module_patches(self) -> list[dict[str, str]]:
        return [
            {"target": f"{self.modeling}.{self.class_prefix}Model.forward", "replacement": self.turbo_forward}
        ]

    def patch_targets(self) -> list[str]:
        """Every dotted target the CP plan patches: they must resolve in the installed transformers."""
        targets = [t for p in self.ulysses_function_patches() for t in p["target_functions"]]
        targets += [t for p in self.loss_function_patches() for t in p["target_functions"]]
        return targets + [p["target"] for p in self.module_patches()]


QWEN3_5 = Family("qwen3_5", "Qwen3_5", "fsdp_turbo.models.qwen.qwen3_5.qwen3_5_model_forward", moe=False)
QWEN3_5_MOE = Family(
    "qwen3_5_moe", "Qwen3_5Moe", "fsdp_turbo.models.qwen.qwen3_5_moe.qwen3_5_moe_model_forward", moe=True
)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hf_id: str
    family: Family
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    linear_key_heads: int  # gated-delta-net (linear attention) heads
    linear_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    total_params: float  # all parameters incl. vision tower
    active_params: float  # parameters used per token (== total for dense)
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    vision_depth: int = 0
    tie_word_embeddings: bool = False
    intermediate_size: int = 0  # dense FFN width, where a model is built from the registry (0: not recorded)
    shared_expert_intermediate_size: int = 0  # MoE: the always-on shared expert's width
    # models the project builds from these (engine.data.assets, the GPU benchmark): gated-delta-net head
    # dim and the dtype of the saved weights
    linear_head_dim: int = 0
    asset_dtype: str = "float32"
    source: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def moe(self) -> bool:
        return self.family.moe

    @property
    def vision_params(self) -> float:
        """The vision tower: all parameters less the text model's (exact for the Qwen3.5 text layout; 0
        where the registry lacks the facts to count the text model)."""
        if not (self.vision_depth and self.linear_head_dim and (self.moe or self.intermediate_size)):
            return 0.0
        return max(0.0, self.total_params - count_text_params(self.text_config()).total)

    @property
    def expert_params(self) -> float:
        """Routed-expert weights (gate, up, down per expert): what expert parallelism shards."""
        return 3.0 * self.num_layers * self.num_experts * self.hidden_size * self.expert_intermediate_size

    def config_facts(self) -> dict[str, int | bool]:
        """Facts as they appear in a Hugging Face config.json (text_config for the VL layout)."""
        facts: dict[str, int | bool] = {
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "linear_num_key_heads": self.linear_key_heads,
            "linear_num_value_heads": self.linear_value_heads,
            "vocab_size": self.vocab_size,
        }
        if self.moe:
            facts |= {"num_experts": self.num_experts, "num_experts_per_tok": self.experts_per_token}
        if self.intermediate_size:
            facts["intermediate_size"] = self.intermediate_size
        return facts

    def text_config(self) -> dict[str, Any]:
        """The Hugging Face text config of a model built from these facts (random init, nothing downloaded):
        the release's layer pattern (3 gated-delta-net layers, then one full-attention layer) cut to
        `num_layers`."""
        pattern = ["linear_attention"] * 3 + ["full_attention"]
        config: dict[str, Any] = self.config_facts() | {
            "layer_types": (pattern * (self.num_layers // 4 + 1))[: self.num_layers],
            "linear_key_head_dim": self.linear_head_dim,
            "linear_value_head_dim": self.linear_head_dim,
            "linear_conv_kernel_dim": 4,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if self.moe:
            config |= {
                "moe_intermediate_size": self.expert_intermediate_size,
                "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            }
        return config


def truncated(spec: ModelSpec, layers: int, vision_params: float, **facts: Any) -> ModelSpec:
    """`spec` at `layers` decoder layers, every width, expert and the vocabulary kept: the release's
    architecture at a depth that fits fewer devices than the release needs. Parameter counts follow from
    the shapes; `vision_params` is the vision tower of the model actually built."""
    cut = replace(spec, num_layers=layers, **facts)
    counts = count_text_params(cut.text_config())
    return replace(cut, total_params=counts.total + vision_params, active_params=float(counts.active))


REGISTRY: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    REGISTRY[spec.name] = spec
    return spec


def lookup(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(REGISTRY), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f"; known: {', '.join(REGISTRY)}"
        raise UserError(f"model.name '{name}' is not in the model registry{hint}") from None


def compare_config(spec: ModelSpec, model_dir: str | Path) -> list[str]:
    """Mismatches between the registry and a real config.json (VL layout keeps them in text_config)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        return [f"{path}: cannot read config.json ({err.__class__.__name__})"]
    text = config.get("text_config", config)
    problems = []
    if config.get("model_type") != spec.family.model_type:
        problems.append(
            f"{path}: model_type {config.get('model_type')!r}, registry says {spec.family.model_type!r}"
        )
    for key, expected in spec.config_facts().items():
        found = text.get(key, config.get(key))
        if found is not None and found != expected:
            problems.append(f"{path}: {key}={found}, registry {spec.name} says {expected}")
    return problems


# Facts below: (HF) = the model's config.json on the Hugging Face Hub; (card) = its model card;
# (derived) = computed from the config; (tiny) = the project's own offline test models (engine.data.assets).
_HF = "https://huggingface.co/{}/blob/main/config.json"
_SLIME = "THUDM/slime scripts/models/{}.sh (the launch flags mirror the HF config.json)"
_COUNT = "derived: meta-device instantiation with transformers 5.10.4, MTP layer excluded"
_SHARED = {
    "head_dim, vocab_size, max_position_embeddings": "HF config.json (common to the Qwen3.5 family)",
    "total_params, active_params": _COUNT,
}

QWEN35_0P8B = register(
    ModelSpec(
        name="Qwen3.5-0.8B",
        hf_id="Qwen/Qwen3.5-0.8B",
        family=QWEN3_5,
        num_layers=24,  # 6 x (3 gated-delta-net + 1 full attention)
        hidden_size=1024,
        num_attention_heads=8,
        num_kv_heads=2,
        head_dim=256,
        linear_key_heads=16,
        linear_value_heads=16,
        vocab_size=248320,
        max_position_embeddings=262144,
        total_params=0.853e9,
        active_params=0.853e9,
        vision_depth=12,
        tie_word_embeddings=True,
        intermediate_size=3584,
        linear_head_dim=128,
        source={"architecture": "Qwen/Qwen3.5-0.8B model card; " + _SLIME.format("qwen3.5-0.8B"), **_SHARED},
    )
)
# The 2B keeps the 0.8B's layer pattern and heads, wider (hidden 2048, FFN 6144), deeper vision tower.
register(
    replace(
        QWEN35_0P8B,
        name="Qwen3.5-2B",
        hf_id="Qwen/Qwen3.5-2B",
        hidden_size=2048,
        intermediate_size=6144,
        total_params=2.213e9,
        active_params=2.213e9,
        vision_depth=24,
        source={"architecture": "Qwen/Qwen3.5-2B config.json (revision 15852e8c) as published", **_SHARED}
        | {"intermediate_size": "derived: total less the text model = a 24-block 1024-wide tower (331 M)"},
    )
)
register(
    ModelSpec(
        name="Qwen3.5-27B",
        hf_id="Qwen/Qwen3.5-27B",
        family=QWEN3_5,
        num_layers=64,  # 16 x (3 gated-delta-net + 1 full attention)
        hidden_size=5120,
        num_attention_heads=24,
        num_kv_heads=4,
        head_dim=256,
        linear_key_heads=16,
        linear_value_heads=48,
        vocab_size=248320,
        max_position_embeddings=262144,
        total_params=27.357e9,
        active_params=27.357e9,
        vision_depth=27,
        source={
            "architecture": "Qwen/Qwen3.5-27B model card (README); " + _SLIME.format("qwen3.5-27B"),
            "linear_value_heads": "Qwen3.6-27B card (same text config); fits the 27.78B checkpoint size",
            **_SHARED,
        },
    )
)
register(
    ModelSpec(
        name="Qwen3.5-35B-A3B",
        hf_id="Qwen/Qwen3.5-35B-A3B",
        family=QWEN3_5_MOE,
        num_layers=40,  # 10 x (3 gated-delta-net + 1 full attention), every layer MoE
        hidden_size=2048,
        num_attention_heads=16,
        num_kv_heads=2,
        head_dim=256,
        linear_key_heads=16,
        linear_value_heads=32,
        vocab_size=248320,
        max_position_embeddings=262144,
        total_params=35.107e9,
        active_params=3.46e9,  # text path per token incl. embeddings and lm_head
        num_experts=256,
        experts_per_token=8,  # plus one shared expert
        expert_intermediate_size=512,
        shared_expert_intermediate_size=512,
        linear_head_dim=128,
        vision_depth=27,
        source={
            "architecture": "Qwen/Qwen3.5-35B-A3B config.json (snapshot ec2d4ece); "
            + _SLIME.format("qwen3.5-35B-A3B"),
            "vision_depth": "Qwen3.6-35B-A3B config.json (text configs identical)",
            "shared_expert_intermediate_size, linear_head_dim": "Qwen/Qwen3.5-35B-A3B config.json; also "
            "transformers' Qwen3_5MoeTextConfig defaults",
            **_SHARED,
        },
    )
)
# The random-init models' small vision tower (engine.data.random_model; text-only runs never call it),
# counted on the built model with a 2048-wide output.
GPU_VISION_PARAMS_2048 = 103_739_648
# The 35B-A3B architecture at full width (hidden 2048, 256 experts, 8 per token, vocabulary 248,320) and 6
# of its 40 layers: fp32 weights, gradients and AdamW moments train it on one 141 GB H200 beside the
# colocated vLLM (115 GiB at the optimizer step; 7 layers would be the limit: docs/reference/performance.md).
QWEN35_35B_6L = register(
    truncated(
        REGISTRY["Qwen3.5-35B-A3B"],
        6,
        GPU_VISION_PARAMS_2048,
        name="Qwen3.5-35B-A3B-6L",
        hf_id="local/qwen35-35b-a3b-6l-random",
        vision_depth=12,
        asset_dtype="bfloat16",
        source={
            "architecture": "Qwen3.5-35B-A3B's registry facts at 6 layers (engine.recipes.models.truncated)",
            "total_params, active_params": "count_text_params + the built vision tower",
        },
    )
)

# The project's own offline models: engine.data.assets builds them from these facts (random init, seeded).
TINY = register(
    ModelSpec(
        name="tiny-qwen35",
        hf_id="local/tiny-qwen35",
        family=QWEN3_5,
        num_layers=2,  # one gated-delta-net + one full-attention layer
        hidden_size=64,
        num_attention_heads=2,
        num_kv_heads=1,
        head_dim=32,
        linear_key_heads=2,
        linear_value_heads=2,
        vocab_size=512,
        max_position_embeddings=1024,
        total_params=0.227e6,  # counted on the built model
        active_params=0.227e6,
        vision_depth=1,
        linear_head_dim=16,
        source={"architecture": "engine.data.assets (built offline from a seed)"},
    )
)
TINY_MOE = register(
    replace(
        TINY,
        name="tiny-qwen35-moe",
        hf_id="local/tiny-qwen35-moe",
        family=QWEN3_5_MOE,
        total_params=0.240e6,
        active_params=0.232e6,
        num_experts=4,
        experts_per_token=2,
        expert_intermediate_size=32,
    )
)

# vLLM's CPU backend (the `*_vllm` recipes): its gated-delta-net kernel takes bf16 only and linear-attention
# head dims of 64 or 128, so these variants of the tiny models differ from the defaults in exactly that.
_VLLM_CPU = {"linear_head_dim": 64, "asset_dtype": "bfloat16"}
TINY_VLLM = register(
    replace(
        TINY,
        name="tiny-qwen35-vllm",
        hf_id="local/tiny-qwen35-vllm",
        total_params=0.259e6,  # counted on the built model
        active_params=0.259e6,
        **_VLLM_CPU,  # type: ignore[arg-type]
    )
)
TINY_MOE_VLLM = register(
    replace(
        TINY_MOE,
        name="tiny-qwen35-moe-vllm",
        hf_id="local/tiny-qwen35-moe-vllm",
        total_params=0.272e6,
        active_params=0.264e6,
        **_VLLM_CPU,  # type: ignore[arg-type]
    )
)
TINY_MODELS = (TINY, TINY_MOE, TINY_VLLM, TINY_MOE_VLLM)
