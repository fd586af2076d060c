"""smoke-report: the accelerator smoke's gates fail on what they exist to catch."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import yaml

from engine.errors import UserError
from engine.run import gates, smoke_report
from tests.conftest import ROOT

RECORDS = ROOT / "docs/records/h200-vllm-2026-12-01"
GOOD = {
    "training/rollout_probs_diff_mean": 0.002,
    "training/rollout_actor_probs_pearson_corr": 0.998,
    "training/rollout_probs_diff_max": 0.2,
    "rollout_corr/log_ppl_abs_diff": 0.01,
    "critic/advantages/max": 0.7,
    "critic/advantages/min": -0.7,
    "critic/score/mean": 0.05,
    "actor/pg_loss": 0.01,
    "actor/grad_norm": 1.5,
    "actor/entropy": 2.3,
    "response_length/mean": 32.0,
    "timing_s/gen": 2.0,
    "timing_s/old_log_prob": 0.5,
    "timing_s/update_actor": 1.0,
    "timing_s/update_weights": 0.4,
    "timing_s/step": 4.5,
    "actor/perf/max_memory_allocated_gb": 20.0,
}


def _run(tmp_path: Path, steps: list[dict]) -> Path:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "recipe.yaml").write_text(
        yaml.safe_dump({"data": {"train_batch_size": 4}, "rollout": {"n": 2}})
    )
    rows = [json.dumps({"step": i + 1, "data": data}) for i, data in enumerate(steps)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    return tmp_path


def test_good_run_passes_with_split_and_throughput(tmp_path: Path) -> None:
    result = smoke_report.report(_run(tmp_path, [GOOD, GOOD]), 0.01, 0.99)
    assert result["passed"] and result["sequences_per_step"] == 8
    step = result["steps"][1]
    assert step["rollout_tokens_per_s"] == pytest.approx(32 * 8 / 2.0)
    assert step["weight_sync_s"] == 0.4 and step["trainer_peak_allocated_gib"] == 20.0


@pytest.mark.parametrize(
    ("change", "gate"),
    [
        ({"training/rollout_probs_diff_mean": 0.05}, "rollout_probs_diff"),  # stale weights after an update
        ({"training/rollout_actor_probs_pearson_corr": 0.76}, "rollout_probs_corr"),  # as without sync
        ({"training/rollout_actor_probs_pearson_corr": float("nan")}, "rollout_probs_corr"),
        ({"training/rollout_actor_probs_pearson_corr": float("inf")}, "rollout_probs_corr"),
        ({"training/rollout_probs_diff_mean": float("-inf")}, "rollout_probs_diff"),
        ({"actor/pg_loss": float("inf")}, "finite_losses"),
        ({"critic/advantages/max": 0.0, "critic/advantages/min": 0.0}, "grpo_signal"),
        ({"actor/grad_norm": 0.0}, "grpo_signal"),
    ],
)
def test_each_gate_fails_on_its_fault_at_any_step(tmp_path: Path, change: dict, gate: str) -> None:
    result = smoke_report.report(_run(tmp_path, [GOOD, GOOD | change]), 0.01, 0.99)
    assert not result["passed"]
    failed = [g for g in result["gates"] if g["status"] == "fail"]
    assert [g["name"] for g in failed] == [gate] and failed[0]["first_failed_step"] == 2


def test_missing_metric_fails_and_cli_refuses_bad_input(tmp_path: Path) -> None:
    bare = {k: v for k, v in GOOD.items() if k != "training/rollout_probs_diff_mean"}
    assert not smoke_report.report(_run(tmp_path, [bare]), 0.01, 0.99)["passed"]
    assert smoke_report.cli_main([str(tmp_path)]) == 1
    assert json.loads((tmp_path / "smoke_report.json").read_text())["passed"] is False
    with pytest.raises(UserError, match="no such run directory"):
        smoke_report.cli_main([str(tmp_path / "absent")])
    with pytest.raises(UserError, match="not a Hugging Face model"):
        smoke_report.cli_main([str(tmp_path), "--drift", str(tmp_path), str(tmp_path)])
    good = _run(tmp_path / "good", [GOOD])
    for flag, value in (
        ("--max-probs-diff", "inf"),
        ("--min-probs-corr", "-inf"),
        ("--max-probs-diff", "nan"),
    ):
        # an infinite bound would pass any figure: refused before anything is read or written
        with pytest.raises(UserError, match=f"{flag}: invalid float value: '{value}'"):
            smoke_report.cli_main([str(good), f"{flag}={value}"])
    assert not (good / "smoke_report.json").exists()


def test_recorded_h200_vllm_runs_healthy_passes_and_broken_sync_fails() -> None:
    """The vLLM-rollout smoke on 1x H200 and that run with the weight sync broken
    (docs/reference/performance.md)."""
    healthy = smoke_report.report(RECORDS / "smoke", 0.01, 0.99)
    assert healthy["passed"] and len(healthy["steps"]) == 4
    broken = smoke_report.report(RECORDS / "no_sync", 0.01, 0.99)
    failed = [g for g in broken["gates"] if g["status"] == "fail"]
    # the synced first step agrees; every step after an update that never reached vLLM does not
    assert [(g["name"], g["first_failed_step"]) for g in failed] == [("rollout_probs_corr", 2)]
    # the probability gap alone misses it here: the tiny tokenizer's masked vocabulary dominates it
    assert [g["status"] for g in broken["gates"] if g["name"] == "rollout_probs_diff"] == ["pass"]


def test_recorded_moe_run_is_judged_by_the_moe_bound() -> None:
    """The 35B-A3B shape on 1x H200 (docs/reference/performance.md): its rollout/actor correlation
    (0.917-0.952) sits below the dense floor from step 1 on and does not fall after updates; the report
    reads the model kind from the run's recipe."""
    moe = ROOT / "docs/records/h200-moe-2026-12-01/smoke"
    result = smoke_report.report(moe, 0.01, None)
    assert result["passed"] and result["thresholds"]["rollout_actor_probs_corr"] == 0.8
    assert not smoke_report.report(moe, 0.01, 0.99)["passed"]  # the dense floor would refuse it
    assert min(s["probs_corr"] for s in result["steps"]) < 0.99
    # the dense broken-sync record fails under the MoE bound too: its fall is larger than the MoE spread
    broken = smoke_report.report(RECORDS / "no_sync", 0.01, None)
    assert not broken["passed"]
    failed = [g for g in smoke_report.run_gates(smoke_report.read_metrics(RECORDS / "no_sync/metrics.jsonl"),
                                                0.01, None, moe=True) if g.status == "fail"]  # fmt: skip
    assert [(g.name, g.first_failed_step) for g in failed] == [("rollout_probs_corr", 2)]


