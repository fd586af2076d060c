"""What the accelerators did during a launch: device memory sampled by `nvidia-smi`, beside the run.

verl reports the trainer's own peak (`actor/perf/max_memory_*`), which misses vLLM's share of a colocated
GPU; the driver's view of the whole device is what decides whether a plan fits. Sampling needs only the
driver's `nvidia-smi`: where it is missing (CPU, NPU) nothing is written.
"""

from __future__ import annotations

import contextlib
import csv
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

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
