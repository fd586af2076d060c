"""`python -m benchmarks.overhead`: wall time and peak memory of `engine run` vs the same verl command bare.

Both runs start from empty run directories (a checkpoint left there would resume and train nothing), so
bench validates the recipe and its output directory first and only then clears its own run directories.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from engine import bounds, fsutil, procs
from engine.errors import entry
from engine.run.launcher import (
    _write_scrubbed,
    build_plan,
    console,
    launch_env,
    run_parser,
)
from engine.run.rundir import RunDir, read_metrics


def measure(
    command: list[str], env: dict[str, str], log_path: Path, interval: float = 0.25
) -> dict[str, Any]:
    """Wall time and peak memory of the whole process tree (summed RSS and PSS of all descendants)."""
    import psutil

    t0 = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its tree is measured alone; it dies with this process (engine.procs)
            preexec_fn=procs.dies_with_this_process(),
        )
        root = psutil.Process(proc.pid)
        peak = {"rss": 0, "pss": 0, "procs": 0}
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                try:
                    tree = [root, *root.children(recursive=True)]
                except psutil.Error:
                    break
                rss = pss = 0
                for item in tree:
                    try:
                        info = item.memory_full_info()
                        rss, pss = rss + info.rss, pss + getattr(info, "pss", info.rss)
                    except psutil.Error:
                        continue
                peak["rss"], peak["pss"] = max(peak["rss"], rss), max(peak["pss"], pss)
                peak["procs"] = max(peak["procs"], len(tree))
                stop.wait(interval)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        with procs.session_reaper(proc):  # a Ctrl-C never reaches the bare verl in its own session
            code = proc.wait()
        stop.set()
        thread.join()
    gib = 1024**3
    return {
        "exit_code": code,
        "wall_s": round(time.monotonic() - t0, 2),
        "peak_rss_gib": round(peak["rss"] / gib, 3),
        "peak_pss_gib": round(peak["pss"] / gib, 3),
        "max_processes": peak["procs"],
    }


BENCH_FILES = ("engine", "bare", "engine.log", "bench.json")


def _bench_dir(out: Path) -> str | None:
    """bench clears its own run directories; it writes into no directory holding anything else."""
    foreign = sorted(p.name for p in out.iterdir() if p.name not in BENCH_FILES)
    return f"it holds {', '.join(foreign[:3])}, which bench did not write" if foreign else None


def bench_main(argv: list[str]) -> int:
    parser = run_parser("python -m benchmarks.overhead")
    target = bounds.finite_float
    parser.add_argument("--max-wall", type=target, default=90.0, help="target wall seconds")
    parser.add_argument("--max-gib", type=target, default=5.0, help="target peak memory (PSS, GiB)")
    parser.add_argument("--max-overhead", type=target, default=1.10, help="target engine/bare wall ratio")
    args = parser.parse_args(argv)
    out = args.out or Path("results") / "bench" / Path(args.recipe).stem  # under the working directory
    out = fsutil.check_out_dir(out, reuse=_bench_dir).resolve()
    bare_out = out / "bare"
    p = build_plan(args.recipe, args.device, args.sets, bare_out)
    from engine import preflight

    preflight.require_ok(p, paths=True)
    for previous in (out / "engine", bare_out):  # a checkpoint left there would resume: no training
        shutil.rmtree(previous, ignore_errors=True)
    engine_cmd = [sys.executable, "-m", "engine", "run", args.recipe, "--out", str(out / "engine")]
    engine_cmd += [f"--device={args.device}"] if args.device else []
    engine_cmd += [f"--set={item}" for item in args.sets]
    console.print(f"bench 1/2: {shlex.join(engine_cmd[1:])}")
    ours = measure(engine_cmd, dict(os.environ), out / "engine.log")
    bare_out.mkdir(parents=True, exist_ok=True)
    console.print("bench 2/2: the same verl command launched bare")
    bare = measure(p.command, launch_env(p, bare_out), RunDir(bare_out).log)
    ratio = round(ours["wall_s"] / bare["wall_s"], 3) if bare["wall_s"] else None
    table = Table(title=f"{p.recipe.name} on {p.recipe.cluster.device}")
    for column in ("", "engine run", "bare verl", "target"):
        table.add_column(column)
    table.add_row("exit code", str(ours["exit_code"]), str(bare["exit_code"]), "0")
    table.add_row("wall s", f"{ours['wall_s']:.1f}", f"{bare['wall_s']:.1f}", f"<= {args.max_wall:g}")
    table.add_row(
        "peak PSS GiB", f"{ours['peak_pss_gib']:.2f}", f"{bare['peak_pss_gib']:.2f}", f"<= {args.max_gib:g}"
    )
    table.add_row("peak RSS GiB (summed)", f"{ours['peak_rss_gib']:.2f}", f"{bare['peak_rss_gib']:.2f}", "")
    table.add_row("processes (max)", str(ours["max_processes"]), str(bare["max_processes"]), "")
    table.add_row("overhead (wall ratio)", f"{ratio}", "1", f"<= {args.max_overhead:g}")
    target = p.recipe.trainer.total_training_steps
    trained = {name: len(read_metrics(RunDir(out / name).metrics)) for name in ("engine", "bare")}
    table.add_row("steps trained", str(trained["engine"]), str(trained["bare"]), str(target))
    checks = {
        "exit_codes_zero": ours["exit_code"] == 0 and bare["exit_code"] == 0,
        "trained": all(steps == target for steps in trained.values()),
        "wall": bounds.at_most(ours["wall_s"], args.max_wall),
        "memory": bounds.at_most(ours["peak_pss_gib"], args.max_gib),
        "overhead": bounds.at_most(ratio, args.max_overhead),
    }
    console.print(table)
    record = {
        "recipe": p.recipe.name,
        "steps_trained": trained,
        "engine": ours,
        "bare": bare,
        "overhead_ratio": ratio,
        "targets": checks,
    }
    _write_scrubbed(out / "bench.json", json.dumps(record, indent=2) + "\n")
    for name, ok in checks.items():
        console.print(f"{'met' if ok else 'MISSED'}: {name}", style="green" if ok else "yellow")
    return 0 if checks["exit_codes_zero"] and checks["trained"] else 1


if __name__ == "__main__":
    entry(bench_main)
