"""`engine run`/`bench` plumbing that needs no training: planning, refusal, progress, success rules."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import overhead
from engine import fsutil
from engine.cli import main
from engine.errors import UserError
from engine.run import gates, launcher, record, rundir, watch
from tests.conftest import ROOT


def test_launch_module_stays_light() -> None:
    code = (
        "import sys, engine.run.launcher; "
        "print(sorted(m for m in ('torch', 'verl', 'ray') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def model_dir(tmp_path: Path) -> Path:
    """A model directory for tiny_cpu, so planning builds no tiny assets into the checkout's results/."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3_5"}')
    return model


def test_plan_carries_run_directory_and_file_logger(tmp_path: Path) -> None:
    sets = ["trainer.total_training_steps=1", f"model.path={model_dir(tmp_path)}"]
    p = launcher.build_plan("tiny_cpu", "cpu", sets, tmp_path)
    overrides = p.overrides
    assert f"trainer.default_local_dir={tmp_path / 'checkpoints'}" in overrides
    assert "trainer.logger=[console,file]" in overrides
    assert "trainer.total_training_steps=1" in overrides
    env = launcher.launch_env(p, tmp_path)
    assert env["VERL_FILE_LOGGER_PATH"] == str(tmp_path / "metrics.jsonl")
    assert "engine.verl_ext" in env["VERL_USE_EXTERNAL_MODULES"].split(",")
    assert p.command[1:3] == ["-m", "verl.trainer.main_ppo"]


