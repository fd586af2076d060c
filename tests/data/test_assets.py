"""Tiny assets are deterministic, loadable in the layouts the recipes assume; the reward is shaped right."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest

from engine.data import assets
from engine.runtime import rewards


def _digests(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("assets")
    assert assets.cli_main(["--out", str(out), "--seed", "0", "--train-size", "16", "--test-size", "4"]) == 0
    return out


def test_same_seed_same_bytes(built: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    assets.build_all(again, seed=0, train_size=16, test_size=4)
    first, second = _digests(built), _digests(again)
    assert any(name.endswith("model.safetensors") for name in first)
    assert any(name.endswith("train.parquet") for name in first)
    assert first == second


def test_other_seed_other_weights(built: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    assets.build_all(other, seed=1, train_size=16, test_size=4)
    name = "tiny-qwen35/model.safetensors"
    assert _digests(built)[name] != _digests(other)[name]


def test_models_load_in_vl_layout(built: Path) -> None:
    import transformers

    dense = transformers.AutoConfig.from_pretrained(built / "tiny-qwen35")
    moe = transformers.AutoConfig.from_pretrained(built / "tiny-qwen35-moe")
    assert dense.architectures == ["Qwen3_5ForConditionalGeneration"]
    assert moe.architectures == ["Qwen3_5MoeForConditionalGeneration"]
    assert moe.text_config.num_experts == 4
    assert dense.text_config.layer_types == ["linear_attention", "full_attention"]
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(built / "tiny-qwen35")
    names = {name for name, _ in model.named_parameters()}
    # The module globs of the real recipes' FSDP plans must match this layout.
    assert any(name.startswith("model.language_model.layers.0.") for name in names)
    assert any(name.startswith("model.visual.blocks.0.") for name in names)
    assert "lm_head.weight" in names


def test_tokenizer_chat_template_and_specials(built: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built / "tiny-qwen35")
    assert len(tok) == assets.VOCAB_SIZE
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    text = tok.decode(ids)
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok.encode("#### 42")) == "#### 42"


def test_parquet_in_verl_rl_layout(built: Path) -> None:
    import pyarrow.parquet as pq

    rows = pq.read_table(built / "data" / "synthetic" / "train.parquet").to_pylist()
    assert len(rows) == 16
    row = rows[0]
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["prompt"][0]["role"] == "user"
    question = row["extra_info"]["question"]
    a, op, b = question.split("?")[0].removeprefix("What is ").split()
    assert str(assets.OPS[op](int(a), int(b))) == row["reward_model"]["ground_truth"]


def test_cli_rejects_bad_sizes(tmp_path: Path) -> None:
    from engine.errors import UserError

    with pytest.raises(UserError, match="train-size"):
        assets.cli_main(["--out", str(tmp_path), "--train-size", "0"])


def test_reward_exact_answer_scores_most() -> None:
    assert rewards.compute_score("synthetic/arith", "so #### 12", "12") == 1.0
    assert rewards.compute_score("synthetic/arith", "#### -3", "-3") == 1.0
    partial = rewards.compute_score("synthetic/arith", "12 is it #### 13", "12")
    assert 0 < partial < 0.51
    assert rewards.compute_score("synthetic/arith", "", "12") == 0.0


def test_reward_varies_within_a_group_of_random_responses() -> None:
    rng = random.Random(0)
    alphabet = "abc 0123456789#\n"
    scores = {
        rewards.compute_score("synthetic/arith", "".join(rng.choice(alphabet) for _ in range(16)), "7")
        for _ in range(8)
    }
    assert len(scores) > 1  # non-zero GRPO advantages
    assert max(scores) < 1.0
