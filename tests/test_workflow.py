"""The Snakemake workflow: dry-run DAGs for every target, lint, format, bad config, and the real CPU chain."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.support.workflow import SNAKEMAKE, snakemake, snakemake_env, workflow_copy

FIVE = {"prepare_data", "smoke", "train", "export", "provenance"}
TARGETS = ["run_qwen35_35b", "run_qwen35_27b", "smoke_cpu", "learn_cpu", "ci_smoke_gpu", "ci_smoke_npu"]
CPU_TARGETS = ("smoke_cpu", "learn_cpu")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return workflow_copy(tmp_path_factory.mktemp("workflow"))


def job_counts(stdout: str) -> dict[str, int]:
    """Rule -> count from the 'Job stats' table of a dry run."""
    table = stdout.split("Job stats:", 1)[1].split("Reasons:", 1)[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M)}


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_dry_run_resolves_every_device_and_node_count(target: str, scratch: Path) -> None:
    for device in ("gpu", "npu"):
        for nodes in (1, 2):
            config = [f"device={device}", f"nodes={nodes}", "hub=True"]
            if nodes == 2:  # 16 prompts x 5 do not split over 2 NPU nodes: preflight refuses the recipe
                config.append("sets=[data.train_batch_size=32,actor.ppo_mini_batch_size=32]")
            proc = snakemake(scratch, "-n", "-p", target, "--config", *config)
            assert proc.returncode == 0, proc.stderr[-2000:]
            counts = job_counts(proc.stdout)
            assert set(counts) >= FIVE and counts["train"] == 1, counts
            train = proc.stdout.split("rule train:", 1)[1].split("\n\n", 1)[0]
            multi = nodes == 2 and target not in CPU_TARGETS
            assert ("-m engine cluster launch --nodes 2" in train) == multi
            assert ("-m engine run" in train) == (not multi)
            if multi:
                assert "mpi=srun" in train and "nodes=2" in train and "tasks=2" in train


def test_lint_and_snakefmt_are_clean(scratch: Path) -> None:
    lint = snakemake(scratch, "--lint")
    assert lint.returncode == 0 and "Congratulations" in lint.stdout + lint.stderr, lint.stdout[-3000:]
    fmt = subprocess.run(
        [str(Path(sys.executable).parent / "snakefmt"), "--check", "Snakefile", "workflow"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert fmt.returncode == 0, fmt.stderr


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (["device=tpu"], "error: --config device: 'tpu' is not one of ['gpu', 'npu', 'cpu']"),
        (["nodes=0"], "error: --config nodes: 0 is less than the minimum of 1"),
        (["recipe=qwen99"], "error: --config recipe=qwen99: no such recipe; known: qwen35_27b"),
        (["device=cpu"], "error: recipe qwen35_35b runs on gpu/npu, not cpu; pass --config device=gpu"),
        ([], "error: recipe qwen35_35b needs raw geo3k: set --config geo3k_raw=PATH"),
        (["hub=True", "sets=[parallel.nope=1]"], "error: recipe qwen35_35b:"),
        (
            ["recipes={run_qwen35_99b: qwen35_27b}"],
            "error: --config recipes: 'run_qwen35_99b' is not a target",
        ),
        (
            ["recipes={run_qwen35_35b: qwen99}"],
            "error: --config recipes: run_qwen35_35b=qwen99: no such recipe",
        ),
        (["hub=True", "control=no_sync"], "error: --config control: 'no_sync' is not one of"),
    ],
)
def test_bad_config_stops_before_any_job_with_one_line(
    config: list[str], message: str, scratch: Path
) -> None:
    before = sorted((scratch / "results").rglob("*"))
    proc = (
        snakemake(scratch, "-n", "run_qwen35_35b", "--config", *config)
        if config
        else snakemake(scratch, "-n", "run_qwen35_35b")
    )
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(message), proc.stderr[-1500:]
    assert "Traceback" not in proc.stderr and "rule train" not in proc.stdout
    assert sorted((scratch / "results").rglob("*")) == before


def _jobs(stdout: str) -> dict[str, str]:
    """Rule -> its block (input, output, shell command) in a `-n -p` dry run."""
    blocks = {}
    for block in stdout.split("\nrule ")[1:]:
        name, _, body = block.partition(":")
        blocks[name.strip()] = body.split("\n\n", 1)[0]
    return blocks


def test_h200_profile_points_the_flagship_target_at_its_rehearsal(scratch: Path) -> None:
    """`snakemake --profile profiles/h200 run_qwen35_35b`: the headline target runs the 35B-A3B rehearsal on
    a model the workflow builds, FSDP2 visibly in place of fsdp_turbo, export with logit verification and
    the accelerator report; with control=..., the broken-loop control joins the DAG."""
    proc = snakemake(scratch, "-n", "-p", "--profile", "profiles/h200", "run_qwen35_35b")
    assert proc.returncode == 0, proc.stderr[-2000:]
    jobs = _jobs(proc.stdout)
    assert set(jobs) >= {
        "random_model",
        "prepare_data",
        "smoke",
        "train",
        "export",
        "run_report",
        "provenance",
    }
    assert "tiny_assets" not in jobs and "control" not in jobs
    model = "results/models/Qwen3.5-35B-A3B-6L"
    assert f"engine make-model --model Qwen3.5-35B-A3B-6L --seed 0 --out {model}" in jobs["random_model"]
    for rule in ("smoke", "train"):
        assert "engine run qwen35_35b_h200 --device gpu" in jobs[rule]
        assert f"--set model.path={scratch / model}" in jobs[rule]
        assert "--set actor.strategy=fsdp2" in jobs[rule] and "accelerator_jobs=1" in jobs[rule]
    assert "--verify-logits" in jobs["export"]
    assert "engine smoke-report results/qwen35_35b_h200/train" in jobs["run_report"]

    with_control = snakemake(
        scratch,
        "-n",
        "-p",
        "--profile",
        "profiles/h200",
        "ci_smoke_gpu",
        "--config",
        "control=no_weight_sync",
    )
    assert with_control.returncode == 0, with_control.stderr[-2000:]
    control = _jobs(with_control.stdout)["control"]
    assert "engine run smoke_qwen35_0p8b_h200 --device gpu --control no_weight_sync" in control
    assert "--set trainer.save_freq=-1" in control and "results/models/Qwen3.5-0.8B" in control


def test_cpu_chain_builds_the_tiny_assets_it_trains_on(scratch: Path) -> None:
    """The tiny recipes' model and data come from the tiny_assets rule, not from `engine run` building
    them on the side (which it does only for a launch outside the workflow)."""
    proc = snakemake(scratch, "-n", "-p", "smoke_cpu")
    assert proc.returncode == 0, proc.stderr[-2000:]
    jobs = _jobs(proc.stdout)
    assert "tiny_assets" in jobs and "results/assets" in jobs["smoke"].split("output:")[0]


def test_bench_levers_runs_every_configured_stage_and_compares_it(scratch: Path) -> None:
    """The trainer benchmarks as workflow jobs: one bench-gpu run per configured stage on the models the
    workflow builds, the numerics and attention checks, and each stage against its regression baseline."""
    proc = snakemake(scratch, "-n", "-p", "--profile", "profiles/h200", "bench_levers")
    assert proc.returncode == 0, proc.stderr[-2000:]
    counts = job_counts(proc.stdout)
    assert (
        counts["bench_trainer"] == 8 and counts["compare_baseline"] == 8 and counts["trainer_numerics"] == 1
    )
    assert counts["random_model"] == 2 and counts["attention_check"] == 1
    check = next(line for line in proc.stdout.splitlines() if "benchmarks.attention_check" in line)
    assert "--model results/models/Qwen3.5-0.8B --seqs 4 --seq 2048" in check
    commands = [line for line in proc.stdout.splitlines() if "benchmarks.gpu_bench run" in line]
    moe = next(c for c in commands if "--out results/bench/moe.jsonl" in c)
    assert "--model results/models/Qwen3.5-35B-A3B-6L" in moe and "--repeats 3" in moe
    assert "--levers baseline,fused,fast,bf16-sr,fast-bf16,fast-bf16-reduce+no-sync" in moe
    assert "--profile results/bench/profile/moe" in moe
    deferred = next(c for c in commands if "--out results/bench/moe-deferred.jsonl" in c)
    assert "--host-syncs deferred" in deferred and "--host-syncs" not in moe
    ragged = next(c for c in commands if "--out results/bench/moe-ragged.jsonl" in c)
    assert "--levers fast-text-bf16,fast-bf16-reduce+bf16-sr-compiled+text-only+compiled-logprobs" in ragged
    assert ",fast-bf16-reduce+bf16-sr-compiled+text-only+compiled-logprobs+sdpa-no-cudnn " in ragged
    assert "--fill 0.5" in ragged and "--profile" not in ragged
    padded = next(c for c in commands if "--out results/bench/moe-padded-sdpa.jsonl" in c)
    assert "--modes verl-padded " in padded and "compiled-logprobs+sdpa-no-cudnn " in padded
    assert "--fill 0.5" in padded and "--profile results/bench/profile/moe-padded-sdpa" in padded
    # the rollout stage: both rollouts on the hf recipe's data and model, the same levers, no save
    assert counts["rollout_run"] == 2 and counts["rollout_ratio"] == 1
    runs = {
        side: next(c for c in proc.stdout.splitlines() if f"--out results/bench/rollout/{side}" in c)
        for side in ("hf", "vllm")
    }
    assert "engine run smoke_gpu_h200 " in runs["hf"] and "engine run smoke_qwen35_0p8b_h200 " in runs["vllm"]
    shared = runs["hf"].split(" --device ")[1].split(" --out ")[0]
    assert shared == runs["vllm"].split(" --device ")[1].split(" --out ")[0]
    for needed in (
        "--levers fast",
        "trainer.save_freq=-1",
        "trainer.total_training_steps=4",
        "results/smoke_gpu_h200/data/train.parquet",
        "model.path=",
        "actor.strategy=fsdp2",
    ):
        assert needed in shared, needed
    assert "benchmarks.rollout_ratio results/bench/rollout/hf results/bench/rollout/vllm" in proc.stdout
    one = snakemake(scratch, "-np", "bench_levers", "--config", "bench_stages=[moe]", "small_models=true")
    assert one.returncode == 0 and job_counts(one.stdout)["bench_trainer"] == 1, one.stderr[-2000:]
    assert "--model results/models/small/Qwen3.5-35B-A3B-6L" in one.stdout  # never the full-size one
    bad = snakemake(scratch, "-n", "bench_levers", "--config", "bench_stages=[moe,gpt]")
    assert bad.returncode != 0 and "error: --config bench_stages: ['gpt'] not in bench.stages" in bad.stderr


# the GPU benchmark rules at tiny widths on the CPU: the same jobs and commands, torch kernels, one step
TINY_BENCH = """
bench:
  kernels: torch
  steps: 1
  repeats: 1
  stages:
    moe-padded:
      {model: Qwen3.5-35B-A3B-6L, modes: verl-padded, shapes: 2/2/32, levers: fast-bf16, host_syncs: verl}
