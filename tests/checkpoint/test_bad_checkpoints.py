"""Bad input, part two: damaged checkpoints and export paths, corrupt bytes (hypothesis) for checkpoint,
record, recipe, lock and pins files, each `python -m` entry point's own wiring (a subprocess each), the
Snakemake workflow's preflight, and the write policy itself (a failed attempt keeps the earlier run)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import cli, fsutil
from engine.errors import OutputError
from engine.run import launcher, rundir
from tests.conftest import ROOT
from tests.support.bad_input_world import Case, build, check, read_only_dir, snapshot
from tests.support.workflow import workflow_copy

torch = pytest.importorskip("torch")

W = "{W}"
FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _checkpoint(root: Path, world_size: int = 1, tensors: object = None) -> Path:
    actor = root / "global_step_1" / "actor"
    (actor / "huggingface").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world_size}))
    state = {"model.embed.weight": torch.arange(8.0).reshape(2, 4)} if tensors is None else tensors
    torch.save(state, actor / f"model_world_size_{world_size}_rank_0.pt")
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5"}
    (actor / "huggingface" / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = build(tmp_path_factory.mktemp("world") / "w")
    (root / "empty").mkdir()
    good = _checkpoint(root / "ckpt")
    actor = "global_step_1/actor"
    for name, change in {
        "config_json": (f"{actor}/fsdp_config.json", b"{"),
        "config_list": (f"{actor}/fsdp_config.json", b"[]"),
        "config_empty": (f"{actor}/fsdp_config.json", b"{}"),
        "config_str": (f"{actor}/fsdp_config.json", b'{"world_size": "1"}'),
        "config_two": (f"{actor}/fsdp_config.json", b'{"world_size": 2}'),
        "truncated": (f"{actor}/model_world_size_1_rank_0.pt", None),
        "tracker": ("latest_checkpointed_iteration.txt", b"7"),
        "tracker_latin1": ("latest_checkpointed_iteration.txt", b"\xff"),
        "hf_json": (f"{actor}/huggingface/config.json", b"{"),
        "hf_list": (f"{actor}/huggingface/config.json", b"[1]"),
        "hf_model": (f"{actor}/huggingface/config.json", b'{"model_type": "no-such-model"}'),
    }.items():
        copy = shutil.copytree(good, root / name)
        path, data = change
        target = copy / path
        target.write_bytes(data if data is not None else target.read_bytes()[:100])
    (root / "hf_missing").mkdir()
    shutil.copytree(good, root / "hf_missing", dirs_exist_ok=True)
    shutil.rmtree(root / "hf_missing" / actor / "huggingface")
    _checkpoint(root / "not_dict", tensors=[1, 2])
    (root / "bad_record.json").write_text("{")
    return root


def _export(source: str, *extra: str, out: str = f"{W}/exported") -> list[str]:
    return ["export", f"{W}/{source}", "--out", out, *extra]


EXPORT_CASES = [
    Case("exp-out-exists", _export("ckpt", out=f"{W}/empty"), 3, "already exists"),
    Case("exp-out-full", _export("ckpt", out=f"{W}/foreign"), 3, "not empty"),
    Case("exp-out-file", _export("ckpt", out=f"{W}/a_file"), 3, "not a directory"),
    Case("exp-out-under", _export("ckpt", out=f"{W}/a_file/x"), 3, "is a file"),
    Case("exp-out-ro", _export("ckpt", out="{RO}/x"), 3, "read-only"),
    Case("exp-missing", _export("nope"), 2, "is not a directory"),
    Case("exp-no-config", _export("foreign"), 2, "no fsdp_config.json"),
    Case("exp-config-json", _export("config_json"), 2, "not valid JSON"),
    Case("exp-config-list", _export("config_list"), 2, "got list"),
    Case("exp-config-empty", _export("config_empty"), 2, "world_size 0"),
    Case("exp-config-str", _export("config_str"), 2, "not an integer"),
    Case("exp-rank-missing", _export("config_two"), 2, "rank files missing for ranks [0, 1]"),
    Case("exp-truncated", _export("truncated"), 2, "cannot be loaded"),
    Case("exp-not-dict", _export("not_dict"), 2, "not a state dict"),
    Case("exp-tracker", _export("tracker"), 2, "names step 7"),
    Case("exp-tracker-latin1", _export("tracker_latin1"), 2, "not UTF-8"),
    Case("exp-hf-missing", _export("hf_missing"), 2, "config.json missing"),
    Case("exp-hf-json", _export("hf_json"), 2, "not valid JSON"),
    Case("exp-hf-list", _export("hf_list"), 2, "got list"),
    Case("exp-hf-model", _export("hf_model", "--method", "dtensor"), 2, "transformers cannot read it"),
    Case("exp-record-missing", _export("ckpt", "--record", f"{W}/nope.json"), 2, "no such file"),
    Case("exp-record-json", _export("ckpt", "--record", f"{W}/bad_record.json"), 2, "not valid JSON"),
    # the model card quotes the record: it must still verify, and be about this checkpoint
    Case(
        "exp-record-changed",
        _export("ckpt", "--record", f"{W}/tampered_run/provenance.json"),
        2,
        "1 file(s) it names changed since it was written (changed: recipe.yaml (run)",
    ),
    Case("exp-record-other", _export("ckpt", "--record", f"{W}/run/provenance.json"), 2, "does not name"),
    Case("exp-dtype-auto", _export("ckpt", "--dtype", "fp32"), 2, "writes bf16 only"),
    Case("exp-dtype-verl", _export("ckpt", "--method", "verl", "--dtype", "fp16"), 2, "writes bf16 only"),
    Case("exp-shard", _export("ckpt", "--shard-size", "2XB"), 2, "--shard-size"),
    Case("exp-shard-zero", _export("ckpt", "--shard-size", "0"), 2, "positive"),
    Case("exp-method", _export("ckpt", "--method", "magic"), 2, "invalid choice"),
]


@pytest.mark.parametrize("case", EXPORT_CASES, ids=lambda c: c.id)
def test_export_refuses_cleanly(case: Case, world: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    case.argv = [a.replace("{RO}", str(read_only_dir(world))) for a in case.argv]
    check(cli.main, case, world, capsys, monkeypatch)


# ---------------------------------------------------------------- corrupt bytes, generated
def _fuzz(world: Path, relpath: str, data: bytes, argv: list[str], capsys, monkeypatch, **env: str) -> None:  # type: ignore[no-untyped-def]
    target = world / "fuzz" / relpath
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    check(cli.main, Case("fuzz", argv, 2, "", env=env or None), world, capsys, monkeypatch)


@FUZZ
@given(cut=st.integers(0, 10_000))
def test_truncated_rank_file_is_one_line(cut: int, world: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    rank = world / "ckpt" / "global_step_1" / "actor" / "model_world_size_1_rank_0.pt"
    whole = rank.read_bytes()
    if not (world / "fuzz" / "ckpt").exists():
        shutil.copytree(world / "ckpt", world / "fuzz" / "ckpt")
    _fuzz(
        world,
        "ckpt/global_step_1/actor/model_world_size_1_rank_0.pt",
        whole[: cut % len(whole)],
        _export("fuzz/ckpt"),
        capsys,
        monkeypatch,
    )


@FUZZ
@given(data=st.binary(max_size=300))
def test_corrupt_fsdp_config_is_one_line(data: bytes, world: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    if not (world / "fuzz" / "ckpt2").exists():
        shutil.copytree(world / "ckpt", world / "fuzz" / "ckpt2")
    _fuzz(
        world, "ckpt2/global_step_1/actor/fsdp_config.json", data, _export("fuzz/ckpt2"), capsys, monkeypatch
    )


@FUZZ
@given(data=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode)))
def test_corrupt_record_is_one_line(data: bytes, world: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _fuzz(world, "record.json", data, ["provenance", "verify", f"{W}/fuzz/record.json"], capsys, monkeypatch)


@FUZZ
@given(data=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode)))
def test_corrupt_recipe_is_one_line(data: bytes, world: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _fuzz(world, "recipe.yaml", data, ["show", f"{W}/fuzz/recipe.yaml"], capsys, monkeypatch)


@FUZZ
@given(data=st.binary(max_size=300).filter(lambda b: b"==" not in b))  # a valid pin would download
def test_corrupt_lock_is_one_line(data: bytes, world: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    argv = ["wheelhouse", "build", "-r", f"{W}/fuzz/x.lock", "--out", f"{W}/wh"]
    _fuzz(world, "x.lock", data, argv, capsys, monkeypatch)


@FUZZ
@given(data=st.binary(max_size=300))
def test_corrupt_pins_file_is_one_line(data: bytes, world: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _fuzz(world, "pins.yaml", data, ["verify-env"], capsys, monkeypatch, ENGINE_PINS=f"{W}/fuzz/pins.yaml")


# ---------------------------------------------------------------- each entry point's own wiring
@pytest.mark.parametrize(
    ("module", "argv", "fragment"),
    [
        ("engine", ["show", "nope"], "unknown recipe"),
        ("engine", ["cluster", "wait", "--nodes", "1"], "RAY_ADDRESS is not set"),
        ("engine", ["wheelhouse", "verify", "/nonexistent/wheels"], "no such wheelhouse"),
        ("benchmarks.export", ["--world-size", "two"], "invalid int value"),
        ("containers.lock", ["--stack", "cpu"], "has no locks"),
        ("containers.build", ["gpu", "--dry-run", "--build-arg", "KEY"], "expected KEY=VALUE"),
        ("containers.resolve", ["--bogus"], "unrecognized arguments"),
    ],
)
def test_module_entry_points_print_one_line(module: str, argv: list[str], fragment: str) -> None:
    env = {k: v for k, v in __import__("os").environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-m", module, *argv], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and fragment in proc.stderr


def test_workflow_runs_preflight_before_any_job(tmp_path: Path) -> None:
    """At config parse time for `--config recipe=`, while the DAG is built for target rules."""
    cases = {
        "error: recipe tiny_cpu: preflight: parallel.ep=2": ["smoke_cpu", "--config", "sets=[parallel.ep=2]"],
        "error: recipe qwen35_27b: preflight: parallel.fsdp=3": [
            "run",
            "--config",
            "recipe=qwen35_27b",
            "sets=[parallel.fsdp=3]",
        ],
    }
    work = workflow_copy(tmp_path)
    snakemake = str(Path(sys.executable).parent / "snakemake")
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    procs = {
        fragment: subprocess.Popen(
            [snakemake, "-n", *args],
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for fragment, args in cases.items()
    }  # both at once: each is mostly Snakemake's start-up
    for fragment, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        errors = [line for line in (out + err).splitlines() if line.startswith("error:")]
        assert proc.returncode != 0 and len(errors) == 1 and errors[0].startswith(fragment), err[-2000:]
        assert "Traceback" not in err
    assert not list((work / "results").rglob("*"))  # no job ran, nothing was written


# ---------------------------------------------------------------- the write policy itself
def _run_dir(root: Path) -> Path:
    for name in rundir.FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"earlier {name}\n")
    return root


def _stage(out: Path, tag: str) -> Path:
    stage = out / f".attempt.{tag}.partial"
    stage.mkdir()
    for name in rundir.FILES:
        (stage / name).write_text(f"{tag} {name}\n")
    return stage


def test_an_attempt_that_trained_nothing_keeps_the_earlier_run(tmp_path: Path) -> None:
    out = _run_dir(tmp_path / "run")
    before = snapshot(out)
    where = launcher.publish_attempt(_stage(out, "idle"), out, moved=False)
    assert where == out / rundir.LAST_ATTEMPT
    assert {k: v for k, v in snapshot(out).items() if not k.startswith(rundir.LAST_ATTEMPT)} == before
    assert (where / "train.log").read_text() == "idle train.log\n"
    assert launcher.publish_attempt(_stage(out, "trained"), out, moved=True) == out  # replaces
    assert (out / "metrics.jsonl").read_text() == "trained metrics.jsonl\n"
    assert not list(out.glob(".attempt*"))
    (out / "run.json").unlink()  # Snakemake removes a job's output before it runs the job again
    assert launcher.publish_attempt(_stage(out, "resumed"), out, moved=False) == out / "last-attempt"
    assert (out / "run.json").read_text() == "resumed run.json\n"  # fills the gap, replaces nothing
    assert (out / "metrics.jsonl").read_text() == "trained metrics.jsonl\n"
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert launcher.publish_attempt(_stage(fresh, "first"), fresh, moved=False) == fresh
    assert sorted(p.name for p in fresh.iterdir()) == sorted(rundir.FILES)


def test_failed_writes_leave_the_old_artefact_and_no_temp(tmp_path: Path) -> None:
    target = fsutil.atomic_write(tmp_path / "a.json", "old")
    with pytest.raises(TypeError):
        fsutil.atomic_write(target, 3)  # type: ignore[arg-type]
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.json"]
    with pytest.raises(RuntimeError), fsutil.publish_dir(tmp_path / "d") as tmp:
        (tmp / "half").write_text("x")
        raise RuntimeError("interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]
    with pytest.raises(OutputError, match="not empty"):
        fsutil.check_out_dir(tmp_path)
    with pytest.raises(OutputError, match="read-only"):
        fsutil.check_out_file(read_only_dir(tmp_path) / "x.json")


def test_provenance_force_replaces_a_poorer_record(world: Path, tmp_path: Path) -> None:
    run = shutil.copytree(world / "run", tmp_path / "run")
    assert cli.main(["provenance", "write", str(run)]) == 3
    assert cli.main(["provenance", "write", str(run), "--force"]) == 0
    assert cli.main(["provenance", "verify", str(run)]) == 0


def test_sigterm_stops_the_tree_like_ctrl_c(tmp_path: Path) -> None:
    """Slurm's time limit sends SIGTERM: the attempt must end through the same path as Ctrl-C."""
    code = (
        "import os, sys; from pathlib import Path; from engine.run import launcher, watch\n"
        "p = Path(sys.argv[1])\n"
        "try:\n"
        "    with launcher.terminate_as_interrupt():\n"
        "        child = [sys.executable, '-c', 'import time; print(1, flush=True); time.sleep(60)']\n"
        "        watch.execute(child, dict(os.environ), p / 'train.log', p / 'm.jsonl', 1)\n"
        "except KeyboardInterrupt:\n"
        "    sys.exit(130)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT)
    log = tmp_path / "train.log"
    deadline = time.monotonic() + 60
    while not (log.exists() and log.read_text().strip()):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    proc.terminate()
    assert proc.wait(timeout=40) == 130
