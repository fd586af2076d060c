"""`python -m benchmarks.memory_check ROWS.jsonl --recipe NAME`: preflight's memory estimate
(engine/preflight/memory.py) against the peaks `benchmarks.gpu_bench` measured, one row per shape.

Each measured row (batch/mbs/seq on N GPUs, its levers) becomes the recipe with the row's levers, one
optimizer step of batch x N sequences in micro-batches of mbs, a prompt and a response of seq/2 each
and N-way FSDP, so the estimate sees the step the benchmark ran. Prints a
markdown table (measured, estimated, error) and exits 1 when an error exceeds --tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine import bounds
from engine.errors import ArgumentParser, UserError, entry
from engine.preflight.memory import memory_estimate
from engine.recipes import loader, plan
from engine.recipes.levers import lever_names, lever_sets


def estimate_row(recipe: str, row: dict[str, Any], sets: list[str]) -> float:
    """The train-phase estimate (GiB per device) of `recipe` at the row's shape, with the row's levers."""
    half = row["seq"] // 2
    sequences = row["batch"] * row["gpus"]  # one optimizer step of the row: its micro-batches per step
    shape = [
        f"data.train_batch_size={sequences}",
        f"actor.ppo_mini_batch_size={sequences}",
        "rollout.n=1",
        f"actor.ppo_micro_batch_size_per_device={row['mbs']}",
        f"data.max_prompt_length={half}",
        f"data.max_response_length={row['seq'] - half}",
        f"parallel.fsdp={row['gpus']}",
        f"cluster.devices_per_node={row['gpus']}",
    ]
    levers = lever_sets(lever_names(row.get("levers", "baseline")))
    resolved = loader.load(recipe, "gpu", [*sets, *levers, *shape])
    return memory_estimate(plan.compile_recipe(resolved))["train_gib"]


def compare(paths: list[Path], recipe: str, sets: list[str], modes: tuple[str, ...]) -> list[dict]:
    rows = []
    for path in paths:
        try:
            lines = path.read_text().splitlines()
        except OSError as err:
            raise UserError(f"{path}: cannot read ({err.strerror}); pass gpu_bench's --out rows") from None
        for line in lines:
            row = json.loads(line)
            if "error" in row or row.get("mode") not in modes:
                continue
            estimate = estimate_row(recipe, row, sets)
            measured = row["peak_alloc_gib"]
            rows.append(row | {"estimate_gib": estimate, "error": estimate / measured - 1})
    return rows


def markdown(rows: list[dict]) -> str:
    text = "| run | levers | GPUs | batch/mbs/seq | measured GiB | estimate GiB | error |\n"
    text += "|---|---|---|---|---|---|---|\n"
    for r in rows:
        shape = f"{r['batch']}/{r['mbs']}/{r['seq']}"
        text += f"| {r['mode']} | {r.get('levers', 'baseline')} | {r['gpus']} | {shape} | "
        text += f"{r['peak_alloc_gib']:.2f} | "
        text += f"{r['estimate_gib']:.2f} | {100 * r['error']:+.1f}% |\n"
    return text


def cli_main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m benchmarks.memory_check", description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="+", type=Path, help="JSON lines written by `benchmarks.gpu_bench run`")
    parser.add_argument("--recipe", required=True, help="recipe whose model and settings were benchmarked")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="recipe --set, repeatable")
    parser.add_argument("--modes", default="verl-packed,verl-padded", help="bench modes to compare")
    tolerance = bounds.finite_float
    parser.add_argument("--tolerance", type=tolerance, default=0.15, help="largest |error| that passes")
    args = parser.parse_args(argv)
    rows = compare(args.rows, args.recipe, ["actor.strategy=fsdp2", *args.sets], tuple(args.modes.split(",")))
    if not rows:
        raise UserError("no measured rows of the given --modes in the files")
    print(markdown(rows), end="")
    worst = max(abs(r["error"]) for r in rows)  # max() skips a NaN unless it comes first: not the gate
    print(f"largest |error| {100 * worst:.1f}% (tolerance {100 * args.tolerance:.0f}%)")
    return 0 if all(bounds.at_most(abs(r["error"]), args.tolerance) for r in rows) else 1


if __name__ == "__main__":
    entry(cli_main)
