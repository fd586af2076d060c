"""`python -m engine smoke-report RUN_DIR`: gates and figures of an accelerator GRPO smoke run.

A smoke that only exits 0 proves little: a rollout with stale weights, NaN losses or groups with equal
rewards (zero advantages, zero gradient) all finish cleanly. This reads verl's metrics of a finished
`engine run` and checks, at every step:

- rollout vs actor agreement: verl's `training/rollout_probs_diff_mean` (mean |p_rollout - p_actor|
  over response tokens) stays under its ceiling and `training/rollout_actor_probs_pearson_corr` above
  its floor. The rollout samples with the weights synced after the previous update and the actor
  recomputes with its own, so a broken sync shows as a gap of the size of the updates since the last
  good sync; `--drift` measures that size (initial model vs the trained export). The correlation is
  the gate that separates: it ignores a constant rescaling of the rollout's probabilities, which
  verl's vLLM rollout applies when the tokenizer is shorter than the model's vocabulary (ids past
  `len(tokenizer)` are masked before sampling, the actor normalises over all of them), so
  `rollout_corr/log_ppl_abs_diff` is reported, not gated (docs/reference/performance.md). The correlation's
  bound is the GPU gate of the run's model kind (`engine.run.gates`: dense or MoE, whose bf16 routing
  makes the engines agree less from step 1 on), a floor and a largest fall below step 1;
- finite losses and grad norms;
- a learning signal: nonzero advantages (reward variance inside GRPO groups) and a nonzero grad norm.

It also splits each step's time (generation, log-probs, update, weight sync), derives the rollout's
tokens/s and reads the trainer's peak memory. The report goes to RUN_DIR/smoke_report.json; the exit
code is 1 when a gate fails.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine import bounds, fsutil
from engine.errors import ArgumentParser, UserError
from engine.recipes import models
from engine.run import devices, gates
from engine.run.rundir import RunDir, read_metrics

SPLIT = {  # report name -> verl timer (timing_s/<name>)
    "generation": "gen",
    "old_log_prob": "old_log_prob",
    "update_actor": "update_actor",
    "weight_sync": "update_weights",
    "reward": "reward",
    "step": "step",
}
PROBS_DIFF = "training/rollout_probs_diff_mean"
LOG_PPL_DIFF = "rollout_corr/log_ppl_abs_diff"


def _first(data: dict[str, Any], *keys: str) -> Any:
    return next((data[key] for key in keys if key in data), None)


def step_figures(data: dict[str, Any], sequences: int) -> dict[str, Any]:
    """One step's split, rollout throughput and peak memory (None where verl did not log it)."""
    split = {name: data.get(f"timing_s/{key}") for name, key in SPLIT.items()}
    gen, length = split["generation"], data.get("response_length/mean")
    tokens = length * sequences if bounds.finite(length) is not None else None
    return {
        **{f"{name}_s": value for name, value in split.items()},
        "response_tokens": tokens,
        "rollout_tokens_per_s": tokens / gen if tokens and bounds.above(gen, 0) else None,
        # verl 0.9.1 logs the actor's as actor/perf/...; older releases as perf/...
        "trainer_peak_allocated_gib": _first(
            data, "actor/perf/max_memory_allocated_gb", "perf/max_memory_allocated_gb"
        ),
        "trainer_peak_reserved_gib": _first(
            data, "actor/perf/max_memory_reserved_gb", "perf/max_memory_reserved_gb"
        ),
    }


def run_gates(
    rows: list[dict[str, Any]], max_probs_diff: float, min_probs_corr: float | None, moe: bool
) -> list:
    """The project's correctness gates (engine.run.gates) with this smoke's agreement thresholds: the
    GPU correlation bound of the model kind (dense or MoE), its floor replaced by --min-probs-corr."""
    source = "smoke-report threshold (--max-probs-diff / --min-probs-corr)"
    corr = corr_bound(moe, min_probs_corr)
    return [
        gates.agreement(rows, gates.Agreement(PROBS_DIFF, max_probs_diff, source), "rollout_probs_diff"),
        gates.agreement(rows, corr, "rollout_probs_corr"),
        gates.finite(rows),
        gates.signal(rows),
    ]


