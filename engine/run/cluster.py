"""Multi-node Ray bring-up inside one Slurm allocation, then the training driver on the head node.

verl's driver joins an existing Ray cluster when `RAY_ADDRESS` is set. Inside the job this module
generates a bash script that: resolves the allocation's hosts with `scontrol`; starts the Ray head on
the first host and one worker per other host with `srun` (one step per node, each owning the node's
devices and `--cpus-per-node` CPUs, declared to Ray explicitly because Ray's own count is wrong under
Slurm's CPU binding); exports the plan's environment before every `ray start`, so Ray workers on every
node inherit it (FSDPTurbo, HCCL ports, the verl extension); waits until all nodes have joined; runs
`python -m engine run` as the driver; and stops every Ray step when the driver ends, whatever the
outcome. Ports derive from the Slurm job id unless given, so jobs sharing a host do not collide.

Every Ray process of the job, the head, the workers, `engine cluster wait` and verl's driver, uses one
authentication mode: the caller's `RAY_AUTH_MODE`, else token authentication with a token made for
this job and passed in the environment only (`RAY_AUTH_TOKEN`, which Ray prefers to a token file).
Left to itself, Ray 2.60 enables tokens on `ray start --head` when `~/.ray/auth_token` exists (any
earlier `ray.init()` writes it) but not on `ray start --address` or in a client, so the workers were
refused (`InvalidAuthToken`). The recipe's paths and plan are checked before any Ray process starts.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine import fsutil
from engine.errors import TIMED_OUT, ArgumentParser, UserError, WaitTimeout
from engine.recipes.args import add_recipe_args
from engine.run import rundir, watch

BASE_PORT = 6379
# Ray's defaults, raised: on a loaded host the dashboard agent can take longer than the 30 s the raylet
# gives it to register, and the raylet then exits, taking the head down ("Timed out waiting for file
# .../metrics_agent_port_*", seen at load 16 on 2 cores). A caller's own value wins.
RAY_START_ENV = {"RAY_agent_register_timeout_ms": "300000"}
# `ray start` gives its raylet a fixed 30 s to register with the GCS; on a loaded host that runs out
# ("The current node timed out during startup", seen at load 20-30 on 2 cores) and it exits 1, having
# stopped what it started (--block). Each node's step starts it again, twice at most; a signal (the
# cleanup, scancel) reaches it and ends the step instead.
RESTARTS = watch.START_ATTEMPTS - 1  # as many starts as a single-node launch gives Ray
RESTART_WRAPPER = (
    'stop() { kill "$pid" 2>/dev/null; wait "$pid"; exit 143; }; trap stop TERM INT; '
    f"for attempt in $(seq {RESTARTS + 1}); do "
    '"$@" & pid=$!; wait "$pid"; rc=$?; '
    f'if [ "$rc" != 1 ] || [ "$attempt" -gt {RESTARTS} ]; then exit "$rc"; fi; '
    'echo "ray start exited 1 (Ray gives a node 30 s to come up): starting it again" >&2; sleep 5; '
    "done"
)
# Environment every Ray process needs besides the plan's own: how Python finds the engine, where the
# venv lives, and the launcher's view of the repository.
PASSTHROUGH = (
    "PATH",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN_PATH",
)


@dataclass(frozen=True)
class BringUp:
    """Everything the generated script depends on (kept explicit so tests can check the text)."""

    nodes: int
    device: str
    devices_per_node: int
    cpus_per_node: int
    driver: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port: int | None = None
    python: str = sys.executable
    join_timeout_s: int = 300

    def __post_init__(self) -> None:
        if self.nodes < 2:
            raise UserError(
                f"cluster.nodes={self.nodes}: a Ray bring-up needs 2 or more nodes; 1 uses local Ray"
            )
        if self.device not in ("gpu", "npu", "cpu"):
            raise UserError(f"--device {self.device}: multi-node runs need gpu, npu or cpu")
        if self.cpus_per_node < 1 or self.devices_per_node < 1:
            raise UserError("--cpus-per-node and devices per node must be positive")


def ray_resources(device: str, devices: int) -> list[str]:
    """`ray start` flags declaring the node's accelerators (Ray's GPU resource, or NPU as a custom one).
    CPU ranks are logical GPU slots, as the plan declares them to a local Ray (verl counts only those)."""
    if device in ("gpu", "cpu"):
        return [f"--num-gpus={devices}"]
    return [f'--resources={{"NPU": {devices}}}']


def render(b: BringUp) -> str:
    """The bring-up script (bash, `set -euo pipefail`); it must run inside the Slurm allocation."""
    ray = 'bash -c "$restart" ray-node ' + shlex.join([b.python, "-m", "ray.scripts.scripts"])
    port = str(b.port) if b.port else f"$(( {BASE_PORT} + SLURM_JOB_ID % 1000 ))"
    exports = [f"export {k}={shlex.quote(v)}" for k, v in sorted(b.env.items())]
    defaults = [f'export {k}="${{{k}:-{v}}}"' for k, v in sorted(RAY_START_ENV.items())]
    token = shlex.join([b.python, "-c", "import secrets; print(secrets.token_hex(32))"])
    resources = " ".join(shlex.quote(x) for x in ray_resources(b.device, b.devices_per_node))
    common = f"--num-cpus={b.cpus_per_node} {resources} --disable-usage-stats --block"
    step = f"srun --nodes=1 --ntasks=1 --cpus-per-task={b.cpus_per_node} --overlap --export=ALL"
    lines = [
        "#!/usr/bin/env bash",
        f"# Ray cluster of {b.nodes} {b.device} nodes x {b.devices_per_node}; "
        "generated by `python -m engine cluster`",
        "set -euo pipefail",
        ': "${SLURM_JOB_ID:?run this inside a Slurm allocation (sbatch/salloc) of ' + f'{b.nodes} nodes}}"',
        # the Snakemake jobstep drops SLURM_* except the job id: ask Slurm for the node list
        'mapfile -t hosts < <(scontrol show hostnames "$(squeue -h -j "$SLURM_JOB_ID" -o %N)")',
        f'if [ "${{#hosts[@]}}" -lt {b.nodes} ]; then',
        f'  echo "error: allocation has ${{#hosts[@]}} node(s), the run needs {b.nodes}" >&2; exit 2',
        "fi",
        "head=${hosts[0]}",
        "head_ip=$(srun --nodes=1 --ntasks=1 --overlap -w \"$head\" hostname -I | awk '{print $1}')",
        f"port={port}",
        'export RAY_ADDRESS="$head_ip:$port"',
        *exports,
        *defaults,
        "# one auth mode for head, workers and clients; a token of this job's own, in the environment only",
        'export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"',
        'if [ "$RAY_AUTH_MODE" = token ] && [ -z "${RAY_AUTH_TOKEN:-}" ] \\',
        '  && [ -z "${RAY_AUTH_TOKEN_PATH:-}" ]; then',
        f"  RAY_AUTH_TOKEN=$({token}); export RAY_AUTH_TOKEN",
        "fi",
        f"restart={shlex.quote(RESTART_WRAPPER)}  # each node's ray start, again after Ray's 30 s ran out",
        "pids=()",
        'cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait || true; }',
        "trap cleanup EXIT",
        f"deadline=$(( SECONDS + {b.join_timeout_s} ))",
        "wait_nodes() {  # until $1 Ray nodes are alive, or the deadline passes",
        f'  until timeout 60 {shlex.join([b.python, "-m", "engine", "cluster", "wait", "--nodes"])} "$1"; do',
        '    for p in "${pids[@]}"; do',
        '      kill -0 "$p" 2>/dev/null || { echo "error: a Ray node exited during start-up" >&2; exit 3; }',
        "    done",
        '    if [ "$SECONDS" -ge "$deadline" ]; then',
        f'      echo "error: $1 Ray node(s) not up within {b.join_timeout_s} s ($RAY_ADDRESS)" >&2; exit 3',
        "    fi",
        "    sleep 5",
        "  done",
        "}",
        f'{step} -w "$head" {ray} start --head --node-ip-address="$head_ip" --port="$port" '
        f"--include-dashboard=false {common} &",
        "pids+=($!)",
        "wait_nodes 1  # workers join a head that is up, or they give up",
        f'for host in "${{hosts[@]:1:{b.nodes - 1}}}"; do',
        f'  {step} -w "$host" {ray} start --address="$RAY_ADDRESS" {common} &',
        "  pids+=($!)",
        "done",
        f"wait_nodes {b.nodes}",
        shlex.join(b.driver),
    ]
    return "\n".join(lines) + "\n"


def _reachable(address: str, timeout: float) -> bool:
    """A TCP connect to the head's GCS port: an unreachable address must fail fast, not inside ray.init."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return True  # `auto` and other forms Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=max(timeout, 0.1)).close()
    except OSError:
        return False
    return True


