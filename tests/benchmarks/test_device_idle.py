"""Device idle time read from a Chrome trace: kernels merged across streams, each gap charged to the
host range and operator whose launch ended it. The traces here are written in torch.profiler's format
(`export_chrome_trace`: kernels and launches joined by `correlation`, launches and operators by
`External id`); a real CPU trace has no device activity and says so."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmarks import device_idle


def _launched(op: str, ext: int, corr: int, host_ts: float, device_ts: float, dur: float, stream: int = 7):
    """An operator at host time `host_ts`, its launch, and its kernel on the device."""
    return [
        {"ph": "X", "cat": "cpu_op", "name": op, "ts": host_ts, "dur": 4, "args": {"External id": ext}},
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": host_ts + 1,
            "dur": 2,
            "args": {"External id": ext, "correlation": corr},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": f"{op}_kernel",
            "ts": device_ts,
            "dur": dur,
            "tid": stream,
            "args": {"correlation": corr, "External id": ext},
        },
    ]


def _trace() -> list[dict]:
    ranges = [
        {"ph": "X", "cat": "user_annotation", "name": "micro_batch0", "ts": 0, "dur": 2000},
        {"ph": "X", "cat": "user_annotation", "name": "FSDP::pre_forward (layers.1)", "ts": 390, "dur": 30},
        {"ph": "X", "cat": "user_annotation", "name": "Optimizer.step", "ts": 1500, "dur": 400},
    ]
    events = _launched("aten::mm", 1, 11, 100, 110, 50)  # the first kernel: 110 µs of host start first
    events += _launched("aten::mul", 2, 12, 120, 140, 100, stream=8)  # overlaps the first on another stream
    events += _launched("aten::copy_", 3, 13, 400, 420, 100)  # 180 µs after the device went idle at 240
    events += _launched("aten::mm", 4, 14, 600, 600, 200)  # the device was busy until 520: a 80 µs gap
    events += _launched("aten::_foreach_mul_", 5, 15, 1600, 1602, 100)  # optimizer: 802 µs
    events += _launched("aten::add", 6, 16, 1700, 1703, 3)  # 1 µs after the previous: no gap
    return ranges + events


def test_gaps_are_charged_to_the_launch_that_ended_them() -> None:
    summary = device_idle.idle_gaps(_trace())
    # busy: 110-240 (two streams merged), 420-520, 600-800, 1602-1702, 1703-1706
    assert summary["busy_ms"] == pytest.approx((130 + 100 + 200 + 100 + 3) / 1000)
    assert summary["span_ms"] == pytest.approx(1.706)
    assert summary["idle_ms"] == pytest.approx(1.706 - 0.533)
    assert summary["gaps"] == 4  # the 1 µs one is under --min-gap
    assert summary["sites"][0] == ("Optimizer.step > aten::_foreach_mul_", 1, 0.802)  # largest first
    assert dict((site, (count, ms)) for site, count, ms in summary["sites"]) == {
        "Optimizer.step > aten::_foreach_mul_": (1, 0.802),
        "micro_batch0 > aten::mm": (2, 0.11 + 0.08),
        "FSDP::pre_forward (layers.1) > aten::copy_": (1, 0.18),
    }


def test_the_command_reads_a_gzipped_trace_and_refuses_other_files(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "step.trace.json.gz"
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": _trace()}).encode()))
    assert device_idle.cli_main([str(trace)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("device busy 0.5 ms, idle 1.2 ms of 1.7 ms (4 gaps)")
    assert "     0.80 ms     1 x  Optimizer.step > aten::_foreach_mul_" in out
    cpu_only = tmp_path / "cpu.trace.json"
    cpu_only.write_text(json.dumps({"traceEvents": [*_trace()[:3], _trace()[3]]}))
    assert device_idle.cli_main([str(cpu_only)]) == 0
    assert "no device activity" in capsys.readouterr().out
    junk = tmp_path / "notes.txt"
    junk.write_text("not json")
    with pytest.raises(device_idle.UserError, match=r"notes\.txt: not a Chrome trace"):
        device_idle.cli_main([str(junk)])