def corr_bound(moe: bool, min_probs_corr: float | None) -> gates.Agreement:
    bound = gates.agreement_for("gpu", moe)
    assert bound is not None  # the gpu entries exist
    if min_probs_corr is None:
        return bound
    return replace(bound, limit=min_probs_corr, source="smoke-report --min-probs-corr")


def _recipe_facts(run_dir: Path) -> tuple[int, bool]:
    """Responses per step (prompts x group size) and whether the model is MoE, from the recipe `engine
    run` saved."""
    path = RunDir(run_dir).recipe
    if not path.is_file():
        raise UserError(f"{run_dir}: no recipe.yaml; pass a directory written by `engine run`")
    recipe = fsutil.read_yaml(path, "recipe", "pass a directory written by `engine run`")
    try:
        sequences = int(recipe["data"]["train_batch_size"]) * int(recipe["rollout"]["n"])
    except (TypeError, KeyError, ValueError):
        raise UserError(f"{path}: no data.train_batch_size or rollout.n; not a resolved recipe") from None
    name = (recipe.get("model") or {}).get("name")
    return sequences, bool(name) and models.lookup(str(name)).moe  # no model named: judged as dense


def report(run_dir: Path, max_probs_diff: float, min_probs_corr: float | None) -> dict[str, Any]:
    rows = read_metrics(RunDir(run_dir).metrics)
    if not rows:
        raise UserError(f"{run_dir}: metrics.jsonl has no steps; run `engine run` first")
    sequences, moe = _recipe_facts(run_dir)
    steps = []
    for row in rows:
        data = row.get("data", {})
        steps.append(
            {
                "step": int(row["step"]),
                "probs_diff_mean": data.get(PROBS_DIFF),
                "probs_diff_max": data.get("training/rollout_probs_diff_max"),
                "probs_corr": data.get(gates.PROBS_CORR),
                "log_ppl_abs_diff": data.get(LOG_PPL_DIFF),
                "reward_mean": data.get("critic/score/mean"),
                "grad_norm": data.get("actor/grad_norm"),
                "pg_loss": data.get("actor/pg_loss"),
                **step_figures(data, sequences),
            }
        )
    checks = run_gates(rows, max_probs_diff, min_probs_corr, moe)
    corr = corr_bound(moe, min_probs_corr)
    return {
        "run_dir": str(run_dir),
        "thresholds": {
            "rollout_probs_diff_mean": max_probs_diff,
            "rollout_actor_probs_corr": corr.limit,
            "rollout_actor_probs_corr_max_drop": corr.max_drop,
        },
        "sequences_per_step": sequences,
        # the whole device (trainer and the colocated rollout), nvidia-smi's samples during the launch
        "device_peak_memory_mib": devices.peak_memory_mib(RunDir(run_dir).gpu_memory),
        "steps": steps,
        "gates": [check.as_dict() for check in checks],
        # a smoke must show each gate holding: a gate skipped for a missing metric does not pass
        "passed": all(check.status == gates.PASS for check in checks),
    }


