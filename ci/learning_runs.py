"""The learning figures of docs/reference/gates.md: `tiny_cpu_learn` over 3 rollout seeds and under each
test-only breakage of engine/runtime/mutations.py, with the gates of engine/run/gates.py evaluated on every
run.

Usage: .venv/bin/python ci/learning_runs.py --out results/learning [--assets DIR] [--figure PNG]
Runs what is missing under OUT (a run directory with run.json counts as done), then prints one markdown
row per run (wall, reward of the first and last k steps, their difference, largest rollout/actor gap,
gate outcomes) and the spread over the seeds, and draws the reward and gap curves of all runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from engine import procs
from engine.data import assets as tiny_assets
from engine.run import gates
from engine.run.rundir import RunDir
from engine.runtime import mutations

RECIPE = "tiny_cpu_learn"
SEED_KEY = "verl_overrides.actor_rollout_ref.rollout.seed"
SEEDS = (42, 1, 2)  # 42: verl's default rollout seed, the one CI runs
RUNS: dict[str, tuple[dict[str, str], list[str]]] = {
    **{f"seed-{seed}": ({}, [f"{SEED_KEY}={seed}"]) for seed in SEEDS},
    **{name: ({mutations.ENV: name}, [f"{SEED_KEY}={SEEDS[0]}"]) for name in mutations.KNOWN},
}


def launch(name: str, out: Path, assets: Path) -> None:
    env, sets = RUNS[name]
    command = [sys.executable, "-m", "engine", "run", RECIPE, "--device", "cpu", "--out", str(out)]
    for item in (*tiny_assets.recipe_sets(assets), *sets):
        command += ["--set", item]
    load = os.getloadavg()[0]
    start = time.monotonic()
    owned = procs.dies_with_this_process()  # the run (and its verl) ends with this script
    done = subprocess.run(command, env=dict(os.environ) | env, stdout=subprocess.DEVNULL, preexec_fn=owned)
    code = done.returncode
    print(f"{name}: exit {code}, {time.monotonic() - start:.0f} s, load at start {load:.1f}", file=sys.stderr)


def summary(name: str, out: Path) -> dict:
    rows = RunDir(out).read_metrics()
    record = json.loads(RunDir(out).record.read_text())
    k = gates.LEARNING[RECIPE].window
    rewards = [row["data"][gates.REWARD] for row in rows]
    first, last = statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])
    results = gates.evaluate(rows, "cpu", RECIPE)  # today's thresholds, whatever the run recorded
    failed = {result.name: result.first_failed_step for result in gates.failed(results)}
    return {
        "name": name,
        "rows": rows,
        "steps": len(rows),
        "wall_s": record["wall_s"],
        "first": first,
        "last": last,
        "rise": last - first,
        "reward_sd": statistics.stdev(rewards),
        "gap_max": max(row["data"][gates.PROBS_DIFF_MAX] for row in rows),
        "gap_mean_max": max(row["data"][gates.PROBS_DIFF_MEAN] for row in rows),
        "failed": failed,
    }


def table(stats: list[dict]) -> str:
    k = gates.LEARNING[RECIPE].window
    lines = [
        f"| run | steps | wall s | reward first {k} | last {k} | rise | largest gap (max / mean) | "
        "gates failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in stats:
        failed = ", ".join(f"{n} (step {step})" if step else n for n, step in s["failed"].items()) or "none"
        lines.append(
            f"| {s['name']} | {s['steps']} | {s['wall_s']:.0f} | {s['first']:.4f} | {s['last']:.4f} | "
            f"{s['rise']:+.4f} | {s['gap_max']:.2g} / {s['gap_mean_max']:.2g} | {failed} |"
        )
    seeds = [s for s in stats if s["name"].startswith("seed-")]
    if len(seeds) > 1:
        rises = [s["rise"] for s in seeds]
        lines.append(
            f"\nseeds: rise {min(rises):+.4f} .. {max(rises):+.4f}, mean {statistics.fmean(rises):+.4f}, "
            f"sd {statistics.stdev(rises):.4f}; first-{k} reward sd "
            f"{statistics.stdev([s['first'] for s in seeds]):.4f}"
        )
    return "\n".join(lines)


def figure(stats: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu = gates.AGREEMENT["cpu"]
    fig, (reward_ax, gap_ax) = plt.subplots(1, 2, figsize=(12, 4), constrained_layout=True)
    for s in stats:
        style = "-" if s["name"].startswith("seed-") else "--"
        steps = [row["step"] for row in s["rows"]]
        reward_ax.plot(steps, [row["data"][gates.REWARD] for row in s["rows"]], style, label=s["name"])
        gap_ax.plot(steps, [row["data"][cpu.metric] for row in s["rows"]], style, label=s["name"])
    gap_ax.axhline(cpu.limit, color="red", linestyle=":", label="agreement gate")
    reward_ax.set(xlabel="step", ylabel="mean reward (critic/score/mean)", title=f"{RECIPE}: reward")
    gap_ax.set(xlabel="step", ylabel=cpu.metric, yscale="log", title="rollout/actor gap")
    for ax in (reward_ax, gap_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="one run directory per run under here")
    parser.add_argument("--assets", type=Path, default=Path("results/assets"), help="python -m engine assets")
    parser.add_argument("--figure", type=Path, help="write the curves here (PNG)")
    args = parser.parse_args()
    if not (args.assets / "tiny-qwen35").is_dir():
        fix = "build them with python -m engine assets --out DIR"
        print(f"error: --assets {args.assets} has no tiny-qwen35; {fix}", file=sys.stderr)
        return 2
    for name in RUNS:
        if not RunDir(args.out / name).record.is_file():
            launch(name, (args.out / name).resolve(), args.assets.resolve())
    stats = [summary(name, args.out / name) for name in RUNS]
    print(table(stats))
    if args.figure:
        figure(stats, args.figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
