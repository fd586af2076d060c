"""The Slurm path against a real Slurm (ci/slurm.sh: slurmctld, slurmd n1 and n2 on this host, munge, no
accounting): the CPU profile runs the tiny chain through sbatch, and a 2-node GRPO runs through
`engine cluster launch` with Ray across both nodes. tests/run/test_cluster.py keeps the stand-in checks."""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.data import assets
from engine.records.rerun import REPRODUCIBLE_KEYS, compare_metrics
from engine.run import gates
from engine.run.rundir import RunDir
from tests.conftest import ROOT, Launch, engine
from tests.support.slurm import Slurm, slurm_cluster
from tests.support.workflow import snakemake, workflow_copy

SNAKEMAKE_MARK = ".snakemake_timestamp"
CHAIN = {"prepare_data", "tiny_assets", "smoke", "train", "export", "provenance"}


@pytest.fixture(scope="module")
def slurm() -> Iterator[Slurm]:
    with slurm_cluster() as cluster:
        yield cluster


def assert_every_gate_evaluated(record: dict) -> None:
    """Every gate judged the run's steps; the learning gate may only lack a criterion for the recipe."""
    for gate in record["gates"]:
        if gate["name"] == "learning" and record["recipe"] not in gates.LEARNING:
            assert gate["status"] == gates.SKIP and "no learning criterion" in gate["detail"], gate
        else:
            assert gate["status"] == gates.PASS, gate


