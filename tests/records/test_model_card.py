"""The export's README.md is a Hugging Face model card that huggingface_hub parses: licence, base model,
recipe and commit, the verification it passed, and where its provenance record is."""

from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from engine.records import publish
from engine.records.model_card import model_card

REPORT = {
    "architecture": "Qwen3_5MoeForConditionalGeneration",
    "step": "2",
    "checkpoint": "",
    "world_size": 4,
    "meshes": [["dp_fsdp"], ["ep", "efsdp"]],
    "method": "dtensor",
    "verification": {
        "structure": {"keys": 120, "dtype": "bfloat16", "expert_keys": 24},
        "logits": {"batch": [2, 16], "max_abs_diff_same_weights": 0.0, "max_rel_diff_full_precision": 2.3e-3},
    },
}


def _run(root: Path, model_name: str, model_path: Path) -> Path:
    run = root / "run"
    actor = run / "checkpoints" / "global_step_2" / "actor"
    actor.mkdir(parents=True)
    (run / "recipe.yaml").write_text(f"name: qwen35_35b\nmodel: {{name: {model_name}, path: {model_path}}}\n")
    return actor


def _card(tmp_path: Path, actor: Path) -> ModelCard:
    path = tmp_path / "README.md"
    path.write_text(publish.card_for(actor, None)(REPORT | {"checkpoint": str(actor)}))
    return ModelCard.load(path)


def test_card_names_license_base_model_recipe_commit_and_record(tmp_path: Path) -> None:
    base = tmp_path / "Qwen3.5-35B-A3B"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: apache-2.0\nlibrary_name: transformers\n---\n# Qwen\n")
    actor = _run(tmp_path, "Qwen3.5-35B-A3B", base)
    card = _card(tmp_path, actor)
    assert card.data.license == "apache-2.0"
    assert card.data.base_model == "Qwen/Qwen3.5-35B-A3B"
    run = actor.parents[2]
    assert "- recipe: `qwen35_35b`" in card.text
    assert "- code: git " in card.text and "git None" not in card.text
    assert f"`{run / 'provenance.json'}`" in card.text
    assert f"python -m engine provenance verify {run}" in card.text
    assert "120 keys, shapes and dtypes checked" in card.text and "max |diff| 0.00e+00" in card.text


def test_card_of_a_project_built_model_and_of_a_model_without_card(tmp_path: Path) -> None:
    tiny = _card(tmp_path, _run(tmp_path / "a", "tiny-qwen35", tmp_path / "none"))
    assert tiny.data.license == "apache-2.0" and tiny.data.base_model is None
    unknown = _card(tmp_path, _run(tmp_path / "b", "Qwen3.5-27B", tmp_path / "missing"))
    assert unknown.data.license == "other" and unknown.data.base_model == "Qwen/Qwen3.5-27B"


def test_card_without_a_run_directory_still_parses(tmp_path: Path) -> None:
    actor = tmp_path / "global_step_2" / "actor"
    actor.mkdir(parents=True)
    card = _card(tmp_path, actor)
    assert card.data.license == "other" and "no provenance record" in card.text


@pytest.mark.parametrize("field", ["license", "base_model", "library_name", "tags"])
def test_card_metadata_is_yaml_front_matter(tmp_path: Path, field: str) -> None:
    text = publish.card_for(_run(tmp_path, "Qwen3.5-2B", tmp_path / "m"), None)(REPORT)
    front = text.split("---\n")[1]
    assert any(line.startswith(f"{field}:") for line in front.splitlines())


def test_card_is_built_from_what_the_caller_passes() -> None:
    """The commit comes from the caller (an earlier record's, else the checkout's): nothing is looked up."""
    text = model_card(REPORT, None, {"commit": "0123abc", "dirty": True})
    assert "- code: git 0123abc (dirty: True)" in text and "no provenance record" in text
