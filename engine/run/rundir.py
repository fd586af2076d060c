"""The run directory `engine run` writes, named once.

One attempt stages FILES and publishes them together (run.json last); verl writes its checkpoints into
`checkpoints/` (layout in engine.checkpoint.layout); an attempt that trained no step leaves its files
in `last-attempt/`. Records, the workflow, the smoke report, the benchmarks and the CI scripts read a
run through this module.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import fsutil
from engine.checkpoint import layout

LAUNCH_SCRIPT = "launch.sh"  # the verl command, as `render --format script` prints it
OVERRIDES = "overrides.txt"  # verl's Hydra overrides, one a line
RECIPE = "recipe.yaml"  # the fully resolved recipe
LOG = "train.log"  # verl's console, scrubbed of credentials
METRICS = "metrics.jsonl"  # verl's file logger: one JSON object per step
RECORD = "run.json"  # what the launch saw: command, exit code, steps, gates; written last
GPU_MEMORY = "gpu-memory.csv"  # nvidia-smi's samples of the whole device during a GPU launch
# a failed launch's record as the workflow keeps it: Snakemake removes a failed job's declared output
FAILED_RECORD = "run.failed.json"
EARLIER_METRICS = "metrics.earlier.jsonl"  # the workflow's train rule: steps of earlier attempts
RUN_REPORT = "smoke_report.json"  # `engine smoke-report`: gates, step split, memory of an accelerator run
# what `engine provenance write` adds: the record, the same as an RO-Crate, and the crate's README
PROVENANCE = "provenance.json"
CRATE = "ro-crate-metadata.json"
CRATE_README = "README.md"
CHECKPOINTS = "checkpoints"
CLUSTER_SCRIPT = "ray_cluster.sh"  # the Ray bring-up of a multi-node run (engine.run.cluster)
LAST_ATTEMPT = "last-attempt"
ATTEMPT_PREFIX = ".attempt."  # an attempt's stage, `.attempt.XXXX.partial`, published when it ends
LOCK = ".run.lock"  # held by the launch using the directory (engine.fsutil.exclusive)

# What `engine run` writes into its directory; an attempt stages them and publishes them together.
FILES = (LAUNCH_SCRIPT, OVERRIDES, RECIPE, LOG, METRICS, GPU_MEMORY, RECORD)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Steps logged by verl's file logger (a partial last line is skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [row for row in rows if isinstance(row, dict) and "step" in row]


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory (none need exist)."""

    path: Path

    @property
    def launch_script(self) -> Path:
        return self.path / LAUNCH_SCRIPT

    @property
    def overrides(self) -> Path:
        return self.path / OVERRIDES

    @property
    def recipe(self) -> Path:
        return self.path / RECIPE

    @property
    def log(self) -> Path:
        return self.path / LOG

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def record(self) -> Path:
        return self.path / RECORD

    @property
    def gpu_memory(self) -> Path:
        return self.path / GPU_MEMORY

    @property
    def failed_record(self) -> Path:
        return self.path / FAILED_RECORD

    @property
    def earlier_metrics(self) -> Path:
        return self.path / EARLIER_METRICS

    @property
    def run_report(self) -> Path:
        return self.path / RUN_REPORT

    @property
    def provenance(self) -> Path:
        return self.path / PROVENANCE

    @property
    def crate(self) -> Path:
        return self.path / CRATE

    @property
    def crate_readme(self) -> Path:
        return self.path / CRATE_README

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def last_attempt(self) -> Path:
        return self.path / LAST_ATTEMPT

    def read_metrics(self) -> list[dict[str, Any]]:
        return read_metrics(self.metrics)

    def metrics_problem(self) -> str | None:
        """Why the metrics file holds no step ("is missing", "is empty", ...); None when it holds one."""
        if not self.metrics.is_file():
            return "is missing"
        if self.metrics.stat().st_size == 0:
            return "is empty"
        if not self.read_metrics():
            return "holds no step row"
        return None

    def saved_step(self) -> int:
        """The step of the run's latest finished checkpoint, 0 when there is none."""
        return layout.saved_step(self.checkpoints)

    def holds_run(self) -> bool:
        """Anything a run (or a cluster bring-up) writes is there."""
        return any((self.path / name).exists() for name in (*FILES, CHECKPOINTS, CLUSTER_SCRIPT))

    @property
    def lock_file(self) -> Path:
        return self.path / LOCK

    def attempt_stages(self) -> list[Path]:
        """Stages of attempts that never published: killed outright (SIGKILL, a lost node), or running."""
        return sorted(p for p in self.path.glob(f"{ATTEMPT_PREFIX}*{fsutil.PARTIAL}") if p.is_dir())

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """One launch at a time: two would train from the same checkpoints and save over each other's."""
        self.path.mkdir(parents=True, exist_ok=True)
        fix = "wait for that run to end, or pass another --out"
        return fsutil.exclusive(self.lock_file, f"--out {self.path}", fix)
