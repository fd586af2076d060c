"""verl's checkpoint layout on disk and the export's, named once.

A checkpoint root holds `global_step_N/` per saved step and `latest_checkpointed_iteration.txt`, the
tracker naming the last step verl finished writing; a step's actor (FSDP shards, `fsdp_config.json`,
the `huggingface/` config and tokenizer) is `global_step_N/actor/`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"
STEP_PREFIX = "global_step_"
ACTOR = "actor"
HF_DIR = "huggingface"


def tracker(root: Path | str) -> Path:
    return Path(root) / TRACKER


def step_dir(root: Path | str, step: int | str) -> Path:
    return Path(root) / f"{STEP_PREFIX}{step}"


def actor_dir(root: Path | str, step: int | str) -> Path:
    return step_dir(root, step) / ACTOR


def step_name(step_path: Path) -> str:
    """The N of a `global_step_N` directory (its name as given otherwise)."""
    return step_path.name.removeprefix(STEP_PREFIX)


def tracked_step(root: Path | str) -> str:
    """The step the tracker names, '' when there is no readable tracker."""
    try:
        return tracker(root).read_text().strip()
    except OSError:
        return ""


def saved_step(root: Path | str) -> int:
    """The step of verl's latest finished checkpoint (its tracker file), 0 when there is none."""
    try:
        return int(tracked_step(root) or 0)
    except ValueError:
        return 0


def write_tracker(root: Path | str, step: int | str) -> None:
    tracker(root).write_text(str(step))


def checkpoint_root(actor: Path) -> Path:
    """The checkpoint root of a step's actor directory (ROOT/global_step_N/actor)."""
    return actor.parent.parent


# What `engine export` writes beside the safetensors and the Hugging Face config files.
EXPORT_REPORT = "export.json"  # verification, meshes, method, step
EXPORT_SUMS = "SHA256SUMS"  # sha256 of every file, `sha256sum -c` format
EXPORT_CARD = "README.md"  # the Hugging Face model card


@dataclass(frozen=True)
class ExportDir:
    """The paths of one export directory (none need exist)."""

    path: Path

    @property
    def report(self) -> Path:
        return self.path / EXPORT_REPORT

    @property
    def sums(self) -> Path:
        return self.path / EXPORT_SUMS

    @property
    def card(self) -> Path:
        return self.path / EXPORT_CARD
