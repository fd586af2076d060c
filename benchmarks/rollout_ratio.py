"""`python -m benchmarks.rollout_ratio HF_RUN VLLM_RUN`: GRPO step time of two rollouts on one batch.

Reads two `engine run` directories (their verl metrics.jsonl and run.json) and compares the steady steps:
every step after the first (which compiles kernels and starts the engines) that saved no checkpoint. A
step holding `timing_s/save_checkpoint` is left out and listed, so a save can never pass for rollout
time; two runs whose steady steps trained different token counts are refused (not the same batch).
Only runs that finished ok (their run.json says so) count. Two runs count as one comparison only on one
machine (the host and accelerators their run.json names): runs of two machines, or of records that do not
say, are refused unless `--across-machines`, and then reported as such. Prints per run the median and
range of the step and of its phases, and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from engine import fsutil
from engine.errors import ArgumentParser, UserError, entry
from engine.run.rundir import RunDir

console = Console()
SCHEMA = "qwen35-grpo-engine/rollout-ratio/1"
SAVE = "timing_s/save_checkpoint"
# verl's step timers, in the order a GRPO step runs them
PHASES = {
    "gen": "timing_s/gen",
    "old_log_prob": "timing_s/old_log_prob",
    "update_actor": "timing_s/update_actor",
    "update_weights": "timing_s/update_weights",
    "step": "timing_s/step",
}
BATCH_KEYS = ("perf/total_num_tokens", "response_length/mean", "prompt_length/mean")


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def steady_steps(run: RunDir, first: int) -> tuple[list[dict[str, Any]], list[int]]:
    """The steps from `first` on that saved no checkpoint, and the steps left out for a save."""
    problem = run.metrics_problem()
    if problem:
        raise UserError(f"{run.path}: its {run.metrics.name} {problem}; pass a finished `engine run` --out")
    rows = [row for row in run.read_metrics() if row["step"] >= first]
    saved = [row["step"] for row in rows if SAVE in row["data"]]
    kept = [row for row in rows if SAVE not in row["data"]]
    if not kept:
        raise UserError(
            f"{run.path}: no step from step {first} on without a checkpoint save (saved: {saved}); "
            "run more steps or with --set trainer.save_freq=-1"
        )
    return kept, saved


def summarize_run(run: RunDir, first: int) -> dict[str, Any]:
    """A finished run's steady steps; a run that did not end ok (failed gates, cut off) is no figure."""
    rows, saved = steady_steps(run, first)
    fix = "pass the --out of an `engine run` that finished"
    record = fsutil.read_json(run.record, "run record", fix)
    if record.get("status") != "ok":
        raise UserError(
            f"{run.record}: the run ended {record.get('status')!r}, not 'ok'; {fix} with its gates passed"
        )
    phases = {}
    for name, key in PHASES.items():
        values = [row["data"][key] for row in rows if key in row["data"]]
        if values:
            phases[name] = _spread(values)
    if "step" not in phases:
        raise UserError(f"{run.path}: its steps hold no {PHASES['step']}; not verl's file logger metrics")
    batch = {key: sorted({row["data"].get(key) for row in rows}, key=str) for key in BATCH_KEYS}
    return {
        "run": str(run.path),
        "recipe": record.get("recipe"),
        "sets": record.get("sets"),
        "status": record.get("status"),
        "gates": {gate["name"]: gate["status"] for gate in record.get("gates") or []},
        "hardware": record.get("hardware"),
        "steps": [row["step"] for row in rows],
        "saved_steps_left_out": saved,
        "phases": phases,
        "batch": batch,
    }


def compare(slow: dict[str, Any], fast: dict[str, Any]) -> dict[str, Any]:
    """Ratios slow/fast of each phase's median; refuses two different batches."""
    for key in BATCH_KEYS:
        if slow["batch"][key] != fast["batch"][key]:
            raise UserError(
                f"{key} differs ({slow['batch'][key]} in {slow['run']}, {fast['batch'][key]} in "
                f"{fast['run']}): not the same batch; run both recipes with the same data and lengths"
            )
    return {
        name: slow["phases"][name]["median"] / fast["phases"][name]["median"]
        for name in PHASES
        if name in slow["phases"] and name in fast["phases"] and fast["phases"][name]["median"] > 0
    }


