"""Correctness gates over a run's step metrics: did this launch train GRPO *right*, not merely run?

verl exits 0 from loops that train nothing useful: a weight sync that stops reaching the rollout, a
zero gradient because every GRPO group scored alike, a NaN loss, a reward that never moves. Each gate
reads verl's per-step metrics (the rows of `metrics.jsonl`) and answers pass, fail or skip (the run
lacks what the gate needs, e.g. the rollout log-probs or enough steps). Nothing here knows a device:
the thresholds are data, keyed by device (agreement) and by recipe (learning), each with its source.
`engine run` prints the results, writes them into run.json and exits 3 when one fails.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from engine import bounds

PASS, FAIL, SKIP = "pass", "fail", "skip"
EXIT_GATE_FAILED = 3

REWARD = "critic/score/mean"
PROBS_DIFF_MAX = "training/rollout_probs_diff_max"
PROBS_DIFF_MEAN = "training/rollout_probs_diff_mean"
PROBS_DIFF_VALID = "training/rollout_probs_diff_valid"
PROBS_CORR = "training/rollout_actor_probs_pearson_corr"
GRAD_NORM = "actor/grad_norm"
ADV_MAX, ADV_MIN = "critic/advantages/max", "critic/advantages/min"
FINITE_KEYS = ("actor/pg_loss", GRAD_NORM, "actor/entropy", REWARD)


@dataclass(frozen=True)
class Agreement:
    """Bound on a rollout/actor agreement metric of verl at every step: a ceiling on a probability gap
    (|p_rollout - p_actor| over the step's response tokens: its max, or its mean where precision
    differs by design), or a floor on their Pearson correlation (`floor=True`), which a constant
    rescaling of the rollout's probabilities leaves alone."""

    metric: str
    limit: float
    source: str
    floor: bool = False
    # floors only: a later step may also fall at most this far below the first logged step. At step 1
    # the rollout and the actor hold the same weights, so its value is the two engines' numerical
    # agreement; a rollout that misses updates falls away from it as the actor moves
    max_drop: float | None = None

    def holds(self, value: float | None, first: float | None = None) -> bool:
        """Within the bound; a missing, NaN or infinite value never holds (engine.bounds)."""
        if not self.floor:
            return bounds.at_most(value, self.limit)
        drop = self.max_drop
        if drop is not None and first is not None and not bounds.at_least(value, first - drop):
            return False
        return bounds.at_least(value, self.limit)


@dataclass(frozen=True)
class Learning:
    """Mean reward of the last `window` steps must exceed that of the first `window` by `margin`."""

    window: int
    margin: float
    source: str


# The rollout's probabilities of its sampled tokens and the actor's recomputed ones come from the same
# weights when the sync works: a gap far above float rounding means the rollout sampled from other
# weights than the actor trained. npu: no entry until measured on a run (the gate skips).
AGREEMENT: dict[str, Agreement] = {
    "cpu": Agreement(
        metric=PROBS_DIFF_MAX,
        limit=1e-4,
        source="docs/reference/gates.md: fp32 actor; healthy <= 7.2e-7 (3 seeds, 30 steps), no sync 1.2e-3 "
        "at step 2",
    ),
    # bf16 vLLM against the actor: gaps are not float rounding, so the correlation, not the gap
    "gpu": Agreement(
        metric=PROBS_CORR,
        limit=0.99,
        floor=True,
        max_drop=0.05,
        source="docs/reference/performance.md: vLLM on 1x H200, healthy >= 0.9971 (4 steps), no sync "
        "0.76/0.65/0.41",
    ),
    # MoE: vLLM's fused experts and transformers' grouped_mm pick other top-8 experts for some tokens in
    # bf16, so the two engines agree less from step 1 on, by an amount that updates do not grow but that
    # varies from step to step; a missed update costs far more at once
    "gpu-moe": Agreement(
        metric=PROBS_CORR,
        limit=0.8,
        floor=True,
        max_drop=0.15,
        source="docs/reference/performance.md: 35B-A3B shape on 1x H200, healthy 0.931/0.949/0.917/0.952 and "
        "0.953/0.895/0.954/0.969 (largest fall below step 1: 0.058, while the log-ppl gap shrank "
        "0.073 -> 0.033); weight sync broken 0.936 -> 0.531/0.380/0.188 (fall 0.405 at step 2)",
    ),
}


def agreement_for(device: str, moe: bool = False) -> Agreement | None:
    """The device's agreement bound; MoE models have their own where one is measured."""
    return AGREEMENT.get(f"{device}-moe") if moe and f"{device}-moe" in AGREEMENT else AGREEMENT.get(device)


# Learning criteria are claims about one recipe's task, measured on its run-to-run spread.
LEARNING: dict[str, Learning] = {
    "tiny_cpu_learn": Learning(
        window=5,
        margin=0.10,
        source="docs/reference/gates.md: 3 seeds rise by 0.170-0.175; lr 0 and no-sync runs by 0.005 "
        "(step sd 0.011)",
    ),
}


