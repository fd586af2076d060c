"""Where a profiled step makes the host wait for the device: sync calls (or, on a CPU, the host reads
that would be syncs on a GPU) grouped by the operator and Python frames they come from, at the end of
the profile `profile_step` writes for `benchmarks.gpu_bench run --profile` (it records the stacks this
needs: `with_stack=True`, `experimental_config=_ExperimentalConfig(verbose=True)`). Under the profiler
the host runs several times slower; what the host costs the timed steps is benchmarks.phase_clock's."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from benchmarks.gpu_bench import Shape, run_slug

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
# operators that read tensor data back to the host (.item(), bool(), data-dependent shapes)
HOST_READS = (
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::bincount",
    "aten::masked_select",
    "aten::_unique2",
)


def _inside(event: Any, calls: tuple[str, ...]) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in calls:
            return True
        parent = parent.cpu_parent
    return False


def sync_sites(
    profiler: Any,
    calls: tuple[str, ...] = SYNC_CALLS,
    limit: int = 12,
    frames: int = 6,
    title: str = "host syncs",
    waits: bool = True,
) -> str:
    """Where the host waited for the device: the sync calls of a profiled step grouped by the operator
    and Python frames they came from. After a sync the device idles until the host has launched work
    again, so on a step with many of them the host's launch time adds to the device's. A call made
    inside another listed one counts once (as the outer one). `waits`: the calls are syncs, whose time
    is the host's wait (not so for host reads on a CPU)."""
    sites: dict[tuple[str, tuple[str, ...]], list[float]] = {}
    for event in profiler.events():
        if event.name not in calls or _inside(event, calls):
            continue
        owner = event  # a runtime call carries no Python stack: the operator that made it does
        while owner.cpu_parent is not None and not owner.stack:
            owner = owner.cpu_parent
        stack = tuple(f for f in owner.stack if "torch/profiler" not in f)[:frames]
        site = sites.setdefault((owner.name, stack), [0, 0.0])
        site[0] += 1
        site[1] += event.cpu_time_total / 1000
    ranked = sorted(sites.items(), key=lambda item: (item[1][1], item[1][0]), reverse=True)
    count, waited = sum(c for c, _ in sites.values()), sum(ms for _, ms in sites.values())
    waiting = f", {waited:.1f} ms waiting" if waits else ""
    lines = [f"# {title}: {count} calls{waiting}, by call site"]
    for (name, stack), (calls_made, ms) in ranked[:limit]:
        lines.append(f"{calls_made:6d} x {name}" + (f", {ms:.1f} ms" if waits else ""))
        lines += [f"           {frame}" for frame in stack]
    return "\n".join(lines) + "\n"


def profile_step(
    step: Any, index: int, shape: Shape, args: argparse.Namespace, mode: str, cuda: bool
) -> None:
    """Two more steps under torch.profiler, after the timed ones (their figures stay the profiler's cost
    free). The first records Python stacks: top operators by device and host time, the operator count,
    the host syncs by call site (`SLUG.txt`). The second records no stacks, so the host runs closer to
    its own pace, and keeps the timeline (`SLUG.trace.json.gz`, for chrome://tracing or Perfetto): where
    the device idles between kernels and what the host was launching then."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    started = time.perf_counter()
    verbose = torch._C._profiler._ExperimentalConfig(verbose=True)  # Python frames on the operators
    with profile(activities=activities, with_stack=True, experimental_config=verbose) as profiler:
        step(index, shape)
        if cuda:
            torch.cuda.synchronize()
    wall_ms = 1000 * (time.perf_counter() - started)
    with profile(activities=activities) as timeline:
        step(index + 1, shape)
        if cuda:
            torch.cuda.synchronize()
    if int(os.environ.get("RANK", "0")) != 0:
        return
    slug = run_slug(mode, args.kernels[0], args, shape, args.levers[0])
    args.profile.mkdir(parents=True, exist_ok=True)
    timeline.export_chrome_trace(str(args.profile / f"{slug}.trace.json.gz"))  # torch gzips by the suffix
    averages = profiler.key_averages()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    calls = sum(event.count for event in averages)
    batch, mbs, seq = shape
    text = f"# {mode}/{args.kernels[0]} b{batch} mbs{mbs} s{seq}: {calls} operator calls, "
    text += f"{wall_ms:.0f} ms wall under the profiler\n"
    text += averages.table(sort_by=sort, row_limit=40, max_name_column_width=70)
    if cuda:
        text += "\n" + averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
        text += "\n" + sync_sites(profiler)
    else:  # no device to wait for: where the host reads tensor data, which on a GPU is a sync
        title = "host reads of tensor data (syncs where the data is on a GPU)"
        text += "\n" + sync_sites(profiler, HOST_READS, limit=25, title=title, waits=False)
    (args.profile / f"{slug}.txt").write_text(text)
