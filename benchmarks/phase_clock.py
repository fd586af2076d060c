"""Host and device clocks at the phase boundaries of the timed steps: which phase of a step keeps the
device waiting on the host.

The profile says how much device time a step has; the step's wall time is longer when the device sits
idle while the host is still launching. Where that happens is invisible in a profile's table and
distorted under the profiler (it slows the host several times). This clock costs one CUDA event and one
`perf_counter` per boundary, so the timed steps carry it. At each boundary it reads when the host got
there and when the device got there (the event completes once the work launched before it has run);
their difference, the lag, is how far the host was ahead. A phase that ends with a lag near zero had
the device catch up with the host: the host's launching, not the device's work, paced it.

Boundaries: `prepare` (the step starts: batch built and handed to the trainer), `forward` (the model's
forward begins), `loss` (the model's forward returned: log-probs and the loss follow), `backward` (the
loss returned: backward and the gradient clip follow), `optimizer` (the optimizer's step begins),
`finish` (it returned: zeroing and metrics), and the step's end. A phase is named for the boundary that
opens it; with several micro-batches a name recurs and its phases add up.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

PHASES = ("prepare", "forward", "loss", "backward", "optimizer", "finish")


class PhaseClock:
    """Marks of the steps in the timed window; `attach` hooks the model, loss and optimizer."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.enabled = False
        self.steps: list[list[tuple[str, float, Any]]] = []

    def mark(self, name: str) -> None:
        if not self.enabled:
            return
        event = None
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.steps[-1].append((name, time.perf_counter(), event))

    def begin_step(self) -> None:
        if self.enabled:
            self.steps.append([])
            self.mark("prepare")

    def end_step(self) -> None:
        self.mark("end")

    def start(self) -> None:
        """Only the steps between `start` and `stop` count (warm-up steps compile and allocate)."""
        self.enabled = True
        self.steps = []

    def stop(self) -> None:
        self.enabled = False

    def attach(self, module: Any, optimizer: Any, loss_fn: Callable[..., Any] | None = None) -> Any:
        """Hooks on the model's forward and the optimizer's step; returns `loss_fn` wrapped to mark the
        loss's return (None: the caller marks `backward` itself)."""
        module.register_forward_pre_hook(lambda *_: self.mark("forward"))
        module.register_forward_hook(lambda *_: self.mark("loss"))
        optimizer.register_step_pre_hook(lambda *_: self.mark("optimizer"))
        optimizer.register_step_post_hook(lambda *_: self.mark("finish"))
        if loss_fn is None:
            return None

        def marked_loss(*args: Any, **kwargs: Any) -> Any:
            out = loss_fn(*args, **kwargs)
            self.mark("backward")
            return out

        return marked_loss

    def summary(self) -> dict[str, dict[str, float]]:
        """Per phase, the mean over the timed steps of its host ms, its device ms and the lag (device
        behind host, ms) at its end. Device times need the device synchronized first."""
        if not self.steps:
            return {}
        _, host_origin, device_origin = self.steps[0][0]
        totals: dict[str, dict[str, list[float]]] = {}
        for marks in self.steps:
            step: dict[str, dict[str, float]] = {}
            clocks = [_clock(m, host_origin, device_origin) for m in marks]
            for (name, *_), (host0, device0), (host1, device1) in zip(
                marks, clocks, clocks[1:], strict=False
            ):
                phase = step.setdefault(name, {"host_ms": 0.0, "device_ms": 0.0, "lag_ms": 0.0})
                phase["host_ms"] += host1 - host0
                if device_origin is not None:  # a device clock: every mark has its event
                    phase["device_ms"] += device1 - device0
                    phase["lag_ms"] = device1 - host1
            for name, figures in step.items():
                for key, value in figures.items():
                    totals.setdefault(name, {}).setdefault(key, []).append(value)
        keep = ("host_ms", "device_ms", "lag_ms") if device_origin is not None else ("host_ms",)
        return {
            name: {key: round(statistics.mean(totals[name][key]), 2) for key in keep}
            for name in PHASES  # marks are these and `end`, which opens no phase
            if name in totals
        }


def _clock(mark: tuple[str, float, Any], host_origin: float, device_origin: Any) -> tuple[float, Any]:
    """(host ms, device ms) since the first mark of the timed window."""
    _, host, event = mark
    device = device_origin.elapsed_time(event) if event is not None else None
    return 1000 * (host - host_origin), device


def phase_lines(phases: dict[str, dict[str, float]]) -> str:
    """One line per phase for a log: host, device, and the lag at its end."""
    lines = []
    for name, figures in phases.items():
        line = f"{name:>9}: host {figures['host_ms']:8.2f} ms"
        if "device_ms" in figures:
            line += f", device {figures['device_ms']:8.2f} ms, lag at its end {figures['lag_ms']:7.2f} ms"
        lines.append(line)
    return "\n".join(lines)


def phases_table(named: list[tuple[str, dict[str, dict[str, float]]]]) -> str:
    """A markdown table of rows' phases, one row each: host ms, and with a device clock device ms and
    the lag at the phase's end; empty when no row was clocked."""
    named = [(name, phases) for name, phases in named if phases]
    if not named:
        return ""
    columns = [p for p in PHASES if any(p in phases for _, phases in named)]
    head = "| run | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns) + "\n"
    body = []
    for name, phases in named:
        cells = []
        for phase in columns:
            figures = phases.get(phase)
            if figures is None:
                cells.append("-")
            elif "device_ms" in figures:
                host, device, lag = figures["host_ms"], figures["device_ms"], figures["lag_ms"]
                cells.append(f"{host:.1f} / {device:.1f} ({lag:.1f})")
            else:
                cells.append(f"{figures['host_ms']:.1f}")
        body.append(f"| {name} | " + " | ".join(cells) + " |")
    legend = "\nPhases of the timed steps, ms a step: host / device (the device's lag at the phase's end)\n\n"
    return legend + head + "\n".join(body) + "\n"
