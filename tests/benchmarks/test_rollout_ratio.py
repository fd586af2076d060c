"""The rollout step-time comparison, replayed on the kept GPU GRPO records."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import rollout_ratio
from engine.errors import UserError
from engine.run.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]
SAVED_AT_4 = ROOT / "docs/records/h200-vllm-2026-12-01/smoke"  # 4 steps, checkpoint at step 4
NO_SAVE = ROOT / "docs/records/h200-levers-2026-12-04b/grpo/vllm"  # 4 steps, --levers fast, save_freq -1
HF_H100 = ROOT / "docs/records/h100-rollout-2026-12-06/grpo/hf"  # the hf side of the same batch, an H100
ONE_ALLOCATION = ROOT / "docs/records/h100-rollout-2026-12-06b"  # both sides and fast-text, one H100
H100 = {"host": "gpu-a", "accelerator": "gpu", "count": 1, "devices": ["NVIDIA H100 80GB HBM3, 81559 MiB"]}


def _step_times(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["data"]["timing_s/step"] for row in rows}


def test_steady_steps_leave_out_the_first_and_every_save() -> None:
    summary = rollout_ratio.summarize_run(RunDir(SAVED_AT_4), first=2)
    assert summary["steps"] == [2, 3] and summary["saved_steps_left_out"] == [4]
    times = _step_times(SAVED_AT_4)
    assert summary["phases"]["step"]["median"] == pytest.approx(statistics.median([times[2], times[3]]))
    assert summary["phases"]["step"]["max"] < times[4]  # the save step (14.1 s) is not in the figure

    levers = rollout_ratio.summarize_run(RunDir(NO_SAVE), first=2)
    assert levers["steps"] == [2, 3, 4] and levers["saved_steps_left_out"] == []
    assert levers["gates"]["rollout_actor_agreement"] == "pass"
    assert "actor.optim.implementation=fused" in levers["sets"]


def test_a_run_whose_steady_steps_all_saved_is_refused() -> None:
    with pytest.raises(UserError, match=r"no step from step 4 on without a checkpoint save \(saved: \[4\]\)"):
        rollout_ratio.summarize_run(RunDir(SAVED_AT_4), first=4)


def test_different_batches_are_refused(tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(NO_SAVE, other)
    rows = [json.loads(line) for line in (other / "metrics.jsonl").read_text().splitlines()]
    rows[2]["data"]["response_length/mean"] = 16.0
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    slow, fast = (rollout_ratio.summarize_run(RunDir(p), first=2) for p in (other, NO_SAVE))
    with pytest.raises(UserError, match=r"response_length/mean differs .*not the same batch"):
        rollout_ratio.compare(slow, fast)


def test_cli_writes_the_ratio_of_the_medians(tmp_path: Path) -> None:
    out = tmp_path / "ratio.json"
    cmd = [sys.executable, "-m", "benchmarks.rollout_ratio", str(NO_SAVE), str(SAVED_AT_4)]
    both = ["--labels", "fast,dec01", "--json", str(out)]
    done = subprocess.run([*cmd, *both, "--across-machines"], cwd=ROOT, text=True, capture_output=True)
    assert done.returncode == 0, done.stderr
    assert "dec01: steps [4] saved a checkpoint and are left out" in done.stdout
    summary = json.loads(out.read_text())
    assert summary["same_machine"] is None  # records older than run.json's hardware
    levers, dec01 = _step_times(NO_SAVE), _step_times(SAVED_AT_4)
    expected = statistics.median([levers[s] for s in (2, 3, 4)]) / statistics.median([dec01[2], dec01[3]])
    assert summary["ratios"]["step"] == pytest.approx(expected)

    for name, change in (("failed", {"status": "failed"}), ("cut", None)):
        run = tmp_path / name
        shutil.copytree(NO_SAVE, run)
        if change is None:
            (run / "run.json").unlink()  # killed before it wrote its record
        else:
            record = json.loads((run / "run.json").read_text()) | change
            (run / "run.json").write_text(json.dumps(record))
        refused = subprocess.run([*cmd[:3], str(run), str(NO_SAVE)], cwd=ROOT, text=True, capture_output=True)
        assert refused.returncode == 2 and refused.stderr.startswith("error: "), refused.stderr
        assert ("ended 'failed'" if change else "run.json") in refused.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = subprocess.run([*cmd[:3], str(empty), str(NO_SAVE)], cwd=ROOT, text=True, capture_output=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "is missing" in bad.stderr


def _on(run: Path, where: Path, hardware: dict | None) -> Path:
    shutil.copytree(run, where)
    record = json.loads((where / "run.json").read_text())
    (where / "run.json").write_text(json.dumps(record | {"hardware": hardware}))
    return where


def test_two_machines_are_refused_unless_asked_for(tmp_path: Path) -> None:
    """The ratio of one allocation is the figure; runs of two machines (or that do not say) are refused,
    and compared only with --across-machines, which the summary then says."""
    cmd = [sys.executable, "-m", "benchmarks.rollout_ratio"]
    hf, vllm = _on(HF_H100, tmp_path / "hf", H100), _on(NO_SAVE, tmp_path / "vllm", H100)
    same = subprocess.run([*cmd, str(hf), str(vllm)], cwd=ROOT, text=True, capture_output=True)
    assert same.returncode == 0, same.stderr
    said = " ".join(same.stdout.split())  # rich wraps lines at the terminal width
    assert "on gpu-a: NVIDIA H100 80GB HBM3" in said and "not one machine" not in said

    h200 = H100 | {"host": "gpu-b", "devices": ["NVIDIA H200, 143771 MiB"]}
    other = _on(NO_SAVE, tmp_path / "other", h200)
    refused = subprocess.run([*cmd, str(hf), str(other)], cwd=ROOT, text=True, capture_output=True)
    assert refused.returncode == 2 and refused.stderr.startswith("error: the runs are not on one machine")
    assert "gpu-b: NVIDIA H200" in refused.stderr and "--across-machines" in refused.stderr
    unknown = subprocess.run([*cmd, str(HF_H100), str(vllm)], cwd=ROOT, text=True, capture_output=True)
    assert unknown.returncode == 2 and "not known to be on one machine (hf: not recorded" in unknown.stderr

    out = tmp_path / "across.json"
    asked = [*cmd, str(hf), str(other), "--across-machines", "--json", str(out)]
    across = subprocess.run(asked, cwd=ROOT, text=True, capture_output=True)
    assert across.returncode == 0 and "not one machine" in " ".join(across.stdout.split())
    assert json.loads(out.read_text())["same_machine"] is False


def test_the_hf_rollout_on_a_gpu_machine_is_its_cpu_generation_and_weight_copy() -> None:
    """The kept H100 run: the hf rollout samples in a CPU actor and receives the weights there, so those
    two phases are nearly all of its step; the trainer's phases are under a second."""
    run = rollout_ratio.summarize_run(RunDir(HF_H100), first=2)
    assert run["steps"] == [2, 3, 4] and run["saved_steps_left_out"] == [] and run["hardware"] is None
    phases = {name: p["median"] for name, p in run["phases"].items()}
    assert (phases["gen"] + phases["update_weights"]) / phases["step"] > 0.9
    assert phases["update_actor"] < 1.0 and phases["old_log_prob"] < 1.0
    assert run["batch"] == rollout_ratio.summarize_run(RunDir(NO_SAVE), first=2)["batch"]  # one batch


