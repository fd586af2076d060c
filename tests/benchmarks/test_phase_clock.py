"""The phase clock's arithmetic: host and device times per phase and the lag at each phase's end, over
the steps of the timed window only. Device clocks are CUDA events; here an event is a recorded device
time, as `torch.cuda.Event.elapsed_time` reports differences of them."""

from __future__ import annotations

import pytest

from benchmarks import phase_clock
from benchmarks.phase_clock import PhaseClock, phase_lines


class _DeviceTime:
    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, later: _DeviceTime) -> float:
        return later.ms - self.ms


def _clocked(steps: list[list[tuple[str, float, float]]]) -> PhaseClock:
    """A clock holding marks (name, host ms, device ms), as `mark` records them on a GPU."""
    clock = PhaseClock(cuda=True)
    clock.steps = [[(name, host / 1000, _DeviceTime(device)) for name, host, device in s] for s in steps]
    return clock


def test_a_host_bound_forward_ends_with_no_lag_and_the_backward_with_the_hosts_lead() -> None:
    # forward launched in 60 ms, the device done 0.1 ms later: the host paced it; backward launched in
    # 10 ms while the device ran 50 ms of it: the device ends 40 ms behind
    step = [("prepare", 0, 0.0), ("forward", 5, 5.02), ("loss", 65, 65.1), ("backward", 70, 70.1)]
    step += [("optimizer", 80, 120.0), ("finish", 90, 150.0), ("end", 91, 150.2)]
    summary = _clocked([step, [(n, h + 200, d + 200) for n, h, d in step]]).summary()
    assert summary["forward"] == {"host_ms": 60.0, "device_ms": 60.08, "lag_ms": 0.1}
    assert summary["backward"] == {"host_ms": 10.0, "device_ms": 49.9, "lag_ms": 40.0}
    assert summary["finish"]["lag_ms"] == pytest.approx(59.2)
    assert sum(f["device_ms"] for f in summary.values()) == pytest.approx(150.2)
    assert "lag at its end   40.00 ms" in phase_lines(summary)


def test_recurring_phases_add_up_and_only_the_window_counts() -> None:
    clock = PhaseClock(cuda=False)
    clock.begin_step()  # before start: a warm-up step, not kept
    clock.start()
    for _ in range(2):
        clock.begin_step()
        for _ in range(3):  # three micro-batches
            clock.mark("forward")
            clock.mark("loss")
            clock.mark("backward")
        clock.mark("optimizer")
        clock.mark("finish")
        clock.end_step()
    clock.stop()
    clock.begin_step()  # the profiled step after the window: not kept
    assert len(clock.steps) == 2 and [m[0] for m in clock.steps[0]].count("forward") == 3
    summary = clock.summary()
    assert list(summary) == list(phase_clock.PHASES)
    assert all(list(figures) == ["host_ms"] for figures in summary.values())
    assert "device" not in phase_lines(summary)
