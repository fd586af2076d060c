"""`python -m engine run` / `bench`: launch verl's own `main_ppo` from a compiled recipe and watch it.

verl is only ever a subprocess here (this module imports neither torch nor verl), so a run is exactly
the command `render --format script` prints, plus the run directory's environment. Progress comes from
verl's `file` logger (one JSON line per step, unbuffered), not from scraping the console; the console
goes to DIR/train.log. A run succeeds only if verl exits 0 *and* this launch logged training steps up
to the recipe's target — verl also exits 0 after resuming a finished checkpoint without training.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from engine.errors import UserError
from engine.models import TINY_MODELS
from engine.redact import redact_env, scrub, secret_values

ROOT = Path(__file__).resolve().parent.parent
console = Console(highlight=False, soft_wrap=True)
errors = Console(stderr=True, highlight=False, soft_wrap=True)


# ------------------------------------------------------------------------------------------- planning
def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="recipe name or YAML path")
    parser.add_argument("--device", choices=["gpu", "npu", "cpu"], help="device profile (default: recipe's)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, help="run directory (default: results/runs/RECIPE)")
    return parser


def _atomic_write(path: Path, text: str) -> None:
    """Every file a run writes goes through the credential scrubber (launch.sh may carry env values)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(scrub(text))
    os.replace(tmp, path)


def build_plan(ref: str, device: str | None, sets: list[str], out: Path) -> Any:
    """Load the recipe with the run directory applied through the ordinary `--set` paths, then compile."""
    from engine import plan, recipe

    first = recipe.load(ref, device=device, sets=sets)
    loggers = list(first.trainer.logger)
    if "file" not in loggers:
        loggers.append("file")
    run_sets = [
        *sets,
        f"trainer.checkpoint_dir={out / 'checkpoints'}",
        f"trainer.logger=[{','.join(loggers)}]",
    ]
    resolved = recipe.load(ref, device=device, sets=run_sets)
    _ensure_tiny_assets(resolved)
    return plan.compile_recipe(resolved)


def _ensure_tiny_assets(r: Any) -> None:
    """The tiny recipes point at generated assets: build them (offline, seeded) when they are missing."""
    model_path = Path(r.model.path)
    if r.model.name not in {spec.name for spec in TINY_MODELS} or model_path.exists():
        return
    out = model_path.parent
    console.print(f"[dim]building tiny assets into {out} (python -m engine assets)[/dim]")
    done = subprocess.run([sys.executable, "-m", "engine", "assets", "--out", str(out)], capture_output=True)
    if done.returncode != 0 or not model_path.exists():
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise UserError(f"model.path {model_path}: building tiny assets failed ({tail[0]})")


def launch_env(p: Any, out: Path) -> dict[str, str]:
    env = dict(os.environ) | dict(p.env)
    env["VERL_FILE_LOGGER_PATH"] = str(out / "metrics.jsonl")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(x for x in [str(ROOT), env.get("PYTHONPATH", "")] if x)
    return env


# -------------------------------------------------------------------------------------------- running
def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Steps logged by verl's file logger (a partial last line is skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [row for row in rows if isinstance(row, dict) and "step" in row]


def progress_line(row: dict[str, Any], total: int | None) -> str:
    data = row.get("data", {})

    def fmt(key: str, spec: str = ".4g") -> str:
        value = data.get(key)
        return format(value, spec) if isinstance(value, int | float) else "-"

    of = f"/{total}" if total else ""
    return (
        f"step {row['step']}{of}  reward {fmt('critic/score/mean', '.4f')}  pg_loss {fmt('actor/pg_loss')}  "
        f"grad_norm {fmt('actor/grad_norm', '.4f')}  step {fmt('timing_s/step', '.1f')}s"
    )


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def execute(command: list[str], env: dict[str, str], log_path: Path, metrics: Path, total: int | None) -> int:
    """Run verl, tee everything to the log, print one line per logged step; returns the exit code."""
    metrics.unlink(missing_ok=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            command,
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            text=True,
            errors="replace",
        )
        # verl and Ray echo parts of the environment (e.g. RAY_ADDRESS with userinfo): scrub each line.
        secrets = secret_values(env)
        tee = threading.Thread(target=_copy_scrubbed, args=(proc.stdout, log, secrets), daemon=True)
        tee.start()
        shown = 0
        try:
            while True:
                finished = proc.poll() is not None
                rows = read_metrics(metrics)
                for row in rows[shown:]:
                    console.print(progress_line(row, total))
                shown = max(shown, len(rows))
                if finished:
                    break
                time.sleep(0.5)
        except KeyboardInterrupt:
            _kill_tree(proc)
            raise
        finally:
            tee.join(timeout=30)
    return proc.returncode