"""


def test_bench_levers_runs_on_the_cpu_at_tiny_widths(tmp_path: Path) -> None:
    """The benchmark rules for real (not a dry run): the model the workflow builds, a bench-gpu row that
    reads back the configured lever as applied, the comparison with the baselines written."""
    work = workflow_copy(tmp_path)
    (work / "tiny-bench.yaml").write_text(TINY_BENCH)
    args = ["bench_levers", "--cores", "2", "--configfile", "tiny-bench.yaml"]
    args += ["--config", "small_models=true", "bench_stages=[moe-padded]"]
    proc = snakemake(work, *args, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (work / "results/bench/moe-padded.jsonl").read_text().splitlines()]
    got = [
        (r["levers"], r["param_dtype"], r["state_dtype"], r["reshard_after_forward"], r["host_syncs"])
        for r in rows
    ]
    assert got == [
        ("fast-bf16", "bfloat16", "bfloat16", False, "verl")
    ]  # the stage's host_syncs reached the worker
    assert all(r["model"].startswith("qwen3_5_moe_text") and r["tokens_per_s"] > 0 for r in rows)
    compared = json.loads((work / "results/bench/compare-moe-padded.json").read_text())
    assert [(c["verdict"], c["regression"]) for c in compared] == [("no baseline", False)]


def test_a_failed_group_keeps_the_stages_rows(tmp_path: Path) -> None:
    """A group that fails (here varlen-attn on padded rows, which it refuses) fails the job; Snakemake
    removes the job's output, and the rows of the groups that measured are kept beside the log with the
    failed group's error row."""
    work = workflow_copy(tmp_path)
    both = "fill: 0.5, levers: 'fast-bf16,fast-bf16+varlen-attn',"  # padded rows: varlen-attn refuses
    failing = TINY_BENCH.replace("levers: fast-bf16,", both)
    (work / "tiny-bench.yaml").write_text(failing)
    args = ["bench_levers", "--cores", "2", "--configfile", "tiny-bench.yaml"]
    args += ["--config", "small_models=true", "bench_stages=[moe-padded]"]
    proc = snakemake(work, *args, timeout=900)
    assert proc.returncode != 0
    assert not (work / "results/bench/moe-padded.jsonl").exists()
    kept = work / "results/bench/logs/moe-padded.failed.jsonl"
    rows = [json.loads(line) for line in kept.read_text().splitlines()]
    got = [(r["levers"], "error" in r) for r in rows]
    assert got == [("fast-bf16", False), ("fast-bf16+varlen-attn", True)]
    assert rows[0]["tokens_per_s"] > 0 and "use_remove_padding=true" in rows[1]["error"], rows[1]


