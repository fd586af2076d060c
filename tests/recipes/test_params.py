"""Parameter counts from a config (engine.recipes.params) against the models transformers builds, and the
registry's cut of the 35B-A3B architecture against the model the GPU recipe trains."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.recipes import models
from engine.recipes.params import count_text_params

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _built(config: dict, moe: bool) -> object:
    family = transformers.models.qwen3_5_moe if moe else transformers.models.qwen3_5
    text_cls = family.Qwen3_5MoeTextConfig if moe else family.Qwen3_5TextConfig
    model_cls = family.Qwen3_5MoeForCausalLM if moe else family.Qwen3_5ForCausalLM
    with torch.device("meta"):
        return model_cls(text_cls(**config))


@pytest.mark.parametrize(
    "name", ["Qwen3.5-0.8B", "Qwen3.5-2B", "Qwen3.5-35B-A3B", "Qwen3.5-35B-A3B-6L", "Qwen3.5-27B"]
)
def test_count_equals_the_instantiated_model(name: str) -> None:
    spec = models.lookup(name)
    if not spec.linear_head_dim:
        spec = replace(spec, linear_head_dim=128)  # the facts a build needs; 27B records none
    if not spec.moe and not spec.intermediate_size:
        spec = replace(spec, intermediate_size=17408)
    config = spec.text_config()
    model = _built(config, spec.moe)
    counted = count_text_params(config)
    assert counted.total == sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    if spec.moe:
        experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
        assert counted.total - counted.active == experts * (1 - spec.experts_per_token / spec.num_experts)
        assert counted.embedding == config["vocab_size"] * config["hidden_size"]
    else:
        assert counted.active == counted.total
        untied = config["vocab_size"] * spec.hidden_size
        assert counted.embedding == (0 if spec.tie_word_embeddings else untied)


def test_registry_counts_match_the_release_and_the_built_cut() -> None:
    full = models.lookup("Qwen3.5-35B-A3B")
    counted = count_text_params(full.text_config())
    # the release's active parameters per token (embedding and head included) and its text total
    assert counted.active == pytest.approx(full.active_params, rel=2e-3)
    assert full.total_params - counted.total == pytest.approx(0.45e9, rel=0.05)  # its 27-deep vision tower
    cut = models.lookup("Qwen3.5-35B-A3B-6L")
    assert cut.num_layers == 6 and cut.hidden_size == full.hidden_size and cut.num_experts == 256
    assert (
        cut.text_config()["layer_types"]
        == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2
    )
    assert cut.expert_params == 3 * 6 * 256 * 2048 * 512


def test_gpu_vision_tower_count_is_the_built_one() -> None:
    from engine.data import random_model

    cut = models.lookup("Qwen3.5-35B-A3B-6L")
    vision = dict(random_model.VISION, out_hidden_size=cut.hidden_size)
    config = transformers.Qwen3_5MoeConfig(text_config=cut.text_config(), vision_config=vision)
    with torch.device("meta"):
        model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) == cut.total_params


@pytest.mark.parametrize(
    ("name", "tower"),
    [
        ("Qwen3.5-0.8B", None),  # the tower the project builds for the 0.8B (engine.data.random_model)
        ("Qwen3.5-2B", {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16}),
    ],
)
def test_dense_registry_widths_leave_a_tower_of_the_release_depth(name: str, tower: dict | None) -> None:
    """vision_params is the release's total less the counted text model: a wrong FFN width shows as a tower
    that no vision shape of that depth builds (the 2B's once carried the 0.8B's 3584: 708.7 M)."""
    from engine.data import random_model

    tower = tower or random_model.VISION
    spec = models.lookup(name)
    assert tower["depth"] == spec.vision_depth
    config = transformers.Qwen3_5VisionConfig(**tower, out_hidden_size=spec.hidden_size)
    with torch.device("meta"):
        built = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5VisionModel(config)
    assert spec.vision_params == pytest.approx(sum(p.numel() for p in built.parameters()), rel=2e-3)