def _copy_scrubbed(source: Any, log: Any, secrets: list[str]) -> None:
    for line in source:
        log.write(scrub(line, secrets=secrets))
        log.flush()


RAY_START_TIMEOUT = "The current node timed out during startup"


def _ray_start_timed_out(log_path: Path) -> bool:
    """Ray gives its raylet a hard-coded 30 s to register; on a saturated host that can fail before
    anything of the run has started, which is safe to retry."""
    text = log_path.read_text(errors="replace")
    return RAY_START_TIMEOUT in text and "step:" not in text


def outcome(code: int, rows: list[dict[str, Any]], total: int | None, saved: int = 0) -> tuple[int, bool]:
    """(exit code to return, whether this launch trained): verl's 0 counts only with steps up to target.

    A checkpoint already at the target (an earlier attempt finished training but was stopped before it
    could report) also counts: the steps were trained, and the checkpoint is what export reads.
    """
    last = max((int(row["step"]) for row in rows), default=0)
    trained = bool(rows) and (total is None or last >= total)
    done = trained or (total is not None and saved >= total)
    return (code if code != 0 else (0 if done else 1)), trained


def saved_step(checkpoint_dir: Path) -> int:
    """The step of verl's latest finished checkpoint (its tracker file), 0 when there is none."""
    try:
        return int((checkpoint_dir / "latest_checkpointed_iteration.txt").read_text().strip())
    except (OSError, ValueError):
        return 0


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def run_main(argv: list[str]) -> int:
    args = _parser("python -m engine run").parse_args(argv)
    from engine import plan as plan_mod
    from engine import preflight, recipe

    out = (args.out or ROOT / "results" / "runs" / Path(args.recipe).stem).resolve()
    out.mkdir(parents=True, exist_ok=True)
    p = build_plan(args.recipe, args.device, args.sets, out)
    # the plan checks plus the paths (not imports or pins: the run itself will tell about those)
    problems = preflight.check(p, check_env=False) + preflight.check_paths(p) + preflight.check_rollout_env(p)
    if problems:
        for problem in problems:
            errors.print(f"preflight: {problem}", style="red")
        return 2
    _atomic_write(out / "launch.sh", plan_mod.render(p, "script"))
    _atomic_write(out / "overrides.txt", plan_mod.render(p, "overrides"))
    _atomic_write(out / "recipe.yaml", recipe.to_yaml(p.recipe))
    total = p.recipe.trainer.total_training_steps
    r = p.recipe
    console.print(f"[bold]{r.name}[/bold] on {r.cluster.device} x{p.world_size}: log {out / 'train.log'}")
    started, t0 = _now(), time.monotonic()
    for attempt in (1, 2):
        code = execute(p.command, launch_env(p, out), out / "train.log", out / "metrics.jsonl", total)
        if attempt == 2 or code == 0 or not _ray_start_timed_out(out / "train.log"):
            break
        console.print("Ray's node did not come up within its fixed 30 s (machine overloaded?); retrying once")
    rows = read_metrics(out / "metrics.jsonl")
    last = max((int(row["step"]) for row in rows), default=0)
    saved = saved_step(Path(p.value("trainer.default_local_dir")))
    result, trained = outcome(code, rows, total, saved)
    status = "ok" if result == 0 else "failed"
    record = {
        "recipe": r.name,
        "device": r.cluster.device,
        "command": p.command,
        "command_line": shlex.join(p.command),
        "env": redact_env(dict(p.env) | {"VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl")}),
        "start": started,
        "end": _now(),
        "wall_s": round(time.monotonic() - t0, 2),
        "exit_code": code,
        "steps_done": len(rows),
        "last_step": max(last, saved),
        "checkpoint_step": saved,
        "target_steps": total,
        "status": status,
    }
    _atomic_write(out / "run.json", json.dumps(record, indent=2) + "\n")
    if code != 0:
        tail = (out / "train.log").read_text(errors="replace").splitlines()[-25:]
        console.print("\n".join(tail), markup=False, style="dim")
        console.print(f"verl exited with {code}; full log: {out / 'train.log'}", style="red")
    elif result != 0:
        console.print(
            f"verl exited 0 but this launch logged {len(rows)} step(s), last step {last} of {total}, and the "
            f"latest checkpoint is step {saved}: the remaining steps were not trained (cf. verl #7401)",
            style="red",
        )
    elif not trained:
        console.print(f"already trained: the checkpoint holds step {saved} of {total}; nothing left to do")
    else:
        console.print(
            f"done: {len(rows)} step(s) in {record['wall_s']:.0f} s; {out / 'run.json'}", style="green"
        )
    return result


