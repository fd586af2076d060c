"""Shared by the bad-input suites: a directory of earlier results (a run with its record, a prepared
data set, a checkpoint, a wheelhouse, ...) and a runner that calls an entry point in-process and checks
the one-line error, the exit code and that every earlier artefact is byte-identical afterwards."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine import errors
from tests.conftest import ROOT
from tests.support.runs import run_record

Main = Callable[[list[str]], int]


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root -> sha256 of a regular file's bytes, a link's target, or its kind. Links
    are not followed, special files not read (a rootfs under results/ holds /dev/console: a read blocks)."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            found[rel] = f"link {os.readlink(path)}"
        elif path.is_dir():
            found[rel] = "dir"
        elif path.is_file():
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            found[rel] = "special"
    return found


def read_only_dir(root: Path) -> Path:
    """A directory this user cannot create files in (root ignores permission bits, sysfs it cannot)."""
    if os.geteuid() == 0:
        return Path("/sys/kernel")
    locked = root / "locked"
    locked.mkdir(exist_ok=True)
    locked.chmod(0o555)
    return locked


@dataclass
class Case:
    """One bad input: argv (with {W} for the world directory), exit code and a fragment of the message."""

    id: str
    argv: list[str]
    code: int
    fragment: str
    env: dict[str, str] | None = None
    prefix: str = "error: "


def check(
    main: Main,
    case: Case,
    world: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = [arg.replace("{W}", str(world)) for arg in case.argv]
    for key, value in (case.env or {}).items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value.replace("{W}", str(world)))
    before = snapshot(world)
    capsys.readouterr()
    code = errors.boundary(main, argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == case.code, f"exit {code} != {case.code}: {err}{out}"
    assert len(lines) == 1 and lines[0].startswith(case.prefix), f"not one line: {err!r}"
    assert case.fragment.replace("{W}", str(world)) in lines[0], lines[0]
    assert snapshot(world) == before, "an earlier artefact changed, or something was written"


def build(root: Path) -> Path:
    """The earlier results the suites try to damage."""
    from engine.recipes import loader
    from engine.records import provenance

    root.mkdir(parents=True, exist_ok=True)
    (root / "a_file").write_text("not a directory\n")
    foreign = root / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("someone else's\n")
    model = root / "model"  # tiny recipes see a model here, so no asset build starts
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    # a finished run and its record (one extra data input)
    run = root / "run"
    actor = run / "checkpoints" / "global_step_1" / "actor"
    actor.mkdir(parents=True)
    (actor / "model_world_size_1_rank_0.pt").write_bytes(b"weights")
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("1")
    from engine.data import prepare

    # prepared data with an unrelated file beside it, and a folder that looks half-written
    prepare.prepare("synthetic", root / "data", seed=0, sizes=(4, 2))
    (root / "data" / "README").write_text("mine\n")
    (root / "half_data").mkdir()
    (root / "half_data" / "train.parquet").write_bytes(b"PAR1 half")
    # the record's inputs are the world's own files: the checkout's results/ fills up while other
    # workers run, and a record that counted them would change under the tests
    world_inputs = [
        f"model.path={model}",
        f"data.train_files={root / 'data' / 'train.parquet'}",
        f"data.val_files={root / 'data' / 'test.parquet'}",
    ]
    resolved = loader.load("tiny_cpu", "cpu", world_inputs)
    (run / "recipe.yaml").write_text(loader.to_yaml(resolved))
    (run / "overrides.txt").write_text("trainer.total_training_steps=1\n")
    (run / "launch.sh").write_text("#!/usr/bin/env bash\n")
    (run / "train.log").write_text("step:1\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "data": {"actor/pg_loss": 0.5}}) + "\n")
    (run / "run.json").write_text(run_record(command=["python"], command_line="python"))
    extra = root / "extra.parquet"
    extra.write_bytes(b"extra input")
    provenance.write(run, data=[extra])
    # a recorded run whose recipe was edited after its record was written
    tampered = shutil.copytree(run, root / "tampered_run") / "recipe.yaml"
    edited = tampered.read_text().replace("save_freq: 2", "save_freq: 1")
    assert edited != tampered.read_text()
    tampered.write_text(edited)
    # a run directory whose run.json is damaged
    damaged = root / "damaged_run"
    damaged.mkdir()
    (damaged / "run.json").write_text("{not json")
    (damaged / "recipe.yaml").write_text("name: [unclosed\n")
    # bench's own directory from an earlier bench
    bench = root / "bench"
    for name in ("engine", "bare"):
        (bench / name).mkdir(parents=True)
        (bench / name / "metrics.jsonl").write_text("{}\n")
    (bench / "bench.json").write_text("{}\n")
    return root


def build_inputs(root: Path) -> Path:
    """Damaged inputs of every kind beside the earlier results: recipes, raw data, records, pins, locks,
    wheelhouses."""
    import yaml

    repo = ROOT
    recipes = root / "recipes"
    recipes.mkdir()
    (recipes / "dup.yaml").write_text("extends: qwen35_27b\nparallel: {fsdp: 8}\nparallel: {fsdp: 4}\n")
    (recipes / "latin1.yaml").write_bytes(b"description: caf\xe9\n")
    (recipes / "list.yaml").write_text("- a\n- b\n")
    (recipes / "broken.yaml").write_text("parallel: {fsdp: 8\n")
    (recipes / "cycle.yaml").write_text("extends: cycle.yaml\n")
    (recipes / "intkey.yaml").write_text("extends: qwen35_27b\n1: x\n")
    (recipes / "dir.yaml").mkdir()
    (root / "empty_recipes").mkdir()
    (root / "foreign_assets" / "tiny-qwen35").mkdir(parents=True)
    raw = root / "raw"
    for name, content in {
        "jsonl_as_parquet/train.parquet": b'{"question": "q"}\n',
        "jsonl_as_parquet/test.parquet": b'{"question": "q"}\n',
        "parquet_as_jsonl/train.jsonl": (root / "data" / "train.parquet").read_bytes(),
        "parquet_as_jsonl/test.jsonl": b"{}\n",
        "lists/train.jsonl": b"[1, 2]\n",
        "lists/test.jsonl": b"[1, 2]\n",
        "columns/train.jsonl": b'{"q": 1}\n',
        "columns/test.jsonl": b'{"q": 1}\n',
        "only_train/train.jsonl": b'{"question": "q", "answer": "#### 1"}\n',
    }.items():
        (raw / name).parent.mkdir(parents=True, exist_ok=True)
        (raw / name).write_bytes(content)
    records = root / "records"
    records.mkdir()
    record = json.loads((root / "run" / "provenance.json").read_text())
    for name, text in {
        "list.json": "[]",
        "empty.json": "{}",
        "broken.json": '{"schema": ',
        "inputs.json": json.dumps(record | {"inputs": {"a": 1}}),
        "entries.json": json.dumps(record | {"outputs": [{"path": "x", "role": "export"}]}),
        "norecipe.json": json.dumps({k: v for k, v in record.items() if k != "recipe"}),
        "provenance.json": json.dumps(record),  # valid, but no recipe.yaml beside it
    }.items():
        (records / name).write_text(text)
    (records / "latin1.json").write_bytes(b'{"schema": "caf\xe9"}')
    pdir = root / "pdir_run"
    shutil.copytree(root / "run", pdir, ignore=shutil.ignore_patterns("provenance.json"))
    (pdir / "provenance.json").mkdir()
    pins = root / "pins"
    pins.mkdir()
    (pins / "broken.yaml").write_text("engine: [unclosed\n")
    (pins / "dup.yaml").write_text("engine: {version: 1}\nstacks: {}\nengine: {version: 2}\n")
    (pins / "list.yaml").write_text("- 1\n")
    (pins / "latin1.yaml").write_bytes(b"engine: caf\xe9\n")
    locks = root / "locks"
    locks.mkdir()
    (locks / "latin1.lock").write_bytes(b"requests==2.0 \xff\n")
    real = yaml.safe_load((repo / "containers" / "pins.yaml").read_text())
    for stack in real["stacks"].values():
        for entry in stack.get("locks", []):
            entry["path"] = str(locks / "latin1.lock")  # the drift report would read this one
    (pins / "latin1_lock.yaml").write_text(yaml.safe_dump(real))
    holes = yaml.safe_load((repo / "containers" / "pins.yaml").read_text())
    del holes["stacks"]["cpu"]["packages"]  # verify-env ended in KeyError: 'packages'
    (pins / "no_packages.yaml").write_text(yaml.safe_dump(holes))
    del holes["engine"]["version"], holes["fsdp_turbo"]["commit"]
    (pins / "holes.yaml").write_text(yaml.safe_dump(holes))
    (locks / "range.lock").write_text("requests>=2\n")
    (locks / "twice.lock").write_text("requests==2.0\nrequests==2.1\n")
    wh = root / "wheelhouse"
    for name, manifest in {
        "missing_file": {"wheels": [{"name": "a", "file": "a-1-py3-none-any.whl", "sha256": "0" * 64}]},
        "keyless": {},
        "bad_parts": {"wheels": [{"name": "a", "file": "a.whl", "sha256": "0", "parts": [{"x": 1}]}]},
    }.items():
        (wh / name).mkdir(parents=True)
        (wh / name / "manifest.json").write_text(json.dumps(manifest))
    (wh / "not_json").mkdir()
    (wh / "not_json" / "manifest.json").write_text("{")
    (wh / "mismatch").mkdir()
    (wh / "mismatch" / "a.whl").write_bytes(b"wheel")
    entry = {"name": "a", "file": "a.whl", "sha256": "0" * 64}
    (wh / "mismatch" / "manifest.json").write_text(json.dumps({"wheels": [entry]}))
    (wh / "broken.tar").write_bytes(b"not a tar at all")
    (wh / "out.tar").write_bytes(b"earlier bundle")
    (root / "rows.jsonl").write_text('{"mode": "eager"}\n')
    return root
