"""Process wall time of `render` and `preflight` for the largest recipe (target: under 1 s each).

Usage: .venv/bin/python ci/bench_render.py [--runs N]. Prints min / median / max wall and median CPU
(user+sys) per command, each a fresh `python -m engine` process, so interpreter start and imports count.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "render qwen35_35b --device gpu": ["render", "qwen35_35b", "--device", "gpu"],
    "render qwen35_35b --device npu --format script": [
        "render",
        "qwen35_35b",
        "--device",
        "npu",
        "--format",
        "script",
    ],
    "preflight qwen35_35b --device gpu": ["preflight", "qwen35_35b", "--device", "gpu"],
    "preflight qwen35_35b --device npu --set parallel.cp=2": [
        "preflight",
        "qwen35_35b",
        "--device",
        "npu",
        "--set",
        "parallel.cp=2",
    ],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    runs = parser.parse_args().runs
    print(f"{'command':<55} {'min s':>7} {'median s':>9} {'max s':>7} {'cpu s':>6}")
    worst = 0.0
    for label, args in COMMANDS.items():
        times, cpu = [], []
        for _ in range(runs):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "engine", *args], check=True, capture_output=True)
            times.append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        worst = max(worst, statistics.median(times))
        print(
            f"{label:<55} {min(times):>7.3f} {statistics.median(times):>9.3f} {max(times):>7.3f} "
            f"{statistics.median(cpu):>6.3f}"
        )
    print(f"worst median: {worst:.3f} s (target < 1 s)")
    return 0 if worst < 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
