"""engine/procs.py: a parent killed with SIGKILL leaves no child of its own behind.

A child in a session of its own (as `engine run` starts verl), and a grandchild there with a process
group of its own that ignores every polite signal (as Ray's workers are), both outlive a parent that dies
without cleanup unless the kernel's parent-death signal and the session watchdog stop them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import procs
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux parent-death signal")

# The parent: starts a session leader that starts a stubborn grandchild in a process group of its own,
# prints both pids, then waits to be killed.
PARENT = """
import contextlib, json, subprocess, sys, time
from engine import procs
grandchild = (
    "import os, signal, sys, time\\n"
    "os.setpgid(0, 0)\\n"
    "for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT): signal.signal(s, signal.SIG_IGN)\\n"
    "print(os.getpid(), flush=True)\\n"
    "time.sleep(600)\\n"
)
leader = (
    "import subprocess, sys, time\\n"
    f"g = subprocess.Popen([sys.executable, '-c', {grandchild!r}], stdout=subprocess.PIPE, text=True)\\n"
    "print(g.stdout.readline().strip(), flush=True)\\n"
    "time.sleep(600)\\n"
)
mode = sys.argv[1]
child = subprocess.Popen(
    [sys.executable, "-c", leader], stdout=subprocess.PIPE, text=True, start_new_session=True,
    preexec_fn=procs.dies_with_this_process() if mode in ("owned", "signal") else None,
)
grand = int(child.stdout.readline())
with procs.session_reaper(child) if mode == "owned" else contextlib.nullcontext():
    print(json.dumps([child.pid, grand]), flush=True)
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie is dead, waiting for its new parent to reap it


def _kill_parent_and_watch(mode: str, seconds: float = 10.0) -> list[str]:
    """SIGKILL the parent; returns which of its child and grandchild are alive after `seconds`."""
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True, env=env
    )
    pids = json.loads(parent.stdout.readline())  # type: ignore[union-attr]
    assert all(_alive(pid) for pid in pids)
    assert os.getsid(pids[1]) == pids[0] and os.getpgid(pids[1]) == pids[1]  # Ray's worker layout
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + seconds
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return [name for name, pid in zip(("child", "grandchild"), pids, strict=True) if pid in left]


def test_children_outlive_a_parent_killed_without_cleanup() -> None:
    """What the launcher did before: verl and Ray went on after `kill -9` of `engine run`."""
    assert _kill_parent_and_watch("plain", seconds=2.0) == ["child", "grandchild"]


def test_the_parent_death_signal_alone_stops_the_child_but_not_its_session() -> None:
    assert _kill_parent_and_watch("signal", seconds=2.0) == ["grandchild"]


def test_an_owned_session_dies_with_its_parent() -> None:
    assert _kill_parent_and_watch("owned") == []


def test_reap_session_spares_other_sessions() -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert procs.session_members(other.pid) == [other.pid]
        assert procs.session_members(os.getsid(0)) and other.pid not in procs.session_members(os.getsid(0))
        assert procs.reap_session(other.pid, timeout=10) == []
        assert other.wait(timeout=10) == -signal.SIGKILL
    finally:
        other.kill()
        other.wait()
