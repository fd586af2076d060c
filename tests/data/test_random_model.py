"""`python -m engine make-model`: the random-init models of the GPU rehearsals, at tiny widths on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.data import assets, random_model
from engine.errors import OutputError


def test_make_model_writes_a_loadable_qwen35_with_the_project_tokenizer(tmp_path: Path) -> None:
    import transformers

    out = random_model.make_model(tmp_path / "model", small=True)
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = model.config.get_text_config()
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert model.config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert text.eos_token_id == tokenizer.eos_token_id == model.generation_config.eos_token_id
    # the tokenizer covers the vocabulary (verl's vLLM rollout masks ids past len(tokenizer)), and the
    # padding changes no tokenization
    assert len(tokenizer) == text.vocab_size == 1024
    plain = assets.build_tokenizer(0)
    prompt = plain.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], tokenize=False)
    assert tokenizer(prompt)["input_ids"] == [
        tokenizer.convert_tokens_to_ids(plain.convert_ids_to_tokens(i)) for i in plain(prompt)["input_ids"]
    ]
    assert not list(tmp_path.glob(".model.*"))  # the temporary directory was renamed, not left behind


def test_make_model_moe_saves_experts_per_expert_and_cuts_layers(tmp_path: Path) -> None:
    import transformers
    from safetensors import safe_open

    out = random_model.make_model(tmp_path / "moe", small=True, model="Qwen3.5-35B-A3B-6L", layers=2)
    config = transformers.AutoConfig.from_pretrained(out)
    text = config.get_text_config()
    assert config.architectures == ["Qwen3_5MoeForConditionalGeneration"]
    assert text.num_hidden_layers == 2 and text.layer_types == ["linear_attention"] * 2
    assert text.num_experts == random_model.SMALL_MOE["num_experts"]
    with safe_open(next(out.glob("*.safetensors")), framework="pt") as handle:
        keys = list(handle.keys())
    assert "model.language_model.layers.1.mlp.experts.7.down_proj.weight" in keys
    assert not [k for k in keys if k.endswith("experts.gate_up_proj")]
    model = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(out)
    assert model.config.get_text_config().num_experts == 8


def test_cli_builds_the_same_model_twice_and_refuses_a_directory_it_did_not_make(tmp_path: Path) -> None:
    """Seeded: a rebuild (a workflow rerun) writes identical weights; a non-empty --out is never merged
    into."""
    first, second = tmp_path / "a", tmp_path / "b"
    for out in (first, second):
        assert random_model.cli_main(["--out", str(out), "--small", "--seed", "3"]) == 0
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    before = sorted(p.name for p in first.iterdir())
    with pytest.raises(OutputError, match="not empty"):
        random_model.cli_main(["--out", str(first), "--small"])
    assert sorted(p.name for p in first.iterdir()) == before
