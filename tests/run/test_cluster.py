"""Multi-node Ray bring-up: the generated commands, and a real 2-node Ray cluster under stand-in Slurm."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from engine.errors import UserError
from engine.run import cluster
from tests.conftest import ROOT


def _script(recipe: str, device: str, nodes: int = 2, port: str | None = None) -> str:
    argv = ["script", recipe, "--device", device, "--nodes", str(nodes), "--cpus-per-node", "24"]
    argv += ["--out", "/runs/x", "--set", "trainer.total_epochs=1"] + (["--port", port] if port else [])
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "cluster", *argv], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize(
    ("device", "resource"), [("gpu", "--num-gpus=8"), ("npu", "'--resources={\"NPU\": 16}'")]
)
def test_script_starts_head_and_workers_with_env(device: str, resource: str) -> None:
    text = _script("qwen35_35b", device, nodes=5)  # 3 nodes: preflight refuses the batch split
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # valid bash
    lines = text.splitlines()
    starts = [line for line in lines if "ray.scripts.scripts start" in line]
    assert len(starts) == 2  # the head line, and the worker line inside the per-host loop
    head, worker = starts
    assert head.startswith("srun --nodes=1 --ntasks=1 --cpus-per-task=24") and '-w "$head"' in head
    assert "--head" in head and '--port="$port"' in head and "--num-cpus=24" in head and resource in head
    assert '--address="$RAY_ADDRESS"' in worker and resource in worker
    assert 'for host in "${hosts[@]:1:4}"; do' in lines  # the other 4 of 5 nodes
    assert "port=$(( 6379 + SLURM_JOB_ID % 1000 ))" in lines
    assert 'export RAY_ADDRESS="$head_ip:$port"' in lines
    # the plan's environment is exported before any `ray start`, so Ray workers inherit it
    first_start = lines.index(head)
    exports = {line.split("=", 1)[0][7:] for line in lines[:first_start] if line.startswith("export ")}
    assert "VERL_USE_EXTERNAL_MODULES" in exports
    assert ("HCCL_CONNECT_TIMEOUT" in exports) == (device == "npu")
    driver = lines[-1]
    assert driver.split()[1:4] == ["-m", "engine", "run"] and f"--device {device}" in driver
    assert "--set cluster.nodes=5" in driver and "--set trainer.total_epochs=1" in driver
    assert lines.index("trap cleanup EXIT") < first_start
    # one auth mode for head, workers and clients, set before the first `ray start`
    auth = lines.index('export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"')
    assert auth < first_start and any("export RAY_AUTH_TOKEN" in line for line in lines[auth:first_start])
    timeout = 'export RAY_agent_register_timeout_ms="${RAY_agent_register_timeout_ms:-300000}"'
    assert timeout in lines[:first_start]


def test_multi_node_plan_leaves_ray_init_sizes_to_ray_start() -> None:
    """verl joins the cluster through RAY_ADDRESS, where Ray refuses ray_init's num_cpus/num_gpus; CPU
    ranks are logical GPU slots of `ray start` instead."""
    text = _script("tiny_cpu", "cpu")
    assert "ray_init" not in text
    starts = [line for line in text.splitlines() if "ray.scripts.scripts start" in line]
    assert all("--num-cpus=24 --num-gpus=1" in line for line in starts) and len(starts) == 2


def test_ray_start_that_timed_out_is_started_again_and_a_signal_ends_it(tmp_path: Path) -> None:
    """The wrapper of each node's `ray start`: exit 1 (Ray's fixed 30 s for a node to come up ran out
    on a loaded host) starts it again, twice at most; another code is final; SIGTERM stops the child."""
    tries = tmp_path / "tries"
    flaky = f'n=$(cat {tries} 2>/dev/null || echo 0); echo $((n + 1)) > {tries}; [ "$n" -ge 2 ]'
    wrapper = ["bash", "-c", cluster.RESTART_WRAPPER, "ray-node", "bash", "-c"]
    done = subprocess.run([*wrapper, flaky], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and tries.read_text() == "3\n", done.stderr
    assert done.stderr.count("starting it again") == 2
    tries.unlink()
    assert subprocess.run([*wrapper, flaky.replace("-ge 2 ]", "-ge 5 ]")], timeout=60).returncode == 1
    assert tries.read_text() == "3\n"  # three starts in all
    assert subprocess.run([*wrapper, "exit 2"], timeout=60).returncode == 2  # not retried
    child = tmp_path / "child.pid"
    node = subprocess.Popen([*wrapper, f"echo $$ > {child}; exec sleep 60"])
    deadline = time.monotonic() + 30
    while not child.exists() or not child.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    node.terminate()
    assert node.wait(timeout=30) == 143
    assert not Path(f"/proc/{child.read_text().strip()}").exists()


def test_launch_checks_paths_before_any_ray_process(tmp_path: Path) -> None:
    """A missing data file stops `cluster launch` where it runs (exit 2, one line), before the bring-up
    script is written or Slurm is asked for anything."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3_5"}')
    out, missing = tmp_path / "run", tmp_path / "nowhere.parquet"
    argv = ["launch", "tiny_cpu", "--device", "cpu", "--nodes", "2", "--cpus-per-node", "2"]
    argv += ["--out", str(out), "--set", f"model.path={model}", "--set", f"data.train_files={missing}"]
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "cluster", *argv], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: preflight:") and f"{missing}: file not found" in proc.stderr
    assert not (out / "ray_cluster.sh").exists()