def alive_nodes(address: str, timeout: float) -> int | None:
    """Nodes alive in the cluster at `address`: 0 when the head does not answer, None when Ray hangs."""
    if not _reachable(address, min(timeout, 5.0)):
        return 0
    found: list[int] = []

    def count() -> None:
        import logging

        import ray

        try:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
        except Exception:  # head not up yet: the caller retries
            found.append(0)
            return
        try:
            found.append(sum(1 for node in ray.nodes() if node.get("Alive")))
        finally:
            ray.shutdown()

    worker = threading.Thread(target=count, daemon=True)
    worker.start()
    worker.join(timeout)
    return found[0] if found else None


def wait_for(nodes: int, timeout: float, address: str | None) -> int:
    """Poll until `nodes` Ray nodes are alive; WaitTimeout with the count seen when the time is up."""
    if not address:
        raise UserError("RAY_ADDRESS is not set: export RAY_ADDRESS=HEAD_IP:PORT of the running Ray head")
    if nodes < 1 or timeout <= 0:
        raise UserError("--nodes and --timeout must be positive")
    deadline = time.monotonic() + timeout
    while True:
        alive = alive_nodes(address, max(deadline - time.monotonic(), 0.1))
        if alive is None:  # ray.init is stuck in its own retries; the thread cannot be cancelled
            print(f"error: Ray at {address} did not answer within {timeout:g} s", file=sys.stderr)
            sys.stderr.flush()
            os._exit(TIMED_OUT)
        if alive >= nodes:
            return alive
        if time.monotonic() >= deadline:
            raise WaitTimeout(
                f"{alive} of {nodes} Ray node(s) alive at RAY_ADDRESS={address} after {timeout:g} s; check "
                "that the head and workers started (their logs) or raise --timeout"
            )
        time.sleep(min(2.0, max(deadline - time.monotonic(), 0)))