def machine(run: dict[str, Any]) -> str | None:
    """The host and accelerators a run's record names; None for a record older than that field."""
    hw = run.get("hardware")
    if not hw:
        return None
    return f"{hw.get('host')}: {', '.join(hw.get('devices') or [str(hw.get('accelerator'))])}"


def same_machine(runs: dict[str, dict[str, Any]], across: bool) -> bool | None:
    """Whether both runs name one machine (None: a record does not say); refused unless `across` when
    not known to be one: a step-time ratio of two machines measures the machines too."""
    named = {label: machine(run) for label, run in runs.items()}
    same = None if None in named.values() else len(set(named.values())) == 1
    if not same and not across:
        said = "; ".join(f"{label}: {m or 'not recorded'}" for label, m in named.items())
        raise UserError(
            f"the runs are {'not known to be' if same is None else 'not'} on one machine ({said}); "
            "run both in one allocation, or pass --across-machines to compare them as two machines"
        )
    return same


def _table(runs: dict[str, dict[str, Any]], ratios: dict[str, float]) -> Table:
    table = Table(title="GRPO step (s): median (min-max) over the steady steps, no checkpoint save")
    table.add_column("phase")
    for label, run in runs.items():
        table.add_column(f"{label} (steps {','.join(map(str, run['steps']))})", justify="right")
    table.add_column("ratio", justify="right")
    for name in PHASES:
        cells = []
        for run in runs.values():
            p = run["phases"].get(name)
            cells.append(f"{p['median']:.2f} ({p['min']:.2f}-{p['max']:.2f})" if p else "-")
        table.add_row(name, *cells, f"{ratios[name]:.1f}x" if name in ratios else "-")
    return table


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m benchmarks.rollout_ratio", description=__doc__.splitlines()[0])
    parser.add_argument("slow", type=Path, help="run directory of the slower rollout (the hf one)")
    parser.add_argument("fast", type=Path, help="run directory of the faster rollout (verl's vLLM one)")
    parser.add_argument("--labels", default="hf,vllm", help="names of the two runs (default hf,vllm)")
    parser.add_argument("--first", type=int, default=2, help="first steady step (default 2)")
    parser.add_argument("--json", type=Path, help="write the summary here")
    parser.add_argument(
        "--across-machines",
        action="store_true",
        help="compare runs of two machines (or records that do not name theirs), reported as such",
    )
    args: argparse.Namespace = parser.parse_args(argv)
    labels = args.labels.split(",")
    if len(labels) != 2 or not all(labels):
        raise UserError(f"--labels {args.labels!r}: give two names, e.g. --labels hf,vllm")
    for path in (args.slow, args.fast):
        if not path.is_dir():
            raise UserError(f"{path}: not a directory; pass two `engine run` --out directories")
    runs = {
        label: summarize_run(RunDir(path), args.first)
        for label, path in zip(labels, (args.slow, args.fast), strict=True)
    }
    ratios = compare(*runs.values())
    same = same_machine(runs, args.across_machines)
    console.print(_table(runs, ratios))
    if not same:
        console.print("[bold]not one machine[/]: the ratio includes the machines' difference")
    for label, run in runs.items():
        if run["saved_steps_left_out"]:
            console.print(f"{label}: steps {run['saved_steps_left_out']} saved a checkpoint and are left out")
        where = machine(run) or "a machine its record does not name"
        console.print(f"{label}: {run['recipe']} {run['status']}, gates {run['gates']}, on {where}")
    summary = {"schema": SCHEMA, "first_steady_step": args.first, "same_machine": same}
    summary |= {"runs": runs, "ratios": ratios}
    if args.json:
        fsutil.atomic_write(args.json, json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    entry(main)
