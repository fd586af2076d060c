"""Which accelerators a launch ran on, and what they did: device memory sampled by `nvidia-smi`.

verl reports the trainer's own peak (`actor/perf/max_memory_*`), which misses vLLM's share of a colocated
GPU; the driver's view of the whole device is what decides whether a plan fits. Sampling needs only the
driver's `nvidia-smi`: where it is missing (CPU, NPU) nothing is written.
"""

from __future__ import annotations

import contextlib
import csv
import os
import platform
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.procs import command_output

QUERY = "timestamp,index,memory.used,utilization.gpu"
INTERVAL_MS = 500


@contextlib.contextmanager
def sampling(path: Path) -> Iterator[bool]:
    """Append one CSV row per GPU every INTERVAL_MS to `path` while the block runs; yields whether it does.
    The sampler is this process's child and stops with the block, also on an exception."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        yield False
        return
    with path.open("w") as handle:
        handle.write(QUERY.replace(".", "_") + "\n")
        handle.flush()
        cmd = [smi, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", f"--loop-ms={INTERVAL_MS}"]
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.DEVNULL)
        try:
            yield True
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def peak_memory_mib(path: Path) -> dict[str, float] | None:
    """GPU index -> the largest memory.used (MiB) sampled; None when nothing was sampled."""
    if not path.is_file():
        return None
    peaks: dict[str, float] = {}
    with path.open() as handle:
        for row in csv.DictReader(handle, skipinitialspace=True):
            try:
                used = float(row["memory_used"])
            except (KeyError, TypeError, ValueError):
                continue  # a row cut off when the sampler stopped
            peaks[row["index"]] = max(peaks.get(row["index"], 0.0), used)
    return peaks or None


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def hardware() -> dict[str, Any]:
    """This machine (on Slurm, the node the launch runs on): its host name, which tells two runs of one
    allocation from runs of two, and its GPUs (name, memory, driver), NPUs, or CPU. Read by the launch
    itself: a record written later elsewhere (a provenance rule on a login node) would name another."""
    host = {"host": socket.gethostname()}
    query = "--query-gpu=name,memory.total,driver_version"
    gpus = command_output(["nvidia-smi", query, "--format=csv,noheader"])
    if gpus:
        rows = [line.strip() for line in gpus.splitlines() if line.strip()]
        return host | {"accelerator": "gpu", "count": len(rows), "devices": rows}
    npus = command_output(["npu-smi", "info", "-l"])
    if npus:
        return host | {"accelerator": "npu", "count": npus.count("NPU ID"), "npu_smi": npus.splitlines()[:40]}
    model = next(
        (ln.split(":", 1)[1].strip() for ln in _read("/proc/cpuinfo").splitlines() if "model name" in ln),
        None,
    )
    mem = next(
        (ln.split()[1] for ln in _read("/proc/meminfo").splitlines() if ln.startswith("MemTotal")), "0"
    )
    return host | {
        "accelerator": "cpu",
        "count": 0,
        "cpu": model or platform.processor(),
        "cores": os.cpu_count(),
        "memory_gib": round(int(mem) / (1 << 20), 1),
        "machine": platform.machine(),
    }