def test_run_target_needs_a_recipe(scratch: Path) -> None:
    proc = snakemake(scratch, "-n", "run")
    assert proc.returncode != 0 and "error: the run target needs --config recipe=NAME" in proc.stderr
    ok = snakemake(scratch, "-n", "run", "--config", "recipe=qwen35_27b", "device=npu", "hub=True")
    assert ok.returncode == 0 and set(job_counts(ok.stdout)) >= FIVE


def _engine_run_pid(parent: int, rundir: str) -> int | None:
    import psutil

    for child in psutil.Process(parent).children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        if cmd[1:4] == ["-m", "engine", "run"] and rundir in cmd:
            return child.pid
    return None


def _check_records(results: Path, cache: Path) -> None:
    """The chain's run crate passes rocrate-validator as a Provenance Run Crate (one action per step),
    and the export's README.md parses as a Hugging Face model card pointing to the record."""
    from huggingface_hub import ModelCard

    from tests.support.rocrate_validation import check_all, claimed

    train = results / "train"
    assert "provenance-run-crate-0.5" in claimed(train)
    found = check_all(train, cache)
    assert not any(found.values()), found
    crate = json.loads((train / "ro-crate-metadata.json").read_text())
    steps = [n["name"] for n in crate["@graph"] if n.get("@type") == "HowToStep"]
    assert steps == ["prepare_data", "smoke", "train", "export"]
    card = ModelCard.load(results / "export" / "README.md")
    assert f"`{train.resolve() / 'provenance.json'}`" in card.text


