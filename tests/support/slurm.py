"""A real single-host Slurm (ci/slurm.sh: slurmctld, slurmd n1 and n2, munge) for tests that submit jobs."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "ci" / "slurm.sh"


@dataclass(frozen=True)
class Slurm:
    """The running test cluster: its run directory (config, logs, pid files) and client environment."""

    dir: Path

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.dir / "slurm.conf")}

    def command(self, *argv: str, timeout: float = 60) -> str:
        """A Slurm client command (squeue, scontrol, ...) against this cluster; its stdout."""
        done = subprocess.run(
            argv, env=os.environ | self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        assert done.returncode == 0, f"{argv}: {done.stderr}"
        return done.stdout

    def jobs(self) -> list[dict[str, str]]:
        """Every job slurmctld holds (MinJobAge keeps finished ones): id, name, comment, state, nodes."""
        keys = ("id", "name", "comment", "state", "nodes")
        out = self.command("squeue", "-h", "-t", "all", "-o", "%i|%j|%k|%T|%N")
        return [dict(zip(keys, line.split("|"), strict=True)) for line in out.splitlines()]

    def steps_on(self, node: str, job: str) -> list[str]:
        """Job steps of `job` that slurmd of `node` launched (its log: Slurm's own record)."""
        log = (self.dir / f"slurmd-{node}.log").read_text(errors="replace")
        return [line for line in log.splitlines() if f"launch task StepId={job}." in line]


def _daemons_missing() -> list[str]:
    return [tool for tool in ("slurmctld", "slurmd", "munged", "sbatch") if shutil.which(tool) is None]


@contextmanager
def slurm_cluster() -> Iterator[Slurm]:
    """Start the cluster (installing Slurm where ci/slurm.sh may: root with apt); stop exactly its
    daemons afterwards, whatever the test did."""
    if _daemons_missing() and not (os.geteuid() == 0 and shutil.which("apt-get")):
        message = f"{', '.join(_daemons_missing())} missing: bash ci/slurm.sh install (root, Debian)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {message}")
        pytest.skip(message)
    # short: munge's socket path must stay under the 108 bytes of a UNIX socket name
    run = Path(tempfile.mkdtemp(prefix="slurm", dir="/tmp"))
    try:
        up = subprocess.run(
            ["bash", str(SCRIPT), "up", str(run)], capture_output=True, text=True, timeout=900
        )
        assert up.returncode == 0, up.stderr[-3000:]
        yield Slurm(run)
    finally:
        pids = [int(p.read_text()) for p in run.glob("*.pid") if p.read_text().strip()]
        down = subprocess.run(["bash", str(SCRIPT), "down", str(run)], capture_output=True, timeout=120)
        shutil.rmtree(run, ignore_errors=True)
        left = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        assert down.returncode == 0 and not left, f"ci/slurm.sh down left {left}: {down.stderr[-2000:]}"
