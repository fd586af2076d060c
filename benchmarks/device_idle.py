"""`python -m benchmarks.device_idle TRACE`: where the device sat idle in a profiled step's timeline.

TRACE is a Chrome trace of torch.profiler (`export_chrome_trace`; the `SLUG.trace.json.gz` a profiled
bench stage keeps). Device activity (kernels, copies, memsets) is merged across streams; every stretch
of at least `--min-gap` µs with nothing running on the device is a gap. A gap ends when the host's
launch of the next kernel arrives, so each gap is charged to that launch: the operator that made it and
the innermost `record_function` range the host was in (FSDP's pre-forward of a layer, a micro-batch,
the optimizer's step). Summed by site, the list says which host work the device waited on.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from pathlib import Path
from typing import Any

from engine import errors
from engine.errors import ArgumentParser, UserError

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


def read_trace(path: Path) -> list[dict[str, Any]]:
    try:
        raw = path.read_bytes()
        data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
        return data["traceEvents"] if isinstance(data, dict) else data
    except (OSError, ValueError, KeyError) as err:
        raise UserError(
            f"{path}: not a Chrome trace of torch.profiler: {err}; pass a SLUG.trace.json.gz"
        ) from None


def _innermost(spans: list[dict[str, Any]], starts: list[float], ts: float) -> dict[str, Any] | None:
    """The shortest span (sorted by start) that contains `ts`."""
    best = None
    for span in reversed(spans[: bisect.bisect_right(starts, ts)]):
        if span["ts"] + span.get("dur", 0) >= ts and (best is None or span["dur"] < best["dur"]):
            best = span
    return best


def idle_gaps(events: list[dict[str, Any]], min_gap_us: float = 5.0) -> dict[str, Any]:
    """Busy and idle device time of the trace and the gaps by site: {busy_ms, idle_ms, span_ms, gaps,
    sites: [(site, count, ms)] largest first}. Idle time before the first kernel is the host's start of
    the step and counts as a gap too."""
    device = sorted(
        (e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e), key=lambda e: e["ts"]
    )
    if not device:
        return {"busy_ms": 0.0, "idle_ms": 0.0, "span_ms": 0.0, "gaps": 0, "sites": []}
    launches = {
        e["args"].get("correlation"): e for e in events if e.get("cat") in LAUNCH_CATEGORIES and "args" in e
    }
    ops = {e["args"].get("External id"): e for e in events if e.get("cat") == "cpu_op" and "args" in e}
    ranges = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and "dur" in e), key=lambda e: e["ts"]
    )
    range_starts = [e["ts"] for e in ranges]
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e]
    start = min([e["ts"] for e in host] + [device[0]["ts"]])
    busy_until, busy, sites, gaps = start, 0.0, {}, 0
    for kernel in device:
        end = kernel["ts"] + kernel["dur"]
        gap = kernel["ts"] - busy_until
        if gap >= min_gap_us:
            gaps += 1
            launch = launches.get(kernel.get("args", {}).get("correlation"))
            op = ops.get(launch["args"].get("External id")) if launch else None
            where = _innermost(ranges, range_starts, launch["ts"]) if launch else None
            site = f"{where['name'] if where else '(no range)'} > {op['name'] if op else kernel['name'][:60]}"
            count, ms = sites.get(site, (0, 0.0))
            sites[site] = (count + 1, ms + gap / 1000)
        busy += max(0.0, end - max(kernel["ts"], busy_until))
        busy_until = max(busy_until, end)
    span = busy_until - start
    ranked = sorted(((site, c, round(ms, 3)) for site, (c, ms) in sites.items()), key=lambda s: -s[2])
    return {
        "busy_ms": round(busy / 1000, 3),
        "idle_ms": round((span - busy) / 1000, 3),
        "span_ms": round(span / 1000, 3),
        "gaps": gaps,
        "sites": ranked,
    }


def report(summary: dict[str, Any], limit: int = 25) -> str:
    if not summary["span_ms"]:
        return "no device activity in the trace (a CPU run has none)\n"
    lines = [
        f"device busy {summary['busy_ms']:.1f} ms, idle {summary['idle_ms']:.1f} ms of "
        f"{summary['span_ms']:.1f} ms ({summary['gaps']} gaps); idle by the host range and operator that "
        "ended each gap:"
    ]
    lines += [f"{ms:9.2f} ms {count:5d} x  {site}" for site, count, ms in summary["sites"][:limit]]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m benchmarks.device_idle", description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="a Chrome trace of torch.profiler (.json or .json.gz)")
    parser.add_argument("--min-gap", type=float, default=5.0, help="shortest idle stretch counted, µs")
    parser.add_argument("--limit", type=int, default=25, help="sites listed")
    return parser


def cli_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    print(report(idle_gaps(read_trace(args.trace), args.min_gap), args.limit), end="")
    return 0


if __name__ == "__main__":
    errors.entry(cli_main)
