"""Reward, loss and rollout/actor gap curves of one training run from verl's metrics JSONL (for
`snakemake --report`). The gap panel is the agreement gate of engine/run/gates.py drawn per step, with its
threshold for the run's device. A resumed run may log a step twice; the latest line wins.
"""

import sys
from pathlib import Path

from engine.records.provenance import read_metrics
from engine.run import gates

REWARD_KEYS = ("critic/score/mean", "critic/rewards/mean")
LOSS_KEYS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy")
GAP_KEYS = (gates.PROBS_DIFF_MAX, "training/rollout_probs_diff_mean")


def plot(
    metrics: dict[int, dict[str, float]], out: Path, title: str, gap_limit: float | None = None
) -> list[str]:
    """Write the figure; returns the metric names drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 3.6), constrained_layout=True)
    drawn = []
    panels = ((axes[0], REWARD_KEYS, "reward"), (axes[1], LOSS_KEYS, "loss"), (axes[2], GAP_KEYS, "gap"))
    for ax, keys, label in panels:
        for key in keys:
            points = [(step, values[key]) for step, values in metrics.items() if key in values]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", label=key)
                drawn.append(key)
        ax.set_xlabel("step")
        ax.set_ylabel(label if label != "gap" else "rollout/actor |p| gap")
        ax.grid(alpha=0.3)
        if label == "gap" and ax.lines:
            ax.set_yscale("log")
            if gap_limit is not None:
                ax.axhline(gap_limit, color="red", linestyle="--", label=f"gate {gap_limit:g}")
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, f"no {label} metrics logged", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return drawn


def main(paths: list[str], out: str, title: str, device: str | None = None) -> int:
    """Merge the files in order (a later file's step wins), then plot."""
    metrics: dict[int, dict[str, float]] = {}
    for path in map(Path, paths):
        metrics.update((row["step"], row["data"]) for row in read_metrics(path))
    if not metrics:
        print(f"error: no step records in {', '.join(paths)}; did train log metrics?", file=sys.stderr)
        return 1
    metrics = dict(sorted(metrics.items()))
    limit = gates.AGREEMENT.get(device or "")
    drawn = plot(metrics, Path(out), title, limit.limit if limit else None)
    print(f"{out}: {len(metrics)} steps, {', '.join(drawn) or 'no known metrics'}")
    return 0


if __name__ == "__main__":  # run by Snakemake's `script:`, which defines `snakemake`
    sm = globals()["snakemake"]
    with open(sm.log[0], "w") as log:
        sys.stdout = sys.stderr = log
        title = f"{sm.wildcards.recipe}: reward, loss, rollout/actor gap"
        code = main(list(sm.params.metrics), sm.output[0], title, sm.params.device)
    sys.exit(code)