def test_run_refuses_when_preflight_finds_problems(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "nowhere.parquet"
    run = str(tmp_path / "run")
    bad = f"data.train_files={missing}"
    sets = ["--set", bad, "--set", f"model.path={model_dir(tmp_path)}"]
    code = main(["run", "tiny_cpu", "--device", "cpu", "--out", run, *sets])
    assert code == 2
    assert f"data.train_files {missing}: file not found" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing was launched, nothing created


KIND = ("cpu", "tiny_cpu", False)  # device, recipe, moe: what the gates are keyed by
HEALTHY = {
    gates.PROBS_DIFF_MAX: 0.0,
    "actor/pg_loss": 0.1,
    gates.GRAD_NORM: 1.0,
    "actor/entropy": 1.0,
    gates.REWARD: 0.1,
    gates.ADV_MAX: 1.0,
    gates.ADV_MIN: -1.0,
}
TWO = [{"step": s, "data": HEALTHY} for s in (1, 2)]


def _code(code: int, rows: list, total: int, before: int = 0, after: int = 0, earlier: list = ()) -> int:
    return record.judge(code, rows, list(earlier), total, (before, after), None, KIND).code


def test_judge_never_reports_success_without_training() -> None:
    assert _code(0, TWO, 2, after=2) == 0
    assert _code(0, [], 2) == 1  # verl exited 0 after resuming a finished run, with nothing saved
    assert _code(0, TWO[:1], 2, after=1) == 1
    assert _code(3, TWO, 2, after=2) == 3  # verl's own failure code is passed through
    assert _code(0, TWO[1:], 2, before=1, after=2) == 0  # a resume that finished the remaining step
    assert _code(0, [], 2, before=1, after=1) == 1  # resumed at step 1, exited 0, trained nothing


def test_an_already_trained_checkpoint_is_judged_by_the_attempt_that_trained_it() -> None:
    """Rerunning a finished run trains nothing: its gates must still count (Snakemake removes a failed
    job's run.json but not its metrics), and with no metrics left there is nothing to vouch for it."""
    ok = record.judge(0, [], TWO, 2, (2, 2), None, KIND)
    assert ok.code == 0 and not ok.trained and ok.gates_over == record.EARLIER_ATTEMPT
    nan = [{"step": 1, "data": HEALTHY | {"actor/pg_loss": float("nan")}}]
    failed = record.judge(0, [], nan, 2, (2, 2), None, KIND)
    assert failed.code == gates.EXIT_GATE_FAILED and failed.status == "failed"
    assert [c.name for c in gates.failed(failed.checks)] == ["finite_losses"]
    blind = record.judge(0, [], [], 2, (2, 2), None, KIND)
    assert blind.code == 1 and "nothing for the gates to judge" in (blind.error or "")


def test_metrics_lost_by_a_launch_that_trained_are_an_error(tmp_path: Path) -> None:
    """verl saved a later checkpoint but no step reached the metrics file: the launch failed, with the
    cause (a 2-node run once exited 0 as "already trained" with its metrics in another directory)."""
    run = rundir.RunDir(tmp_path)
    lost = record.judge(0, [], [], 2, (0, 2), run.metrics_problem(), KIND)
    assert (
        lost.code == 1
        and "metrics.jsonl is missing" in (lost.error or "")
        and "trained to step 2" in lost.error
    )
    run.metrics.write_text("")
    assert "metrics.jsonl is empty" in (
        record.judge(0, [], [], 2, (0, 2), run.metrics_problem(), KIND).error or ""
    )
    assert record.judge(0, TWO, [], 2, (0, 2), None, KIND).error is None  # logged what it trained


def test_run_record_refuses_older_and_foreign_files(tmp_path: Path) -> None:
    good = record.RunRecord(
        recipe="tiny_cpu", device="cpu", command=["verl"], command_line="verl", sets=[], env={}, start="s",
        end="e", wall_s=1.0, exit_code=0, steps_done=2, last_step=2, checkpoint_step=2, target_steps=2,
        status="ok", gates=[],
    )  # fmt: skip
    path = tmp_path / "run.json"
    path.write_text(good.to_json())
    assert json.loads(path.read_text())["schema"] == record.SCHEMA
    assert record.RunRecord.read(path) == good
    older = json.loads(path.read_text())
    del older["schema"]
    path.write_text(json.dumps(older))
    with pytest.raises(UserError, match="written by an engine older than its schema"):
        record.RunRecord.read(path)
    assert record.RunRecord.read(path, unversioned=True) == good  # the records kept from before
    path.write_text(json.dumps(older | {"schema": "someone-else/run/7"}))
    with pytest.raises(UserError, match="schema 'someone-else/run/7' is not"):
        record.RunRecord.read(path)
    path.write_text(json.dumps(older | {"schema": record.SCHEMA, "steps_done": "two"}))
    with pytest.raises(UserError, match="steps_done"):
        record.RunRecord.read(path)


def test_a_run_directory_of_an_older_engine_resumes_and_a_foreign_one_is_refused(tmp_path: Path) -> None:
    """Resuming reads only the recipe's name: an engine upgrade between two launches must not turn the
    user's own run directory (and its checkpoints) into a foreign one."""
    reuse = launcher.reusable_run_dir("tiny_cpu")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    written = {"schema": record.SCHEMA, "recipe": "tiny_cpu", "device": "cpu", "steps_done": 2}
    (run / "run.json").write_text(json.dumps(written))  # fields of another engine version: not a RunRecord
    assert reuse(run) is None
    (run / "run.json").write_text(json.dumps(written | {"recipe": "tiny_moe_cpu"}))
    assert "holds a run of recipe 'tiny_moe_cpu'" in (reuse(run) or "")
    for text in ("{not json", json.dumps({"device": "cpu"}), json.dumps(["tiny_cpu"])):
        (run / "run.json").write_text(text)
        assert "unreadable or names no recipe" in (reuse(run) or "")


def test_a_first_attempt_killed_outright_does_not_strand_its_directory(tmp_path: Path) -> None:
    """SIGKILL (OOM killer, a lost node) before an attempt published anything leaves only its hidden stage
    and the lock file: the next launch of the same recipe goes on there; another recipe's is refused."""
    reuse = launcher.reusable_run_dir("tiny_cpu")
    run = tmp_path / "run"
    stage = run / f"{rundir.ATTEMPT_PREFIX}k1ll3d{fsutil.PARTIAL}"
    stage.mkdir(parents=True)
    (stage / rundir.LOG).write_text("loading\n")  # killed before it wrote recipe.yaml
    assert reuse(run) is None
    (stage / rundir.RECIPE).write_text("name: tiny_cpu\n")
    (run / rundir.LOCK).write_text("pid 1 on elsewhere\n")
    assert reuse(run) is None
    (stage / rundir.RECIPE).write_text("name: tiny_moe_cpu\n")
    assert "unpublished attempt of recipe 'tiny_moe_cpu'" in (reuse(run) or "")
    (run / "notes.txt").write_text("mine\n")
    shutil.rmtree(stage)
    (run / rundir.LOCK).unlink()
    assert "holds no run" in (reuse(run) or "")


def test_a_second_launch_into_a_directory_in_use_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Two launches into one --out would resume the same checkpoints and save over each other's steps."""
    data = tmp_path / "data.parquet"
    data.write_bytes(b"PAR1")
    run = tmp_path / "run"
    sets = [f"model.path={model_dir(tmp_path)}", f"data.train_files={data}", f"data.val_files={data}"]
    argv = ["run", "tiny_cpu", "--device", "cpu", "--out", str(run)] + [a for s in sets for a in ("--set", s)]
    with rundir.RunDir(run).lock():
        code = main(argv)
    err = capsys.readouterr().err
    assert code == 3 and err.count("\n") == 1, err
    assert f"in use by pid {os.getpid()} on " in err and "pass another --out" in err
    assert sorted(p.name for p in run.iterdir()) == [rundir.LOCK]  # nothing staged, nothing written


def test_file_logger_path_reaches_every_ray_worker_through_the_runtime_env(tmp_path: Path) -> None:
    """verl's TaskRunner (which writes the metrics) runs in a Ray worker; on a cluster of `ray start`
    it does not inherit the driver's environment, so the path goes into Ray's job runtime env."""
    verl = pytest.importorskip("verl")
    from hydra import compose, initialize_config_dir

    sets = ["cluster.nodes=2", f"model.path={model_dir(tmp_path)}"]
    p = launcher.build_plan("tiny_cpu", "cpu", sets, tmp_path)
    metrics = tmp_path / ".attempt.x" / "metrics.jsonl"
    command = launcher.verl_command(p, metrics)
    assert command[: len(p.command)] == p.command
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=command[3:])
    assert str(metrics) == cfg.ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH
    assert cfg.ray_kwargs.ray_init.num_cpus is None and "num_gpus" not in cfg.ray_kwargs.ray_init