def test_fixed_port_and_bad_input() -> None:
    assert "port=7100" in _script("qwen35_27b", "gpu", port="7100").splitlines()
    with pytest.raises(UserError, match="needs 2 or more nodes"):
        cluster.BringUp(nodes=1, device="gpu", devices_per_node=8, cpus_per_node=8, driver=["true"])
    with pytest.raises(UserError, match="need gpu, npu or cpu"):
        cluster.BringUp(nodes=2, device="tpu", devices_per_node=1, cpus_per_node=8, driver=["true"])
    argv = ["script", "nope", "--device", "gpu", "--nodes", "2", "--cpus-per-node", "8", "--out", "x"]
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "cluster", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "unknown recipe 'nope'" in proc.stderr
    # the script compiles the plan `engine run` will on the head node: what the driver refuses, it refuses
    argv = [*argv[:1], "qwen35_27b", *argv[2:], "--set", "trainer.checkpoint_dir=/elsewhere"]
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "cluster", *argv], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "a run keeps its checkpoints in --out/checkpoints" in proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake_slurm(bin_dir: Path, calls: Path) -> None:
    """srun runs its command on this host (options dropped, call logged); scontrol/squeue name two hosts."""
    bin_dir.mkdir()
    srun = f"""\
        #!/usr/bin/env bash
        echo "srun $*" >> {calls}
        while [ $# -gt 0 ]; do
          case "$1" in -w) shift 2;; --*) shift;; *) break;; esac
        done
        exec "$@"
        """
    (bin_dir / "srun").write_text(textwrap.dedent(srun))
    (bin_dir / "squeue").write_text("#!/usr/bin/env bash\necho 'node[1-2]'\n")
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\nprintf 'node1\\nnode2\\n'\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)


@pytest.mark.slow
def test_two_node_ray_cluster_comes_up_and_env_reaches_both_nodes(tmp_path: Path) -> None:
    """Real Ray: head + 1 worker started through the generated srun lines, on a host where Ray ran before
    (~/.ray/auth_token exists: Ray would turn tokens on for the head only); a task on each node sees
    the exported environment; every Ray process is gone after the driver exits."""
    calls = tmp_path / "srun.calls"
    _fake_slurm(tmp_path / "bin", calls)
    driver_code = textwrap.dedent(
        """
        import os, ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On
        ray.init()
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        probe = ray.remote(num_cpus=1)(lambda: os.environ.get("ENGINE_PROBE"))
        seen = ray.get([probe.options(scheduling_strategy=On(n, soft=False)).remote() for n in nodes])
        print("NODES", len(nodes), "SEEN", sorted(seen))
        """
    )
    bring_up = cluster.BringUp(
        nodes=2,
        device="gpu",
        devices_per_node=1,
        cpus_per_node=1,
        driver=[sys.executable, "-c", driver_code],
        env={"ENGINE_PROBE": "reached", "RAY_DEDUP_LOGS": "0"},
        port=_free_port(),
        join_timeout_s=90,
    )
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)
    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    script = tmp_path / "ray_cluster.sh"
    script.write_text(cluster.render(bring_up))
    env = {
        "PATH": f"{tmp_path / 'bin'}:{Path(sys.executable).parent}:/usr/bin:/bin",
        "SLURM_JOB_ID": "4242",
        "HOME": str(tmp_path),
        "RAY_TMPDIR": ray_tmp,  # short: Ray's socket paths must stay under 107 bytes
        "PYTHONPATH": str(ROOT),
    }
    try:
        proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=200)
    finally:
        leftover = subprocess.run(["pgrep", "-f", ray_tmp], capture_output=True, text=True).stdout.strip()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "NODES 2 SEEN ['reached', 'reached']" in proc.stdout
    srun_calls = calls.read_text().splitlines()
    assert sum("--head" in c for c in srun_calls) == 1 and sum("--address=" in c for c in srun_calls) == 1
    assert leftover == ""  # the trap stopped every Ray process of this cluster
