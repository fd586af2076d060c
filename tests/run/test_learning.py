"""GRPO on CPU is right, not merely running: `tiny_cpu_learn` raises its reward past the learning gate
with the rollout sampling from the trained weights at every step, and a run whose weight sync is broken
(the test-only `ENGINE_TEST_BREAK=no_weight_sync`) fails the agreement gate from step 2 on."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from engine.run import gates
from engine.runtime import mutations
from tests.conftest import ROOT, run_recipe

pytestmark = pytest.mark.slow
RECIPE = "tiny_cpu_learn"


def gate(record: dict, name: str) -> dict:
    return next(item for item in record["gates"] if item["name"] == name)


def test_learning_run_passes_every_gate_and_draws_its_curves(tiny_assets: Path, tmp_path: Path) -> None:
    run = run_recipe(RECIPE, tmp_path / "run", tiny_assets)
    assert run.proc.returncode == 0, run.why()
    record, rows = run.record, run.rows
    assert [row["step"] for row in rows] == list(range(1, record["target_steps"] + 1))
    assert {item["name"]: item["status"] for item in record["gates"]} == {
        "rollout_actor_agreement": "pass",
        "finite_losses": "pass",
        "grpo_signal": "pass",
        "learning": "pass",
    }
    assert "gate learning: PASS" in run.proc.stdout
    # the criterion recomputed from the metrics file, independently of the gate code
    k, margin = gates.LEARNING[RECIPE].window, gates.LEARNING[RECIPE].margin
    rewards = [row["data"]["critic/score/mean"] for row in rows]
    assert sum(rewards[-k:]) / k - sum(rewards[:k]) / k > margin
    cpu = gates.AGREEMENT["cpu"]
    assert max(row["data"][cpu.metric] for row in rows) <= cpu.limit

    # the report's figure of this run: reward, loss and the rollout/actor gap with the gate's threshold
    spec = importlib.util.spec_from_file_location("plot_curves", ROOT / "workflow/scripts/plot_curves.py")
    assert spec and spec.loader
    plot_curves = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_curves)
    png = tmp_path / "curves.png"
    assert plot_curves.main([str(tmp_path / "run" / "metrics.jsonl")], str(png), RECIPE, "cpu") == 0
    assert png.stat().st_size > 20_000


def test_broken_weight_sync_fails_the_agreement_gate_after_the_first_update(
    tiny_assets: Path, tmp_path: Path
) -> None:
    """`engine run --control no_weight_sync`: the broken loop trains, its agreement gate fails from step
    2 on, and the launch exits 0 because that gate caught it; the record says the run was broken."""
    run = run_recipe(
        RECIPE,
        tmp_path / "nosync",
        tiny_assets,
        "trainer.total_training_steps=3",
        "trainer.save_freq=-1",
        args=("--control", mutations.NO_WEIGHT_SYNC),
    )
    assert run.proc.returncode == 0, run.why()
    assert "TEST-ONLY BREAKAGE no_weight_sync" in (tmp_path / "nosync" / "train.log").read_text()
    record = run.record
    assert record["status"] == "failed" and record["exit_code"] == 0  # verl itself saw nothing wrong
    assert record["fault"] == mutations.NO_WEIGHT_SYNC
    assert record["control"] == {
        "fault": "no_weight_sync",
        "must_fail": "rollout_actor_agreement",
        "caught": True,
    }
    agreement = gate(record, "rollout_actor_agreement")
    assert agreement["status"] == "fail" and agreement["first_failed_step"] == 2, agreement
    assert gate(record, "learning")["status"] == "skip"  # 3 steps are too few for the criterion
    cpu = gates.AGREEMENT["cpu"]
    gaps = [row["data"][cpu.metric] for row in run.rows]
    assert gaps[0] <= cpu.limit < min(gaps[1:]), gaps  # both start from the initial weights; then they part
    assert "control no_weight_sync: gate rollout_actor_agreement caught it" in run.proc.stdout


def test_a_control_whose_gate_cannot_judge_it_fails(tiny_assets: Path, tmp_path: Path) -> None:
    """zero_lr must be caught by the learning gate, which needs 10 steps: 1 step cannot show it, so the
    control exits 3 (not caught) rather than 0, and the breakage set in the environment is recorded."""
    run = run_recipe(
        RECIPE,
        tmp_path / "zero",
        tiny_assets,
        "trainer.total_training_steps=1",
        "trainer.save_freq=-1",
        args=("--control", mutations.ZERO_LR),
    )
    assert run.proc.returncode == gates.EXIT_GATE_FAILED, run.why()
    record = run.record
    assert record["control"]["caught"] is False and gate(record, "learning")["status"] == "skip"
    assert "did NOT catch it" in run.proc.stdout