def drift(initial: Path, trained: Path, prompts: int = 8, new_tokens: int = 32) -> dict[str, float]:
    """How far training moved the policy: sample from the trained model, score under both models.

    This is what a rollout that never received the updates would differ by at the last step.
    """
    import torch
    from transformers import AutoConfig

    from engine.checkpoint.verify import model_class

    device = "cuda" if torch.cuda.is_available() else "cpu"
    load = {"dtype": torch.bfloat16 if device == "cuda" else torch.float32}
    cls = model_class(AutoConfig.from_pretrained(trained))
    new = cls.from_pretrained(trained, **load).to(device).eval()
    old = cls.from_pretrained(initial, **load).to(device).eval()
    generator = torch.Generator(device="cpu").manual_seed(0)
    start = torch.randint(0, new.config.get_text_config().vocab_size, (prompts, 8), generator=generator)
    with torch.no_grad():
        seqs = new.generate(start.to(device), max_new_tokens=new_tokens, do_sample=True, top_k=0)
        scored = []
        for model in (new, old):
            logits = model(seqs).logits[:, start.shape[1] - 1 : -1].float()
            scored.append(torch.log_softmax(logits, -1).gather(-1, seqs[:, start.shape[1] :, None])[..., 0])
    gap = (scored[0].exp() - scored[1].exp()).abs()
    log_ppl = (scored[0].mean(-1) - scored[1].mean(-1)).abs()
    return {"probs_diff_mean": gap.mean().item(), "log_ppl_abs_diff": log_ppl.mean().item()}


def _table(result: dict[str, Any]) -> str:
    head = "step  probs_diff  probs_corr  log_ppl_diff  reward  grad_norm"
    head += "  gen_s  logprob_s  update_s  sync_s  step_s  tok/s"
    lines = [head]
    for s in result["steps"]:
        cells = [
            s["probs_diff_mean"],
            s["probs_corr"],
            s["log_ppl_abs_diff"],
            s["reward_mean"],
            s["grad_norm"],
        ]
        cells += [s[k] for k in ("generation_s", "old_log_prob_s", "update_actor_s", "weight_sync_s")]
        cells += [s["step_s"], s["rollout_tokens_per_s"]]
        text = "  ".join(format(c, ".4g") if bounds.finite(c) is not None else "-" for c in cells)
        lines.append(f"{s['step']:>4}  {text}")
    lines += [f"gate {g['name']}: {g['status'].upper()} - {g['detail']}" for g in result["gates"]]
    return "\n".join(lines)


def cli_main(argv: list[str]) -> int:
    prog, about = "python -m engine smoke-report", __doc__.splitlines()[0]
    parser = ArgumentParser(prog=prog, description=about)
    parser.add_argument("run_dir", type=Path, help="directory written by `engine run`")
    parser.add_argument(
        "--max-probs-diff", type=bounds.finite_float, default=0.01, help="gate on verl's probs diff mean"
    )
    parser.add_argument(
        "--min-probs-corr",
        type=bounds.finite_float,
        default=None,
        help="floor on verl's probs corr (default: the GPU gate of the run's model kind, dense or MoE)",
    )
    parser.add_argument("--drift", nargs=2, type=Path, metavar=("INITIAL", "TRAINED"), help="HF model dirs")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        raise UserError(f"{args.run_dir}: no such run directory; pass the --out of `engine run`")
    target = fsutil.check_out_file(args.run_dir / "smoke_report.json", "report", reuse=lambda _: None)
    result = report(args.run_dir, args.max_probs_diff, args.min_probs_corr)
    if args.drift:
        for path in args.drift:
            if not (path / "config.json").is_file():
                raise UserError(f"--drift {path}: not a Hugging Face model directory (no config.json)")
        moved = drift(*args.drift)
        result["drift"] = moved
        result["drift_exceeds_thresholds"] = not bounds.at_most(moved["probs_diff_mean"], args.max_probs_diff)
    fsutil.atomic_write(target, json.dumps(result, indent=2) + "\n")
    print(_table(result))
    if "drift" in result:
        print(f"drift initial -> trained: {result['drift']}")
    if result["device_peak_memory_mib"]:
        print(f"device peak memory (nvidia-smi): {result['device_peak_memory_mib']} MiB")
    print(f"gates {'passed' if result['passed'] else 'FAILED'}: {args.run_dir / 'smoke_report.json'}")
    return 0 if result["passed"] else 1
