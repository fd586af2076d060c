"""Child processes that cannot outlive the process that started them.

A parent killed with SIGKILL (the OOM killer, `kill -9`, a lost login shell) runs no cleanup, so a child
it started in a session of its own, as `engine run` starts verl so that a Ctrl-C reaches the launcher
first, keeps running: verl went on training for half a minute, saved steps and moved the checkpoint
tracker of a run no attempt would publish. Two mechanisms, both kernel-driven, close that:

- `dies_with_this_process()`: Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG)`, armed in the child
  between fork and exec and kept across exec) has the kernel send the child SIGKILL the moment its
  parent dies. Ray arms the same signal in the GCS and raylet verl's driver starts, so they go with it.
- `session_reaper(proc)`: Ray's workers and agents are the raylet's children with process groups of
  their own; orphaned, they linger for up to a minute (measured: 25-60 s) before they notice. They all
  stay in the session of verl's driver, so a small watchdog process holds a pipe from this process and,
  when it closes (this process ended, however), SIGKILLs every process left in that session.

The parent-death signal follows the thread that forked: start such children from a thread that lives as
long as they should (the main thread everywhere here). This module imports only the standard library:
the watchdog runs this file (`python -I engine/procs.py SID`) and starts in a blink.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
REAP_TIMEOUT_S = 30.0  # processes still alive after this long are reported, not waited on


def command_output(cmd: list[str], cwd: Path | None = None) -> str | None:
    """A tool's stdout, stripped; None where it is missing, fails or hangs (records say "unknown")."""
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (AttributeError, OSError):
        return None
    prctl.restype = ctypes.c_int
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return prctl


def dies_with_this_process() -> Callable[[], None] | None:
    """`preexec_fn` for subprocess: the child gets SIGKILL when this process dies (None off Linux).

    Everything the child runs is looked up here, before the fork, so the child only calls into libc.
    """
    prctl, parent = _prctl(), os.getpid()
    if prctl is None:
        return None

    def arm() -> None:
        if prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGKILL)

    return arm


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of session `sid`, this one excluded."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            # /proc/PID/stat: "pid (comm) state ppid pgrp session ...", comm may hold spaces
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(entry.name))
    return found


def reap_session(sid: int, timeout: float = REAP_TIMEOUT_S) -> list[int]:
    """SIGKILL every process of session `sid` until none is left; returns those still alive at timeout.

    The session's leader is gone by then, and the kernel does not reuse a session id while any process
    still belongs to it, so no other process can be hit."""
    deadline = time.monotonic() + timeout
    while (members := session_members(sid)) and time.monotonic() < deadline:
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    return members


@contextlib.contextmanager
def session_reaper(proc: subprocess.Popen) -> Iterator[None]:
    """Once the block ends, or this process dies however it dies, every process left in the session
    that `proc` leads (started with `start_new_session=True`) is killed. Off Linux: nothing is done."""
    if not Path("/proc/self/stat").is_file():
        yield
        return
    watchdog = subprocess.Popen(
        [sys.executable, "-I", __file__, str(proc.pid)],  # -I: the standard library and this file only
        stdin=subprocess.PIPE,
        start_new_session=True,  # a Ctrl-C in the terminal is for the parent to handle, not for it
    )
    try:
        yield
    finally:
        assert watchdog.stdin is not None
        watchdog.stdin.close()
        watchdog.wait()


def _watch(sid: int) -> int:
    """The watchdog: wait for the end of stdin (its parent closed it or died), then reap `sid`."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)  # it ends the session, so it must outlive the parent
    sys.stdin.buffer.read()
    left = reap_session(sid)
    if left:
        print(f"engine.procs: processes {left} of session {sid} survived SIGKILL", file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(_watch(int(sys.argv[1])))