def test_read_metrics_skips_a_partial_line(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"step": 1, "data": {"actor/grad_norm": 1.5}}) + '\n{"step": 2, "da')
    rows = rundir.read_metrics(path)
    assert [row["step"] for row in rows] == [1]
    line = watch.progress_line(rows[0], 2)
    assert line.startswith("step 1/2") and "grad_norm 1.5000" in line and "reward -" in line


def test_execute_tees_output_and_passes_exit_code(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    script = (
        "import json, os, sys\n"
        "print('hello from the trainer')\n"
        "open(os.environ['M'], 'w').write(json.dumps({'step': 1, 'data': {}}) + '\\n')\n"
        "sys.exit(7)\n"
    )
    env = dict(os.environ) | {"M": str(metrics)}
    code = watch.execute([sys.executable, "-c", script], env, tmp_path / "train.log", metrics, 1)
    assert code == 7
    assert "hello from the trainer" in (tmp_path / "train.log").read_text()


# torch's own words when verl's rendezvous port was taken between its pick and its bind (CI, 2026-12-07)
PORT_RACE = (
    "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
    "address. port: 46019, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"
)


def launches(tmp_path: Path, fail_first: int, then: str = "") -> tuple[list[str], Path]:
    """A command that prints the port race and exits 1 for its first `fail_first` launches, then runs
    `then` and exits 0; each launch leaves a line in `launches.txt`."""
    counter = tmp_path / "launches.txt"
    script = (
        "import os, sys\n"
        f"c = {str(counter)!r}\n"
        "n = len(open(c).read().split()) if os.path.exists(c) else 0\n"
        "open(c, 'a').write('x\\n')\n"
        f"if n < {fail_first}:\n"
        f"    print({PORT_RACE!r}); sys.exit(1)\n"
        f"{then}\n"
    )
    return [sys.executable, "-c", script], counter


def test_a_port_race_at_startup_is_launched_again_and_recorded(tmp_path: Path) -> None:
    command, counter = launches(tmp_path, fail_first=1, then="print('trained')")
    log, metrics = tmp_path / "train.log", tmp_path / "metrics.jsonl"
    code, restarts = watch.execute_with_restarts(command, dict(os.environ), log, metrics, 1, lambda: False)
    assert code == 0 and len(counter.read_text().split()) == 2
    assert restarts == ["exit 1: a port picked for a rendezvous was taken before it was bound (a port race)"]
    text = log.read_text()  # the failed launch's console is kept ahead of the one that ran
    assert text.index("EADDRINUSE") < text.index("starting it again") < text.index("trained")


def test_startup_restarts_stop_at_the_limit_and_never_after_training(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    command, counter = launches(tmp_path / "a", fail_first=9)
    log, metrics = tmp_path / "a" / "train.log", tmp_path / "a" / "metrics.jsonl"
    code, restarts = watch.execute_with_restarts(command, dict(os.environ), log, metrics, 1, lambda: False)
    assert code == 1 and len(restarts) == watch.START_ATTEMPTS - 1
    assert len(counter.read_text().split()) == watch.START_ATTEMPTS
    # the same words after a step was trained (or a checkpoint saved): that launch is not started again
    (tmp_path / "b").mkdir()
    command, counter = launches(tmp_path / "b", fail_first=9)
    log, metrics = tmp_path / "b" / "train.log", tmp_path / "b" / "metrics.jsonl"
    code, restarts = watch.execute_with_restarts(command, dict(os.environ), log, metrics, 1, lambda: True)
    assert (code, restarts) == (1, []) and len(counter.read_text().split()) == 1


def test_a_launch_started_again_says_so_in_its_record_and_closing_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`engine run` end to end with verl's command swapped for one that loses the port race once and then
    fails for another reason: run.json lists the restart and the closing lines repeat it."""
    command, _ = launches(tmp_path, fail_first=1, then="print('ValueError: something else'); sys.exit(2)")
    monkeypatch.setattr(launcher, "verl_command", lambda p, metrics: command)
    data = tmp_path / "data.parquet"
    data.write_bytes(b"PAR1")
    run = tmp_path / "run"
    sets = [f"model.path={model_dir(tmp_path)}", f"data.train_files={data}", f"data.val_files={data}"]
    argv = ["run", "tiny_cpu", "--device", "cpu", "--out", str(run)] + [a for s in sets for a in ("--set", s)]
    assert main(argv) == 2
    written = record.RunRecord.read(rundir.RunDir(run).record)
    assert written.exit_code == 2 and len(written.restarts) == 1 and "port race" in written.restarts[0]
    out = capsys.readouterr().out
    assert "verl was started again after a failed start (exit 1: " in out
    log = rundir.RunDir(run).log.read_text()
    assert log.index("EADDRINUSE") < log.index("something else")


def test_a_failure_that_is_not_a_startup_race_is_not_retried(tmp_path: Path) -> None:
    script = "import sys; print('ValueError: model.path does not exist'); sys.exit(1)"
    log, metrics = tmp_path / "train.log", tmp_path / "metrics.jsonl"
    code, restarts = watch.execute_with_restarts(
        [sys.executable, "-c", script], dict(os.environ), log, metrics, 1, lambda: False
    )
    assert (code, restarts) == (1, []) and log.read_text().count("model.path") == 1


def test_measure_counts_the_whole_process_tree(tmp_path: Path) -> None:
    child = "import time; b = bytearray(200 * 2**20); time.sleep(1.5)"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    result = overhead.measure(
        [sys.executable, "-c", parent], dict(os.environ), tmp_path / "log", interval=0.1
    )
    assert result["exit_code"] == 0
    assert result["max_processes"] >= 2
    assert result["peak_rss_gib"] >= 0.19 and result["peak_pss_gib"] > 0.1
    assert result["wall_s"] >= 1.5
