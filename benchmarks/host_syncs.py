"""Where a profiled step makes the host wait for the device: sync calls (or, on a CPU, the host reads
that would be syncs on a GPU) grouped by the operator and Python frames they come from. Used by the
profiles of `benchmarks.gpu_bench run --profile`; the profile must record stacks
(`with_stack=True`, `experimental_config=_ExperimentalConfig(verbose=True)`)."""

from __future__ import annotations

from typing import Any

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