def test_recorded_moe_broken_sync_fails_the_moe_bound_at_step_2() -> None:
    """The 35B-A3B shape on 1x H200 with vLLM's weight sync broken (docs/reference/performance.md,
    2026-12-03): synced at step 1 (0.936, as healthy), then 0.531, 0.380, 0.188 as the actor moves away."""
    broken = smoke_report.report(ROOT / "docs/records/h200-moe-2026-12-03/no_sync", 0.01, None)
    assert broken["thresholds"]["rollout_actor_probs_corr"] == 0.8  # read as MoE from its recipe
    failed = [g for g in broken["gates"] if g["status"] == "fail"]
    assert [(g["name"], g["first_failed_step"]) for g in failed] == [("rollout_probs_corr", 2)]
    corr = [s["probs_corr"] for s in broken["steps"]]
    assert corr[0] >= 0.9 and all(b < a for a, b in itertools.pairwise(corr))


def test_recorded_moe_rehearsal_train_stage_passes_the_recalibrated_bound() -> None:
    """The 35B-A3B rehearsal's train stage through Snakemake (2026-12-03): step 2's correlation fell to 0.895,
    0.058 below step 1, while the log-ppl gap shrank as the sync reached vLLM (a healthy run). It failed
    the earlier MoE bound (fall <= 0.05); the bound now sits between the healthy falls and the broken
    sync's first one, and still refuses both broken-sync records at step 2."""
    train = ROOT / "docs/records/h200-chain-2026-12-03/qwen35_35b_h200/train"
    rows = smoke_report.read_metrics(train / "metrics.jsonl")
    corr = [row["data"][gates.PROBS_CORR] for row in rows]
    gap = [row["data"][smoke_report.LOG_PPL_DIFF] for row in rows]
    assert corr[0] - min(corr) > 0.05 and all(b < a for a, b in itertools.pairwise(gap))
    moe = gates.agreement_for("gpu", moe=True)
    assert gates.agreement(rows, moe).status == gates.PASS
    for broken in ("h200-moe-2026-12-03/no_sync", "h200-vllm-2026-12-01/no_sync"):
        result = gates.agreement(
            smoke_report.read_metrics(ROOT / "docs/records" / broken / "metrics.jsonl"), moe
        )
        assert result.status == gates.FAIL and result.first_failed_step == 2, broken