def same_files(a: Path, b: Path) -> None:
    """Byte-identical trees, but for the marker Snakemake puts into a directory() output it made."""

    def files(root: Path) -> list[Path]:
        return sorted(
            p.relative_to(root) for p in root.rglob("*") if p.is_file() and p.name != SNAKEMAKE_MARK
        )

    names = files(a)
    assert names == files(b)
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def documented_slurm_runs() -> list:
    """The `snakemake --profile profiles/slurm_*` commands of the README and the guides (docs/guide/)."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]:
        doc = str(path.relative_to(ROOT))
        for line in path.read_text().replace("\\\n", " ").splitlines():
            command = line.split("  #", 1)[0].strip()
            if re.match(r"(\.venv/bin/)?snakemake .*--profile profiles/slurm_", command):
                found.append(pytest.param(command, id=f"{doc}-{len(found)}"))
    return found


@pytest.mark.parametrize("command", documented_slurm_runs())
def test_documented_slurm_runs_pass_preflight(command: str, tmp_path: Path) -> None:
    """Each example builds its DAG, every plan passing preflight (a dry run submits nothing)."""
    work = workflow_copy(tmp_path)
    proc = snakemake(work, "-n", *shlex.split(command)[1:], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rule train:" in proc.stdout


@pytest.mark.slow
def test_cpu_profile_runs_the_tiny_chain_through_sbatch(
    slurm: Slurm, tmp_path: Path, tiny_assets: Path, tiny_cpu_run: Launch
) -> None:
    """`snakemake --profile profiles/slurm_cpu smoke_cpu`: each job an sbatch job that slurmctld records
    as completed, job states from squeue (accounting is off), outputs those of a local run."""
    work = workflow_copy(tmp_path)
    proc = snakemake(work, "--profile", "profiles/slurm_cpu", "smoke_cpu", env=slurm.env, timeout=1800)
    results = work / "results"
    logs = "".join(f"\n== {f.name}\n{f.read_text()[-1500:]}" for f in sorted(results.glob("*/logs/*.log")))
    assert proc.returncode == 0, proc.stderr[-3000:] + logs

    submitted = set(re.findall(r"^rule (\w+):$", proc.stdout + proc.stderr, re.M))
    assert submitted >= CHAIN, submitted
    jobs = [job for job in slurm.jobs() if job["comment"].startswith("rule_")]
    seen = {job["comment"].removeprefix("rule_").split("_wildcards_")[0] for job in jobs}
    assert seen == submitted and len(jobs) == len(submitted), jobs  # one Slurm job per rule's job
    assert {job["state"] for job in jobs} == {"COMPLETED"}, jobs

    # the outputs of a local run: data and tiny assets byte for byte, the trained steps' metrics
    local = tmp_path / "local-data"
    made = engine("prepare-data", "--dataset", "synthetic", "--seed", "0", "--out", str(local), timeout=300)
    assert made.returncode == 0, made.stderr
    for split in ("train.parquet", "test.parquet"):
        assert (results / "tiny_cpu/data" / split).read_bytes() == (local / split).read_bytes()
    same_files(results / "assets", tiny_assets)
    for kind in ("smoke", "train"):
        record = json.loads((results / "tiny_cpu" / kind / "run.json").read_text())
        assert record["status"] == "ok" and record["steps_done"] == record["target_steps"], record
        assert_every_gate_evaluated(record)
    train = RunDir(results / "tiny_cpu/train").read_metrics()
    assert compare_metrics(tiny_cpu_run.rows, train, REPRODUCIBLE_KEYS, rtol=1e-3, atol=1e-6) == []
    assert (results / "tiny_cpu/export/model.safetensors").is_file()
    assert (results / "tiny_cpu/train/provenance.json").is_file()


def _ray_processes(marker: str, wait_s: float) -> str:
    """Processes whose command line holds `marker` once `wait_s` has passed, or none are left."""
    deadline = time.monotonic() + wait_s
    while True:
        found = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout.strip()
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(1)


@pytest.mark.slow
def test_two_node_grpo_through_engine_cluster(slurm: Slurm, tmp_path: Path, tiny_assets: Path) -> None:
    """One sbatch allocation of n1 and n2 runs `engine cluster launch tiny_cpu --device cpu --nodes 2`:
    Ray's head on n1, a worker on n2, verl's driver on top, on a host where Ray ran before (a token in
    ~/.ray/auth_token); the run trains its steps with its metrics in the run directory, the checkpoint
    holds world size 2, and no Ray process outlives the job."""
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    stale_token = secrets.token_hex(32)
    (home / ".ray" / "auth_token").write_text(stale_token)
    out = tmp_path / "run"
    launch = [sys.executable, "-m", "engine", "cluster", "launch", "tiny_cpu", "--device", "cpu"]
    launch += ["--nodes", "2", "--cpus-per-node", "8", "--out", str(out)]
    for item in assets.recipe_sets(tiny_assets):
        launch += ["--set", item]
    name = f"engine-test-{secrets.token_hex(4)}"
    job_out = tmp_path / "job.out"
    sbatch = ["sbatch", "--wait", "--parsable", f"--job-name={name}", "--nodes=2", "--ntasks-per-node=1"]
    sbatch += ["--cpus-per-task=8", f"--output={job_out}", f"--chdir={ROOT}", "--wrap", shlex.join(launch)]
    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths stay under 107 bytes
    env = os.environ | slurm.env | {"HOME": str(home), "RAY_TMPDIR": ray_tmp, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    try:
        proc = subprocess.run(sbatch, env=env, capture_output=True, text=True, timeout=1200)
    finally:
        subprocess.run(["scancel", f"--name={name}"], env=env, capture_output=True)
        leftover = _ray_processes(ray_tmp, wait_s=60)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    log = RunDir(out).log
    why = (job_out.read_text(errors="replace")[-4000:] if job_out.exists() else "") + (
        log.read_text(errors="replace")[-3000:] if log.exists() else ""
    )
    assert proc.returncode == 0, proc.stderr + why
    job = proc.stdout.strip().split(";")[0]

    # Slurm ran it on both nodes: one allocation of n1 and n2, Ray steps launched by each node's slurmd
    info = slurm.command("scontrol", "show", "job", job)
    assert "JobState=COMPLETED" in info and "NodeList=n[1-2]" in info, info
    assert slurm.steps_on("n1", job) and slurm.steps_on("n2", job)
    assert "cluster: 2 Ray node(s) alive" in job_out.read_text(), why

    record = json.loads(RunDir(out).record.read_text())
    assert record["status"] == "ok" and record["exit_code"] == 0, record
    assert record["steps_done"] == record["target_steps"] == 2, record
    assert [row["step"] for row in RunDir(out).read_metrics()] == [1, 2]
    assert_every_gate_evaluated(record)
    actor = out / "checkpoints" / "global_step_2" / "actor"
    assert {p.name for p in actor.glob("model_world_size_*")} == {
        "model_world_size_2_rank_0.pt",
        "model_world_size_2_rank_1.pt",
    }
    assert leftover == ""  # every Ray process of the job stopped with it
    assert (home / ".ray" / "auth_token").read_text() == stale_token  # the job's own token, in env only


def test_a_second_cluster_is_refused_while_a_left_one_runs(slurm: Slurm, tmp_path: Path) -> None:
    """A cluster left up (a stopped test run) makes `up` refuse, naming its directory and the `down`
    that stops it, before starting anything of its own."""
    other = tmp_path / "other"
    up = subprocess.run(
        ["bash", str(ROOT / "ci" / "slurm.sh"), "up", str(other)], capture_output=True, text=True, timeout=60
    )
    assert up.returncode == 3, up.stderr
    assert f"ci/slurm.sh down {slurm.dir}" in up.stderr and "munged" in up.stderr, up.stderr
    assert not list(other.glob("*.pid")) and not (other / "slurm.conf").exists()
    assert os.path.realpath("/etc/slurm/slurm.conf") == str(slurm.dir / "slurm.conf")
