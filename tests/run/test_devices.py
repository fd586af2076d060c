"""GPU memory sampling of a launch (engine.run.devices): the sampler stops with the launch, peaks are read."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from engine.run import devices


def test_sampler_writes_rows_stops_with_the_block_and_peaks_per_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in `nvidia-smi` (the real one needs a GPU) that prints two GPUs' rows in a loop, as
    `--loop-ms` does; the sampler must pass the query, leave no process behind and keep every row."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text(
        '#!/bin/sh\necho "$@" > "$0.args"\necho $$ > "$0.pid"\ni=0\n'
        'while true; do i=$((i+1)); echo "2026/12/03 10:00:00.$i, 0, $((1000*i)), 50"; '
        'echo "2026/12/03 10:00:00.$i, 1, 7, 0"; sleep 0.05; done\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "gpu-memory.csv"
    with devices.sampling(out) as sampling:
        assert sampling
        time.sleep(0.5)
    pid = int((bin_dir / "nvidia-smi.pid").read_text())
    time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    args = (bin_dir / "nvidia-smi.args").read_text()
    assert "--query-gpu=timestamp,index,memory.used,utilization.gpu" in args
    rows = out.read_text().splitlines()
    assert rows[0] == "timestamp,index,memory_used,utilization_gpu" and len(rows) > 4
    peaks = devices.peak_memory_mib(out)
    assert peaks is not None and peaks["1"] == 7.0 and peaks["0"] >= 3000.0


def test_no_driver_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with devices.sampling(tmp_path / "gpu-memory.csv") as sampling:
        assert not sampling
    assert not (tmp_path / "gpu-memory.csv").exists()
    assert devices.peak_memory_mib(tmp_path / "gpu-memory.csv") is None
