"""The correctness gates (engine/run/gates.py) over metric rows, and the test-only breakages that the slow
runs use to show the gates failing (engine/runtime/mutations.py), applied to the installed verl."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from engine.run import gates
from engine.runtime import mutations
from tests.conftest import ROOT

CPU = gates.AGREEMENT["cpu"]
LEARN = gates.LEARNING["tiny_cpu_learn"]


def row(step: int, reward: float = 0.1, gap: float = 5e-6, **extra: float) -> dict:
    data = {
        gates.REWARD: reward,
        CPU.metric: gap,
        gates.PROBS_DIFF_VALID: 1,
        gates.GRAD_NORM: 0.9,
        gates.ADV_MAX: 1.5,
        gates.ADV_MIN: -1.2,
        "actor/pg_loss": 1e-8,
        "actor/entropy": 6.2,
    }
    return {"step": step, "data": data | extra}


def by_name(results: list[gates.GateResult]) -> dict[str, gates.GateResult]:
    return {result.name: result for result in results}


def rising(steps: int, start: float, end: float) -> list[dict]:
    return [row(s, reward=start + (end - start) * (s - 1) / (steps - 1)) for s in range(1, steps + 1)]


def test_a_healthy_learning_run_passes_every_gate() -> None:
    results = gates.evaluate(rising(30, 0.07, 0.07 + 2 * LEARN.margin), "cpu", "tiny_cpu_learn")
    assert [r.status for r in results] == [gates.PASS] * 4, gates.summary_lines(results)
    assert not gates.failed(results)


def test_agreement_fails_at_the_first_step_over_the_threshold() -> None:
    rows = [row(1), row(2, gap=CPU.limit * 50), row(3, gap=CPU.limit * 80)]
    result = gates.agreement(rows, CPU)
    assert result.status == gates.FAIL and result.first_failed_step == 2
    assert "2 of 3 steps" in result.detail
    assert gates.agreement(rows[:1], CPU).status == gates.PASS
    nan = gates.agreement([row(1, gap=math.nan)], CPU)
    assert nan.status == gates.FAIL  # a NaN gap is no evidence of agreement


def test_gpu_agreement_is_a_floor_on_the_correlation() -> None:
    gpu = gates.AGREEMENT["gpu"]
    assert gpu.floor and gpu.metric == gates.PROBS_CORR
    rows = [row(1, **{gpu.metric: 0.998}), row(2, **{gpu.metric: 0.76}), row(3, **{gpu.metric: 0.41})]
    result = gates.agreement(rows, gpu)
    assert result.status == gates.FAIL and result.first_failed_step == 2
    assert "0.76 < 0.99" in result.detail and "2 of 3 steps" in result.detail
    assert gates.agreement(rows[:1], gpu).status == gates.PASS
    assert gates.agreement([row(1, **{gpu.metric: math.nan})], gpu).status == gates.FAIL


def test_gpu_agreement_also_bounds_the_drop_from_step_one() -> None:
    """At step 1 rollout and actor hold the same weights: later steps may not fall far below it, even
    above the absolute floor (MoE: the engines agree less from the start, by a constant)."""
    moe = gates.agreement_for("gpu", moe=True)
    assert moe is gates.AGREEMENT["gpu-moe"] and gates.agreement_for("gpu") is gates.AGREEMENT["gpu"]
    assert gates.agreement_for("cpu", moe=True) is CPU  # no MoE entry: the device's own
    healthy = [row(s, **{moe.metric: c}) for s, c in enumerate([0.931, 0.949, 0.917, 0.952], 1)]
    assert gates.agreement(healthy, moe).status == gates.PASS
    # the first step itself high, then a fall that stays above the floor but not near step 1
    fallen = [row(1, **{moe.metric: 0.99}), row(2, **{moe.metric: 0.82})]
    result = gates.agreement(fallen, moe)
    assert result.status == gates.FAIL and result.first_failed_step == 2
    assert "0.84 (step 1's 0.99 - 0.15)" in result.detail
    assert gates.agreement([row(1, **{moe.metric: 0.79})], moe).status == gates.FAIL  # the absolute floor
    results = by_name(gates.evaluate(healthy, "gpu", "x", moe=True))
    assert results["rollout_actor_agreement"].status == gates.PASS
    assert by_name(gates.evaluate(healthy, "gpu", "x"))["rollout_actor_agreement"].status == gates.FAIL


def test_no_bound_passes_an_infinite_or_nan_value() -> None:
    """`inf >= floor` is true and `nan < floor` false: each gate asks engine.bounds, not the operators."""
    gpu = gates.AGREEMENT["gpu"]
    for value in (math.inf, -math.inf, math.nan):
        assert gates.agreement([row(1, gap=value)], CPU).status == gates.FAIL, value
        assert gates.agreement([row(1, **{gpu.metric: value})], gpu).status == gates.FAIL, value
        # a non-finite step 1 is no reference for the steps after it
        later = [row(1, **{gpu.metric: value}), row(2, **{gpu.metric: 0.998})]
        assert gates.agreement(later, gpu).status == gates.FAIL, value
    spread = [row(1), row(2, **{gates.ADV_MAX: math.inf, gates.ADV_MIN: -math.inf})]
    assert gates.signal(spread).first_failed_step == 2
    assert gates.signal([row(1, **{gates.ADV_MAX: math.nan})]).status == gates.FAIL
    assert gates.signal([row(1, **{gates.GRAD_NORM: math.inf})]).status == gates.FAIL
    flat = gates.Learning(window=2, margin=math.nan, source="test")
    assert gates.learning(rising(4, 0.0, 1.0), flat).status == gates.FAIL


def test_agreement_skips_without_rollout_log_probs_or_a_threshold() -> None:
    plain = [{"step": 1, "data": {gates.REWARD: 0.1}}]
    assert gates.agreement(plain, CPU).status == gates.SKIP
    invalid = [row(1, gap=math.nan, **{gates.PROBS_DIFF_VALID: 0})]  # verl: no response tokens
    assert gates.agreement(invalid, CPU).status == gates.SKIP
    assert by_name(gates.evaluate([row(1)], "tpu", "x"))["rollout_actor_agreement"].status == gates.SKIP


@pytest.mark.parametrize("key", ["actor/pg_loss", gates.GRAD_NORM, "actor/entropy", gates.REWARD])
def test_finite_fails_on_nan_inf_or_missing(key: str) -> None:
    for bad in (math.nan, math.inf, None):
        rows = [row(1), row(2, **{key: bad})]
        result = gates.finite(rows)
        assert result.status == gates.FAIL and result.first_failed_step == 2, (key, bad)


def test_signal_needs_unequal_rewards_in_some_group_and_a_gradient() -> None:
    alike = [row(1), row(2, **{gates.ADV_MAX: 0.0, gates.ADV_MIN: 0.0})]
    assert gates.signal(alike).first_failed_step == 2
    still = [row(1, **{gates.GRAD_NORM: 0.0})]
    assert gates.signal(still).status == gates.FAIL
    assert gates.signal([row(1), row(2)]).status == gates.PASS


def test_learning_criterion() -> None:
    k, margin = LEARN.window, LEARN.margin
    assert gates.learning(rising(30, 0.07, 0.07 + 2 * margin), LEARN).status == gates.PASS
    flat = gates.learning(rising(30, 0.07, 0.07), LEARN)
    assert flat.status == gates.FAIL and "+0.0000" in flat.detail
    falling = gates.learning(rising(30, 0.3, 0.05), LEARN)
    assert falling.status == gates.FAIL
    # only the two windows count: a jump of half the margin at the end does not pass
    jump = [row(s, reward=0.1 if s <= 30 - k else 0.1 + margin / 2) for s in range(1, 31)]
    assert gates.learning(jump, LEARN).status == gates.FAIL
    assert gates.learning(rising(2 * k - 1, 0.0, 1.0), LEARN).status == gates.SKIP
    resumed = rising(30, 0.0, 1.0)[10:]  # a launch that resumed at step 11
    assert gates.learning(resumed, LEARN).status == gates.SKIP
    assert gates.learning(rising(30, 0.0, 1.0), None).status == gates.SKIP
    assert gates.learning([], LEARN).detail == "no steps logged"  # e.g. the checkpoint was already final
    assert [r.status for r in gates.evaluate([], "cpu", "tiny_cpu_learn")] == [gates.SKIP] * 4


def test_results_serialise_for_the_run_record() -> None:
    results = gates.evaluate([row(1), row(2, gap=1.0)], "cpu", "tiny_cpu")
    record = [r.as_dict() for r in results]
    assert record[0] == {
        "name": "rollout_actor_agreement",
        "status": "fail",
        "detail": results[0].detail,
        "first_failed_step": 2,
    }
    assert [r["status"] for r in record[1:]] == ["pass", "pass", "skip"]
    lines = gates.summary_lines(results)
    assert lines[0].startswith("gate rollout_actor_agreement: FAIL - ")


# ----------------------------------------------------------------------------- test-only breakages
def test_unknown_breakage_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mutations.ENV, "no_sync")
    with pytest.raises(ValueError, match="no_weight_sync"):
        mutations.selected()
    monkeypatch.setenv(mutations.ENV, "")
    assert mutations.selected() is None and mutations.install() is None


def test_unknown_breakage_stops_every_verl_process_at_import() -> None:
    env = dict(os.environ) | {
        "VERL_USE_EXTERNAL_MODULES": "engine.verl_ext",
        "PYTHONPATH": str(ROOT),
        mutations.ENV: "half_sync",
    }
    done = subprocess.run(
        [sys.executable, "-c", "import verl"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: {mutations.ENV}='half_sync'")


def test_negate_advantages_flips_verls_grpo_advantages(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np
    import torch
    from verl.trainer.ppo import core_algos

    original = core_algos.compute_grpo_outcome_advantage
    monkeypatch.setattr(core_algos, "compute_grpo_outcome_advantage", original)  # restored afterwards
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = torch.tensor([0.1, 0.5, 0.2, 1.0])
    mask, groups = torch.ones(4, 3), np.array([0, 0, 1, 1])
    args = {"token_level_rewards": rewards, "response_mask": mask, "index": groups}
    plain, _ = original(**args)
    monkeypatch.setenv(mutations.ENV, mutations.NEGATE_ADVANTAGES)
    assert mutations.install() == mutations.NEGATE_ADVANTAGES
    mutations.install()  # idempotent: a second import of the extension does not flip the sign back
    flipped, returns = core_algos.compute_grpo_outcome_advantage(**args)
    assert plain.abs().sum() > 0
    assert torch.equal(flipped, -plain) and torch.equal(returns, -plain)


def test_zero_lr_reaches_verls_optimizer_and_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from verl.utils.torch_functional import get_constant_schedule_with_warmup
    from verl.workers.config import optimizer as optim_mod

    monkeypatch.setattr(optim_mod, "build_optimizer", optim_mod.build_optimizer)
    monkeypatch.setenv(mutations.ENV, mutations.ZERO_LR)
    mutations.install()
    layer = torch.nn.Linear(3, 3)
    before = layer.weight.detach().clone()
    opt = optim_mod.build_optimizer(layer.parameters(), optim_mod.FSDPOptimizerConfig(lr=1e-2))
    scheduler = get_constant_schedule_with_warmup(opt, num_warmup_steps=0)
    layer(torch.ones(1, 3)).sum().backward()
    opt.step()
    scheduler.step()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
    assert torch.equal(layer.weight, before)
    assert scheduler.get_last_lr() == [0.0]