def plan_bring_up(args: argparse.Namespace, check_paths: bool = False) -> BringUp:
    """Compile the recipe (as `engine run` will) for its device count and pinned environment; with
    `check_paths` (launch) refuse it as `engine run` would, before a single Ray process starts."""
    from engine import preflight
    from engine.run import launcher

    if args.port is not None and not 0 < args.port < 65536:
        raise UserError(f"--port {args.port}: give a TCP port (1-65535), or leave it out")
    for item in args.sets:
        key, _, value = item.partition("=")
        if key.strip() == "cluster.nodes" and value.strip() != str(args.nodes):
            raise UserError(f"--set {item} contradicts --nodes {args.nodes}: give the node count once")
    sets = [*args.sets, f"cluster.nodes={args.nodes}"]
    # the plan `engine run` compiles on the head node; a launch also checks the model and data paths and
    # the rollout environment here, minutes before verl would find out (a script is for another machine)
    compiled = launcher.build_plan(args.recipe, args.device, sets, args.out, build_assets=check_paths)
    preflight.require_ok(compiled, paths=check_paths, rollout_env=check_paths)
    env = {k: os.environ[k] for k in PASSTHROUGH if k in os.environ} | dict(compiled.env)
    driver = [args.python, "-m", "engine", "run", args.recipe, "--device", compiled.recipe.cluster.device]
    for item in sets:
        driver += ["--set", item]
    driver += ["--out", str(args.out)]
    return BringUp(
        nodes=args.nodes,
        device=compiled.recipe.cluster.device,
        devices_per_node=compiled.recipe.cluster.devices_per_node,
        cpus_per_node=args.cpus_per_node,
        driver=driver,
        env=env,
        port=args.port,
        python=args.python,
    )


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m engine cluster", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    for name, text in (("script", "print the bring-up script"), ("launch", "write it to OUT and run it")):
        cmd = sub.add_parser(name, help=text)
        add_recipe_args(cmd, device_required=True)
        cmd.add_argument("--nodes", type=int, required=True)
        cmd.add_argument("--cpus-per-node", type=int, required=True)
        cmd.add_argument("--port", type=int, help="Ray head port (default: 6379 + job id %% 1000)")
        cmd.add_argument("--out", type=Path, required=True, help="run directory of `engine run`")
        cmd.add_argument("--python", default=sys.executable, help="interpreter on the nodes")
    wait = sub.add_parser("wait", help="exit 0 once N nodes are alive at RAY_ADDRESS (exit 4 on timeout)")
    wait.add_argument("--nodes", type=int, required=True)
    wait.add_argument("--timeout", type=float, default=30.0, help="seconds to wait (default 30)")
    return parser


def cli_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.action == "wait":
        alive = wait_for(args.nodes, args.timeout, os.environ.get("RAY_ADDRESS"))
        print(f"cluster: {alive} Ray node(s) alive")
        return 0
    if args.action == "launch":  # before compiling: the run directory must be usable
        from engine.run.launcher import reusable_run_dir

        args.out = fsutil.check_out_dir(args.out, reuse=reusable_run_dir(Path(args.recipe).stem))
    script = render(plan_bring_up(args, check_paths=args.action == "launch"))
    if args.action == "script":
        print(script, end="")
        return 0
    path = fsutil.atomic_write(args.out / rundir.CLUSTER_SCRIPT, script)
    os.execvp("bash", ["bash", str(path)])
    return 1  # not reached