@pytest.mark.slow
def test_smoke_cpu_chain_noop_rerun_and_resume_after_kill(tmp_path: Path) -> None:
    """Real chain on CPU: data, 1-step smoke, 3-step train (killed after step 1, then resumed),
    export, provenance, curves; a second invocation has nothing to do."""
    work = workflow_copy(tmp_path)
    env = snakemake_env()
    args = [str(SNAKEMAKE), "--cores", "2", "--profile", "profiles/local", "smoke_cpu"]
    args += ["--config", "sets=[trainer.save_freq=1,trainer.total_training_steps=3]"]
    marker = work / "results/tiny_cpu/train/checkpoints/latest_checkpointed_iteration.txt"
    first = subprocess.Popen(args, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while not (marker.exists() and marker.read_text().strip() == "1"):
        assert first.poll() is None and time.monotonic() < deadline, "train never saved step 1"
        time.sleep(1)
    pid = _engine_run_pid(first.pid, "results/tiny_cpu/train")
    assert pid is not None
    # stop the train rule mid-run as Slurm does at its time limit (SIGINT would be ignored where the
    # test itself runs in the background); engine run stops verl's tree and publishes the attempt
    os.kill(pid, signal.SIGTERM)
    out = first.communicate(timeout=300)[0].decode()
    assert first.returncode != 0, out[-2000:]
    assert not (work / "results/tiny_cpu/train/run.json").exists()  # no success recorded
    # the kill races the next step: whatever was checkpointed by then is where the resume starts
    saved = int(marker.read_text().strip())
    assert 1 <= saved < 3

    resumed = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=1200)
    logs = work / "results/tiny_cpu/logs"
    tails = "".join(f"\n== {f.name}\n" + f.read_text()[-1500:] for f in sorted(logs.glob("*.log")))
    assert resumed.returncode == 0, resumed.stderr[-1500:] + tails
    run = json.loads((work / "results/tiny_cpu/train/run.json").read_text())
    assert run["status"] == "ok" and run["last_step"] == 3 and run["steps_done"] == 3 - saved  # the rest only
    earlier = (work / "results/tiny_cpu/train/metrics.earlier.jsonl").read_text().splitlines()
    assert {json.loads(line)["step"] for line in earlier} >= set(range(1, saved + 1))
    assert marker.read_text().strip() == "3"
    export = work / "results/tiny_cpu/export"
    assert (export / "model.safetensors").is_file() and (export / "config.json").is_file()
    assert (work / "results/tiny_cpu/train/provenance.json").is_file()
    _check_records(work / "results/tiny_cpu", tmp_path / "validator-cache")
    assert (work / "results/tiny_cpu/report/curves.png").stat().st_size > 10_000
    for rule in FIVE:
        assert (work / f"results/tiny_cpu/logs/{rule}.log").exists()

    again = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr
    _rerun_verbs(work, args, env)

    report = snakemake(work, "--cores", "1", "smoke_cpu", "--report", "report.html", timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    assert "curves.png" in (work / "report.html").read_text(errors="replace")


def _rerun_verbs(work: Path, args: list[str], env: dict[str, str]) -> None:
    """Snakemake's own re-run verbs on a finished chain, with no hand cleanup between them: a rule
    re-run alone (-R), one killed mid-way and completed by the next invocation (--rerun-incomplete, the
    profile's default), then two --forceall in a row. Each rule's command must take over what Snakemake
    left of its earlier output, and training resumes from (here: finds complete) its kept checkpoint."""

    def snake(*extra: str, timeout: int = 1200) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*args, *extra], cwd=work, env=env, capture_output=True, text=True, timeout=timeout
        )

    manifest = work / "results/assets/assets.json"
    rerun = snake("-R", "tiny_assets", "--until", "tiny_assets")
    assert rerun.returncode == 0 and manifest.is_file(), rerun.stderr[-2000:]

    # killed mid-rule (OOM killer, lost node: Snakemake and its job at once): models written, no manifest
    # yet. Snakemake's lock stays, which its own `--unlock` releases; the next invocation redoes the
    # incomplete rule (the profile's rerun-incomplete), no file removed by hand
    killed = subprocess.Popen(
        [*args, "--forcerun", "tiny_assets", "--until", "tiny_assets"],
        cwd=work,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while manifest.exists() or not list((work / "results/assets").glob("tiny-qwen35*")):
        assert killed.poll() is None and time.monotonic() < deadline, "the forced rule never started writing"
        time.sleep(0.2)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    assert not manifest.exists()
    assert snake("--unlock").returncode == 0
    completed = snake("--until", "tiny_assets")
    assert completed.returncode == 0 and manifest.is_file(), completed.stderr[-2000:]

    for _ in range(2):
        forced = snake("--forceall")
        assert forced.returncode == 0, forced.stderr[-3000:]
        assert "provenance" in forced.stdout + forced.stderr
        run = json.loads((work / "results/tiny_cpu/train/run.json").read_text())
        assert run["status"] == "ok" and run["checkpoint_step"] == 3
    assert snake().returncode == 0
