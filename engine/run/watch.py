"""Run verl and follow it: its console into the run's log (scrubbed), one progress line per logged step.

verl runs in a session of its own (a Ctrl-C reaches the launcher, which stops the whole tree) that ends
with the launcher (engine.procs): a launcher killed outright takes verl and its Ray processes with it,
so no trainer goes on writing checkpoints that no attempt will publish.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from engine import procs
from engine.run.redact import scrub, secret_values
from engine.run.rundir import read_metrics

console = Console(highlight=False, soft_wrap=True)


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
    """Run verl in the working directory, tee everything to the log, print one line per logged step;
    returns the exit code."""
    metrics.unlink(missing_ok=True)
    with log_path.open("a") as log:  # a restart's console follows the failed launch's
        proc = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=procs.dies_with_this_process(),
            text=True,
            errors="replace",
        )
        # verl and Ray echo parts of the environment (e.g. RAY_ADDRESS with userinfo): scrub each line.
        secrets = secret_values(env)
        tee = threading.Thread(target=_copy_scrubbed, args=(proc.stdout, log, secrets), daemon=True)
        tee.start()
        shown = 0
        try:
            with procs.session_reaper(proc):  # what is left of verl's session goes when this block ends
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


# Failures of verl's start that a new launch does not repeat; retried only while nothing was trained.
STARTUP_FAILURES = {
    # Ray gives its raylet a hard-coded 30 s to register; a saturated host can miss it.
    "The current node timed out during startup": "Ray's node did not come up within its fixed 30 s",
    # verl picks a rendezvous port by binding port 0 and closing it; the workers bind it again seconds
    # later, and another process can take it meanwhile (torch's TCPStore: "address already in use").
    "address already in use": "a port picked for a rendezvous was taken before it was bound (a port race)",
}
START_ATTEMPTS = 3  # Ray's start was seen failing twice in a row on 2 cores at load average 20-28


def startup_failure(log_path: Path, offset: int = 0) -> str | None:
    """Why the launch whose console starts at `offset` of the log failed in a way that is safe to retry."""
    with log_path.open("rb") as log:
        log.seek(offset)
        text = log.read().decode(errors="replace").lower()
    return next((why for sign, why in STARTUP_FAILURES.items() if sign.lower() in text), None)


def execute_with_restarts(
    command: list[str],
    env: dict[str, str],
    log_path: Path,
    metrics: Path,
    total: int | None,
    trained: Callable[[], bool],
) -> tuple[int, list[str]]:
    """`execute`, started again (START_ATTEMPTS in all) when verl failed at startup with one of
    STARTUP_FAILURES before `trained()` saw a step or a checkpoint. Every launch's console stays in the
    log; returns the last exit code and why each restart happened (for the run's record)."""
    restarts: list[str] = []
    while True:
        offset = log_path.stat().st_size if log_path.exists() else 0
        code = execute(command, env, log_path, metrics, total)
        why = None if code == 0 or trained() else startup_failure(log_path, offset)
        if why is None or len(restarts) + 1 == START_ATTEMPTS:
            return code, restarts
        restarts.append(f"exit {code}: {why}")
        note = f"verl failed at startup, before training anything ({why}); starting it again"
        console.print(note)
        with log_path.open("a") as log:
            log.write(f"\n[engine] {note}\n\n")