def test_the_one_allocation_record_replays_to_its_own_ratio(tmp_path: Path) -> None:
    """Both rollouts of one H100 allocation: the ratio recomputed from the kept metrics is the one the
    machine wrote, on one machine and one batch; the fast-text run of the same batch passed its gates."""
    out = tmp_path / "ratio.json"
    cmd = [sys.executable, "-m", "benchmarks.rollout_ratio", "--json", str(out)]
    sides = [str(ONE_ALLOCATION / "grpo" / side) for side in ("hf", "vllm")]
    done = subprocess.run([*cmd, *sides], cwd=ROOT, text=True, capture_output=True)
    assert done.returncode == 0, done.stderr
    replayed = json.loads(out.read_text())
    kept = json.loads((ONE_ALLOCATION / "rollout-ratio.json").read_text())  # written on the machine
    assert replayed["same_machine"] is True and kept["same_machine"] is True
    assert replayed["ratios"] == pytest.approx(kept["ratios"])
    hf, vllm = (_step_times(Path(side)) for side in sides)
    assert replayed["ratios"]["step"] == pytest.approx(
        statistics.median([hf[s] for s in (2, 3, 4)]) / statistics.median([vllm[s] for s in (2, 3, 4)])
    )

    text = rollout_ratio.summarize_run(RunDir(ONE_ALLOCATION / "grpo" / "vllm-fast-text"), first=2)
    assert set(text["gates"].values()) <= {"pass", "skip"}
    assert text["gates"]["rollout_actor_agreement"] == "pass"
    assert {"model.attn_implementation=torch_varlen", "model.text_only=true"} <= set(text["sets"])
    vllm_side = replayed["runs"]["vllm"]
    assert text["batch"] == vllm_side["batch"] and text["hardware"] == vllm_side["hardware"]
