"""`python -m engine run`: launch verl's own `main_ppo` from a compiled recipe and watch it.

verl is only ever a subprocess here (this module imports neither torch nor verl), so a run is exactly
the command `render --format script` prints, plus the run directory's environment and the file
logger's path. Progress comes from verl's `file` logger (one JSON line per step, unbuffered), not from
scraping the console; the console goes to DIR/train.log. A run succeeds only if verl exits 0 *and*
this launch logged training steps up to the recipe's target — verl also exits 0 after resuming a
finished checkpoint without training — and a launch whose checkpoint moved on while it logged no step
fails with that cause: its metrics went elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console

from engine import fsutil, paths, procs
from engine.checkpoint import layout
from engine.errors import ArgumentParser, UserError
from engine.hashing import sha256_file
from engine.recipes.args import add_recipe_args
from engine.recipes.hydra import Override
from engine.recipes.models import TINY_MODELS
from engine.run import devices, gates, rundir, watch
from engine.run.record import EARLIER_ATTEMPT, Gate, Rerun, RunRecord, Verdict, judge
from engine.run.redact import redact_env, scrub
from engine.run.rundir import RunDir, read_metrics
from engine.runtime import mutations

console = watch.console
errors = Console(stderr=True, highlight=False, soft_wrap=True)


def run_parser(prog: str) -> argparse.ArgumentParser:
    """`RECIPE [--device] [--set ...] [--out DIR]`: what `run` (and the overhead benchmark) take."""
    parser = ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_recipe_args(parser)
    parser.add_argument(
        "--out", type=Path, help="run directory (default: results/runs/RECIPE under the working directory)"
    )
    parser.add_argument(
        "--control",
        choices=sorted(gates.CONTROLS),
        help="a negative control: break the loop this way (engine.runtime.mutations); the launch exits 0 "
        "only when the gate that must catch it fails",
    )
    return parser


def _write_scrubbed(path: Path, text: str) -> None:
    """Every file a run writes goes through the credential scrubber (launch.sh may carry env values)."""
    fsutil.atomic_write(path, scrub(text))


def reusable_run_dir(recipe_name: str) -> Callable[[Path], str | None]:
    """`run` resumes in its own run directory of the same recipe, and writes into no other non-empty one."""

    def reuse(out: Path) -> str | None:
        run = RunDir(out)
        if not run.holds_run():  # a first attempt killed outright left only its stage (and the lock)
            stages = run.attempt_stages()
            if not stages and not run.lock_file.exists():
                return "it is not empty and holds no run (no run.json, launch.sh or checkpoints/)"
            names = {_recipe_name(stage / rundir.RECIPE) for stage in stages} - {recipe_name, None}
            if names:
                return f"it holds an unpublished attempt of recipe {sorted(names)[0]!r} ({stages[0].name})"
            return None
        if run.record.exists():
            # resuming needs only the recipe's name: a run.json of an older engine (fewer fields, or none
            # of the schema) still names it, and this launch writes the record anew
            try:
                earlier = fsutil.read_json(run.record, "run record", "").get("recipe")
            except UserError:
                earlier = None
            if not isinstance(earlier, str):
                return "its run.json is unreadable or names no recipe: not a run directory this command made"
            if earlier != recipe_name:
                return f"it holds a run of recipe {earlier!r}, whose checkpoints this run would resume"
        return None

    return reuse


def _recipe_name(path: Path) -> str | None:
    """The `name:` of a staged recipe.yaml (None when the attempt died before writing it)."""
    try:
        data = fsutil.read_yaml(path, "recipe", "")
    except UserError:
        return None
    return data.get("name") if isinstance(data, dict) else None


def build_plan(ref: str, device: str | None, sets: list[str], out: Path, build_assets: bool = True) -> Any:
    """Load the recipe with the run directory applied through the ordinary `--set` paths, then compile;
    `build_assets=False` where nothing runs here (a cluster script for another machine)."""
    from engine.recipes import loader, plan

    for item in sets:
        if item.partition("=")[0].strip() == "trainer.checkpoint_dir":
            raise UserError(f"--set {item}: a run keeps its checkpoints in --out/checkpoints; pass --out")
    first = loader.load(ref, device=device, sets=sets)
    loggers = list(first.trainer.logger)
    if "file" not in loggers:
        loggers.append("file")
    run_sets = [
        *sets,
        f"trainer.checkpoint_dir={RunDir(out).checkpoints}",
        f"trainer.logger=[{','.join(loggers)}]",
    ]
    resolved = loader.load(ref, device=device, sets=run_sets)
    if build_assets:
        _ensure_tiny_assets(resolved)
    return plan.compile_recipe(resolved)


def _ensure_tiny_assets(r: Any) -> None:
    """The tiny recipes point at generated assets: build them (offline, seeded) when they are missing."""
    model_path = Path(r.model.path)
    if r.model.name not in {spec.name for spec in TINY_MODELS} or model_path.exists():
        return
    out = model_path.parent
    console.print(f"[dim]building tiny assets into {out} (python -m engine assets)[/dim]")
    build = [sys.executable, "-m", "engine", "assets", "--out", str(out)]
    done = subprocess.run(build, capture_output=True, preexec_fn=procs.dies_with_this_process())
    if done.returncode != 0 or not model_path.exists():
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise UserError(f"model.path {model_path}: building tiny assets failed ({tail[0]})")


def checked_plan(ref: str, device: str | None, sets: list[str], out: Path) -> Any:
    """The plan of a launch, refused before anything starts (verl here, Ray in `engine cluster`): the
    plan checks plus the paths and the rollout environment (imports and pins: the run tells)."""
    from engine import preflight

    p = build_plan(ref, device, sets, out)
    preflight.require_ok(p, paths=True, rollout_env=True)
    return p


# verl's TaskRunner writes the metrics from a Ray worker. A local Ray inherits the driver's environment;
# workers of a cluster started by `ray start` (N nodes) do not, so the path also goes into the job's
# runtime env, which Ray applies to every worker of the job on every node.
LOGGER_PATH_IN_RAY = "ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH"


def verl_command(p: Any, metrics: Path) -> list[str]:
    """The plan's verl command with the file logger's path for every Ray worker."""
    return [*p.command, Override(LOGGER_PATH_IN_RAY, str(metrics), "+").text]


def launch_env(p: Any, out: Path, metrics: Path | None = None) -> dict[str, str]:
    env = dict(os.environ) | dict(p.env)
    env["VERL_FILE_LOGGER_PATH"] = str(metrics or RunDir(out).metrics)
    env["PYTHONUNBUFFERED"] = "1"
    # verl's processes import the engine (its extension, rewards) from where this one comes
    env["PYTHONPATH"] = os.pathsep.join(x for x in [str(paths.SOURCE_ROOT), env.get("PYTHONPATH", "")] if x)
    return env


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def moved_on(rows: list[dict[str, Any]], saved: int, saved_before: int) -> bool:
    """Whether an attempt moved the run on: it logged a step, or verl saved past the earlier checkpoint
    (its metrics went elsewhere), so the earlier record no longer describes the checkpoints."""
    return bool(rows) or saved > saved_before


def publish_attempt(stage: Path, out: Path, moved: bool) -> Path:
    """Where this attempt's files go: over the run's files once it trained a step (the checkpoints moved
    on, so the earlier record describes nothing any more). An attempt that trained nothing replaces
    nothing: its files fill only the names the run lacks (run.json after Snakemake removed it) and the
    rest go to LAST_ATTEMPT, so the earlier run's files and the record over them stay intact."""
    if moved:
        fsutil.move_into(stage, out, last=(rundir.RECORD,))
        return out
    fsutil.move_into(stage, out, last=(rundir.RECORD,), missing_only=True)
    if not stage.exists():
        return out
    with fsutil.publish_dir(RunDir(out).last_attempt, replace=True) as target:
        fsutil.move_into(stage, target)
    return RunDir(out).last_attempt


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (Slurm's time limit, scancel) stops verl's tree and publishes the attempt like Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _rerun_of(args: argparse.Namespace) -> Rerun | None:
    """`engine rerun`: the record this run repeats, and what of it did not verify."""
    if not args.rerun_of:
        return None
    of = args.rerun_of.resolve()
    digest = sha256_file(of) if of.is_file() else None  # moved meanwhile: the attempt is still recorded
    return Rerun(record=str(of), sha256=digest, changed=args.rerun_changed)


def _report(verdict: Verdict, record: RunRecord, out: Path, where: Path) -> None:
    """The launch's closing lines: the gates, then why it failed or what it did."""
    for check, line in zip(verdict.checks, gates.summary_lines(verdict.checks), strict=True):
        console.print(line, style={"pass": "green", "fail": "red"}.get(check.status, "dim"), markup=False)
    if verdict.gates_over == EARLIER_ATTEMPT:
        console.print(f"the gates judged {EARLIER_ATTEMPT} ({rundir.METRICS} of {out})", style="dim")
    control = verdict.control
    for restart in record.restarts:  # visible at the end too, not only where it happened in the console
        console.print(f"verl was started again after a failed start ({restart})", style="yellow")
    if record.exit_code != 0:
        tail = RunDir(where).log.read_text(errors="replace").splitlines()[-25:]
        console.print("\n".join(tail), markup=False, style="dim")
        console.print(f"verl exited with {record.exit_code}; full log: {RunDir(where).log}", style="red")
    elif verdict.error:
        errors.print(f"error: {verdict.error}", markup=False)
    elif control is not None:
        verdict_line = "caught it, as it must" if control.caught else "did NOT catch it"
        style = "green" if control.caught else "red"
        console.print(f"control {control.fault}: gate {control.must_fail} {verdict_line}", style=style)
    elif verdict.code == gates.EXIT_GATE_FAILED:
        names = ", ".join(check.name for check in gates.failed(verdict.checks))
        console.print(f"trained, but the gate(s) {names} failed; see {RunDir(where).record}", style="red")
    elif verdict.code != 0:
        console.print(
            f"verl exited 0 but this launch logged {record.steps_done} step(s), last step {record.last_step} "
            f"of {record.target_steps}, and the latest checkpoint is step {record.checkpoint_step}: the "
            "remaining steps were not trained (cf. verl #7401)",
            style="red",
        )
    elif not verdict.trained:
        console.print(
            f"already trained: the checkpoint holds step {record.checkpoint_step} of {record.target_steps}; "
            "nothing left to do"
        )
    else:
        console.print(
            f"done: {record.steps_done} step(s) in {record.wall_s:.0f} s; {RunDir(out).record}", style="green"
        )


def run_main(argv: list[str]) -> int:
    parser = run_parser("python -m engine run")
    parser.add_argument("--rerun-of", type=Path, help="set by `engine rerun`: the record this run repeats")
    parser.add_argument(
        "--rerun-changed",
        action="append",
        default=[],
        help="set by `engine rerun --allow-changed`: what of that record no longer verified (repeatable)",
    )
    args = parser.parse_args(argv)
    out = args.out or Path("results") / "runs" / Path(args.recipe).stem  # the working directory's
    out = fsutil.check_out_dir(out, reuse=reusable_run_dir(Path(args.recipe).stem)).resolve()
    p = checked_plan(args.recipe, args.device, args.sets, out)
    with RunDir(out).lock():
        return _attempt(args, p, out)


def _attempt(args: argparse.Namespace, p: Any, out: Path) -> int:
    """One launch of verl into a stage of `out`, judged, recorded and published (the caller holds `out`)."""
    from engine.recipes import loader
    from engine.recipes import plan as plan_mod

    total = p.recipe.trainer.total_training_steps
    r = p.recipe
    broken = {mutations.ENV: args.control} if args.control else {}
    try:  # a breakage set in the environment is recorded too: a broken run never passes for a healthy one
        fault = args.control or mutations.selected()
    except ValueError as err:
        raise UserError(str(err)) from None
    earlier = RunDir(out).read_metrics()  # the steps of the attempt whose files the run holds
    # Nothing of an earlier run is touched until this attempt is over: it writes into a stage.
    stage = fsutil.stage_in(out, prefix=rundir.ATTEMPT_PREFIX)
    staged = RunDir(stage)
    log, metrics = staged.log, staged.metrics
    _write_scrubbed(staged.launch_script, plan_mod.render(p, "script"))
    _write_scrubbed(staged.overrides, plan_mod.render(p, "overrides"))
    _write_scrubbed(staged.recipe, loader.to_yaml(p.recipe))
    console.print(f"[bold]{r.name}[/bold] on {r.cluster.device} x{p.world_size}: log {log} (live)")
    checkpoints = Path(p.value("trainer.default_local_dir"))
    saved_before = layout.saved_step(checkpoints)

    def trained() -> bool:  # whether this attempt moved the run on, so far
        return moved_on(read_metrics(metrics), layout.saved_step(checkpoints), saved_before)

    started, t0 = _now(), time.monotonic()
    try:
        sample = (
            devices.sampling(staged.gpu_memory) if r.cluster.device == "gpu" else contextlib.nullcontext()
        )
        with terminate_as_interrupt(), sample:
            env = launch_env(p, out, metrics) | broken
            command = verl_command(p, metrics)
            code, restarts = watch.execute_with_restarts(command, env, log, metrics, total, trained)
    except BaseException:  # interrupted: publish by the same rule as a finished attempt
        publish_attempt(stage, out, trained())
        raise
    rows = read_metrics(metrics)
    saved = layout.saved_step(checkpoints)
    kind = (r.cluster.device, r.name, p.model.moe)
    problem = None if rows else staged.metrics_problem()  # why no row: judge reads it only then
    verdict = judge(code, rows, earlier, total, (saved_before, saved), problem, kind, fault)
    command = verl_command(p, RunDir(out).metrics)  # as run, with the path the metrics are published at
    record = RunRecord(
        recipe=r.name,
        device=r.cluster.device,
        command=command,
        command_line=shlex.join(command),
        sets=args.sets,
        env=redact_env(dict(p.env) | {"VERL_FILE_LOGGER_PATH": str(RunDir(out).metrics)}),
        fault=fault,
        control=verdict.control,
        start=started,
        end=_now(),
        wall_s=round(time.monotonic() - t0, 2),
        exit_code=code,
        steps_done=len(rows),
        last_step=max([saved, *(int(row["step"]) for row in rows)]),
        checkpoint_step=saved,
        target_steps=total,
        status=verdict.status,
        gates=[Gate(**check.as_dict()) for check in verdict.checks],
        gates_over=verdict.gates_over,
        rerun=_rerun_of(args),
        error=verdict.error,
        hardware=devices.hardware(),
        restarts=restarts,
    )
    _write_scrubbed(staged.record, record.to_json())
    where = publish_attempt(stage, out, moved_on(rows, saved, saved_before))
    if where != out:
        console.print(
            f"this attempt trained no step: the earlier run's files in {out} are kept; its own are in {where}"
        )
    _report(verdict, record, out, where)
    return verdict.code