# ---------------------------------------------------------------------------------------- benchmarking
def measure(
    command: list[str], env: dict[str, str], log_path: Path, interval: float = 0.25
) -> dict[str, Any]:
    """Wall time and peak memory of the whole process tree (summed RSS and PSS of all descendants)."""
    import psutil

    t0 = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
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


def bench_main(argv: list[str]) -> int:
    parser = _parser("python -m engine bench")
    parser.add_argument("--max-wall", type=float, default=90.0, help="target wall seconds")
    parser.add_argument("--max-gib", type=float, default=5.0, help="target peak memory (PSS, GiB)")
    parser.add_argument("--max-overhead", type=float, default=1.10, help="target engine/bare wall ratio")
    args = parser.parse_args(argv)
    out = (args.out or ROOT / "results" / "bench" / Path(args.recipe).stem).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for previous in (out / "engine", out / "bare"):  # a checkpoint left there would resume: no training
        shutil.rmtree(previous, ignore_errors=True)
    engine_cmd = [sys.executable, "-m", "engine", "run", args.recipe, "--out", str(out / "engine")]
    engine_cmd += [f"--device={args.device}"] if args.device else []
    engine_cmd += [f"--set={item}" for item in args.sets]
    console.print(f"bench 1/2: {shlex.join(engine_cmd[1:])}")
    ours = measure(engine_cmd, dict(os.environ), out / "engine.log")
    bare_out = out / "bare"
    bare_out.mkdir(parents=True, exist_ok=True)
    p = build_plan(args.recipe, args.device, args.sets, bare_out)
    console.print("bench 2/2: the same verl command launched bare")
    bare = measure(p.command, launch_env(p, bare_out), bare_out / "train.log")
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
    trained = {name: len(read_metrics(out / name / "metrics.jsonl")) for name in ("engine", "bare")}
    table.add_row("steps trained", str(trained["engine"]), str(trained["bare"]), str(target))
    checks = {
        "exit_codes_zero": ours["exit_code"] == 0 and bare["exit_code"] == 0,
        "trained": all(steps == target for steps in trained.values()),
        "wall": ours["wall_s"] <= args.max_wall,
        "memory": ours["peak_pss_gib"] <= args.max_gib,
        "overhead": ratio is not None and ratio <= args.max_overhead,
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
    _atomic_write(out / "bench.json", json.dumps(record, indent=2) + "\n")
    for name, ok in checks.items():
        console.print(f"{'met' if ok else 'MISSED'}: {name}", style="green" if ok else "yellow")
    return 0 if checks["exit_codes_zero"] and checks["trained"] else 1