@dataclass(frozen=True)
class GateResult:
    name: str
    status: str
    detail: str
    first_failed_step: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _steps(rows: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    return [(int(row["step"]), row.get("data", {})) for row in sorted(rows, key=lambda r: int(r["step"]))]


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def agreement(
    rows: list[dict[str, Any]], limit: Agreement | None, name: str = "rollout_actor_agreement"
) -> GateResult:
    if limit is None:
        return GateResult(name, SKIP, "no agreement threshold for this device")
    key = limit.metric
    gaps = [
        (step, _number(data.get(key)))
        for step, data in _steps(rows)
        if key in data and data.get(PROBS_DIFF_VALID, 1) == 1
    ]
    if not gaps:
        return GateResult(name, SKIP, f"no {key} logged (rollout.calculate_log_probs off?)")
    first = gaps[0][1]
    bad = [(step, gap) for step, gap in gaps if not limit.holds(gap, first)]
    finite_gaps = [value for _, gap in gaps if (value := bounds.finite(gap)) is not None]
    worst = (min if limit.floor else max)(finite_gaps, default=float("nan"))
    wrong, right, extreme = ("<", ">=", "smallest") if limit.floor else (">", "<=", "largest")
    bound = f"{limit.limit:g}"
    drop = limit.max_drop if limit.floor else None
    start = bounds.finite(first)
    if drop is not None and start is not None and bounds.above(start - drop, limit.limit):
        bound = f"{start - drop:.3g} (step {gaps[0][0]}'s {start:.3g} - {drop:g})"  # the tighter bound
    if bad:
        step, gap = bad[0]
        shown = "missing" if gap is None else format(gap, ".3g")
        return GateResult(
            name,
            FAIL,
            f"{key} {shown} {wrong} {bound} at step {step} ({len(bad)} of {len(gaps)} steps): "
            "the rollout did not sample from the weights the actor trained",
            step,
        )
    detail = f"{extreme} {key} {worst:.3g} {right} {bound} over {len(gaps)} steps"
    return GateResult(name, PASS, detail)


def finite(rows: list[dict[str, Any]]) -> GateResult:
    name = "finite_losses"
    if not rows:
        return GateResult(name, SKIP, "no steps logged")
    for step, data in _steps(rows):
        for key in FINITE_KEYS:
            if bounds.finite(data.get(key)) is None:
                return GateResult(name, FAIL, f"{key} is {data.get(key)!r} at step {step}", step)
    return GateResult(name, PASS, f"{', '.join(FINITE_KEYS)} finite at all {len(rows)} steps")


def signal(rows: list[dict[str, Any]]) -> GateResult:
    """Some GRPO group had unequal rewards (advantages not all 0) and the gradient was non-zero."""
    name = "grpo_signal"
    if not rows:
        return GateResult(name, SKIP, "no steps logged")
    for step, data in _steps(rows):
        grad, high, low = (data.get(key) for key in (GRAD_NORM, ADV_MAX, ADV_MIN))
        if not bounds.above(high, low):
            detail = f"every GRPO group scored alike at step {step} (all advantages 0)"
            return GateResult(name, FAIL, detail, step)
        if not bounds.above(grad, 0):
            return GateResult(name, FAIL, f"{GRAD_NORM} is {grad} at step {step}", step)
    return GateResult(name, PASS, f"reward spread in groups and grad_norm > 0 at all {len(rows)} steps")


def learning(rows: list[dict[str, Any]], criterion: Learning | None) -> GateResult:
    name = "learning"
    if criterion is None:
        return GateResult(name, SKIP, "no learning criterion for this recipe")
    steps = _steps(rows)
    k = criterion.window
    if not steps:
        return GateResult(name, SKIP, "no steps logged")
    if steps[0][0] != 1:
        detail = f"this launch began at step {steps[0][0]}; the criterion needs the run from step 1"
        return GateResult(name, SKIP, detail)
    if len(steps) < 2 * k:
        return GateResult(name, SKIP, f"{len(steps)} steps logged; the criterion needs {2 * k}")
    rewards = [bounds.finite(data.get(REWARD)) for _, data in steps]
    if any(value is None for value in rewards):
        return GateResult(name, FAIL, f"{REWARD} missing or not finite at some step")
    start, end = sum(rewards[:k]) / k, sum(rewards[-k:]) / k  # type: ignore[arg-type]
    detail = (
        f"mean reward of the last {k} steps {end:.4f} - first {k} {start:.4f} = {end - start:+.4f} "
        f"(needs > {criterion.margin:g})"
    )
    return GateResult(name, PASS if bounds.above(end - start, criterion.margin) else FAIL, detail)


def evaluate(rows: list[dict[str, Any]], device: str, recipe: str, moe: bool = False) -> list[GateResult]:
    """Every gate over one launch's metric rows ({"step": n, "data": {...}}, verl's file-logger layout)."""
    return [
        agreement(rows, agreement_for(device, moe)),
        finite(rows),
        signal(rows),
        learning(rows, LEARNING.get(recipe)),
    ]


# Negative controls (`engine run --control FAULT`, engine.runtime.mutations): the gate that must fail
# when the loop is broken this way. A control passes only when it does: a gate that never failed on a
# broken loop proves nothing about a healthy one.
CONTROLS: dict[str, str] = {
    "no_weight_sync": "rollout_actor_agreement",
    "negate_advantages": "learning",
    "zero_lr": "learning",
}


def caught(results: list[GateResult], fault: str) -> bool:
    """Whether the gate that must catch `fault` failed."""
    return any(r.name == CONTROLS[fault] and r.status == FAIL for r in results)


def failed(results: list[GateResult]) -> list[GateResult]:
    return [result for result in results if result.status == FAIL]


def summary_lines(results: list[GateResult]) -> list[str]:
    return [f"gate {result.name}: {result.status.upper()} - {result.detail}" for result in results]
