"""Verification cards and the known-good matrix, made by replaying the kept records (docs/records)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from engine.errors import UserError
from engine.records import matrix
from tests.conftest import ROOT

RECORDS = ROOT / "docs/records"


def test_committed_cards_and_page_are_what_the_records_give() -> None:
    """docs/verification/*.json and docs/reference/verification.md are generated: replaying every
    record's card.yaml now gives them exactly (regenerate with `engine matrix cards --write`)."""
    made = {c.id: c for c in matrix.cards_from_records(RECORDS)}
    committed = {c.id: c for c in matrix.read_cards(ROOT / "docs/verification")}
    assert made == committed
    page = (ROOT / "docs/reference/verification.md").read_text()
    assert page == matrix.markdown(list(committed.values()))


def test_cards_replay_gates_with_todays_thresholds() -> None:
    cards = {c.id: c for c in matrix.cards_from_records(RECORDS)}
    chain = cards["h200-chain-2026-12-03-qwen35_35b_h200"]
    train = next(s for s in chain.stages if s.stage == "train")
    # the train job failed that day's MoE bound (its run.json was removed by Snakemake), passes today's
    assert train.status == "passed" and train.recorded_status is None and train.steps == 4
    assert chain.verdict == "partial" and chain.strategy == "fsdp2" and chain.versions["vllm"] == "0.24.0"
    first = cards["h200-moe-2026-12-01-qwen35_35b_h200"]
    assert first.stages[0].recorded_status == "failed" and first.stages[0].status == "passed"
    control = next(
        s for s in cards["h200-vllm-2026-12-01-smoke_qwen35_0p8b_h200"].stages if s.stage == "control"
    )
    assert control.status == "passed" and control.gates["rollout_actor_agreement"] == "fail"
    never = matrix.never_ran(list(cards.values()))
    assert (
        any("fsdp_turbo" in line for line in never)
        and "any NPU run" in never
        and "more than one GPU" in never
    )


def test_a_control_whose_gate_passes_is_a_failed_stage(tmp_path: Path) -> None:
    """A healthy run filed as a broken-sync control: its agreement gate passes, so the control failed."""
    folder = tmp_path / "records" / "fake"
    shutil.copytree(RECORDS / "h200-vllm-2026-12-01/smoke", folder / "run")
    source = {
        "date": "2026-12-03",
        "hardware": "x",
        "stack": "gpu",
        "commit": "c",
        "command": "c",
        "control": "run",
    }
    with pytest.raises(UserError, match="its record names no fault"):  # the run.json predates the field
        matrix.card(folder, source, tmp_path / "records")
    card = matrix.card(folder, source | {"fault": "no_weight_sync"}, tmp_path / "records")
    assert card.stages[0].status == "failed" and card.verdict == "failed"


def test_a_run_short_of_its_target_step_fails_whatever_its_gates_say(tmp_path: Path) -> None:
    """verl stopped after step 2 of 4 (a crash, a time limit): the replayed gates pass on two rows."""
    folder = tmp_path / "records" / "short"
    shutil.copytree(RECORDS / "h200-headline-2026-12-03/train", folder / "train")
    metrics = folder / "train" / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:2]))
    source = {"date": "d", "hardware": "h", "stack": "gpu", "commit": "c", "command": "c", "train": "train"}
    card = matrix.card(folder, source, tmp_path / "records")
    (train,) = card.stages
    assert train.steps == 2 and set(train.gates.values()) <= {"pass", "skip"}
    assert train.status == "failed" and card.verdict == "failed"


def test_a_card_source_without_runs_or_metrics_is_one_error(tmp_path: Path) -> None:
    folder = tmp_path / "records" / "empty"
    (folder / "run").mkdir(parents=True)
    (folder / "run" / "recipe.yaml").write_text(yaml.safe_dump({"name": "tiny_cpu"}))
    base = {"date": "d", "hardware": "h", "stack": "cpu", "commit": "c", "command": "c"}
    with pytest.raises(UserError, match="name at least one run"):
        matrix.card(folder, base, tmp_path / "records")
    with pytest.raises(UserError, match=r"no steps in metrics\.jsonl"):
        matrix.card(folder, base | {"train": "run"}, tmp_path / "records")
