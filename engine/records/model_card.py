"""The exported model's README.md as a Hugging Face model card.

Metadata (YAML, written by huggingface_hub's ModelCardData): `license` (the base model's, read from the
base checkpoint's own card; the project's Apache-2.0 for models engine.data.assets built), `base_model` (the
recipe model's Hub id), `library_name`, `tags`. Body: the architecture, the recipe and git commit it was
trained from, the verification the export passed, and where its provenance record is (the record is
written after the export and hashes this card, so the card points to it rather than quoting it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.checkpoint.layout import EXPORT_REPORT, EXPORT_SUMS
from engine.run.rundir import RunDir

PROJECT_LICENSE = "apache-2.0"
TAGS = ["grpo", "verl", "fsdp_turbo", "qwen3.5", "reinforcement-learning"]


def base_model(recipe: dict[str, Any]) -> tuple[str | None, str]:
    """(Hub id of the recipe's model, its licence id): the Hub id from engine.recipes.models, the licence from
    the base checkpoint's README.md; engine.data.assets models are the project's own (not on the Hub)."""
    from huggingface_hub import ModelCard

    from engine.recipes import models

    model = recipe.get("model", {})
    try:
        hf_id: str | None = models.lookup(str(model.get("name"))).hf_id
    except Exception:  # a model outside the registry still exports; it has no known Hub id
        hf_id = None
    if hf_id and hf_id.startswith("local/"):
        return None, PROJECT_LICENSE
    readme = Path(str(model.get("path", ""))).expanduser() / "README.md"
    license_id = ModelCard.load(readme).data.license if readme.is_file() else None
    return hf_id, str(license_id or "other")


def model_card(
    report: dict[str, Any],
    run: dict[str, Any] | None,
    git: dict[str, Any],
    record: dict[str, Any] | None = None,
) -> str:
    """README.md of an export from what the caller knows: the export's `report`, the `run` around the
    checkpoint ({run_dir, recipe}, None when there is none), the code's `git` and an earlier `record`."""
    from huggingface_hub import ModelCard, ModelCardData

    context = run or {}
    recipe = context.get("recipe", {})
    hf_id, license_id = base_model(recipe) if recipe else (None, "other")
    data = ModelCardData(
        license=license_id,
        base_model=hf_id,
        library_name="transformers",
        tags=TAGS,
        model_name=f"{report['architecture']} GRPO step {report['step']}",
    )
    structure = report["verification"]["structure"]
    lines = [
        f"# {report['architecture']} after {report['step']} GRPO step(s)",
        "",
        f"Trained with verl's GRPO (recipe `{recipe.get('name')}`) "
        f"from {('`' + hf_id + '`') if hf_id else 'a model the project built'}; "
        f"exported by `python -m engine export` of qwen35-grpo-engine.",
        "",
        "## Training",
        f"- recipe: `{recipe.get('name')}` (resolved: `{RunDir(context['run_dir']).recipe}`)"
        if recipe
        else "- recipe: not found next to the checkpoint",
        f"- base model: {hf_id or recipe.get('model', {}).get('name')} "
        f"({recipe.get('model', {}).get('path')})",
        f"- code: git {git.get('commit')} (dirty: {git.get('dirty')})",
        f"- checkpoint: `{report['checkpoint']}` (world size {report['world_size']}, meshes "
        f"{', '.join('/'.join(m) for m in report['meshes']) or 'none'})",
        "",
        "## Verification passed by this export",
        f"- merge: `{report['method']}`, dtype {structure['dtype']}",
        f"- {structure['keys']} keys, shapes and dtypes checked against a meta-device "
        f"{report['architecture']}; expert tensors in per-expert layout ({structure['expert_keys']} keys)",
    ]
    logits = report["verification"].get("logits")
    if logits:
        lines.append(
            f"- logits on a fixed {logits['batch']} batch: max |diff| "
            f"{logits['max_abs_diff_same_weights']:.2e} vs the checkpoint at export precision, relative "
            f"{logits['max_rel_diff_full_precision']:.2e} vs fp32"
        )
    sums = f"`{EXPORT_SUMS}` (`sha256sum -c {EXPORT_SUMS}`)"
    lines += [f"- every file hashed in {sums}; full report: `{EXPORT_REPORT}`"]
    lines += ["", "## Provenance"]
    if context:
        run_dir = RunDir(context["run_dir"])
        lines += [
            f"- record: `{run_dir.provenance}` and its RO-Crate "
            f"`{run_dir.crate}` (`python -m engine provenance write {run_dir.path} "
            "--export DIR`; the Snakemake chain writes them)",
            f"- check: `python -m engine provenance verify {run_dir.path}` re-hashes the inputs, checkpoints "
            "and this export",
        ]
    else:
        lines.append("- no run directory around the checkpoint: no provenance record")
    if record:
        lines += [
            f"- earlier record: overrides sha256 {record.get('overrides_sha256')}, image "
            f"{record.get('container', {}).get('image')}, run {record.get('start')} → {record.get('end')}, "
            f"exit {record.get('exit_code')}"
        ]
    lines += [
        "",
        "## Licence",
        f"`{license_id}`, the base model's. Trained with FSDPTurbo (verl's fsdp_turbo backend), whose README "
        "restricts its content to non-commercial use: see NOTICE of qwen35-grpo-engine.",
        "",
    ]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)))
