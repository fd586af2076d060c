"""Run crates checked by rocrate-validator (offline, pinned contexts): every claimed profile at REQUIRED,
ro-crate-1.1 and workflow-run-crate-0.5 at RECOMMENDED, the Snakemake chain as a Provenance Run Crate."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from engine.errors import UserError
from engine.records import provenance, rocrate
from tests.support.rocrate_validation import WORKFLOW_FILE_ID_CHECK, check_all, claimed, validate
from tests.support.runs import fake_run, run_record


def _graph(run: Path) -> dict[str, dict]:
    return {n["@id"]: n for n in json.loads((run / "ro-crate-metadata.json").read_text())["@graph"]}


def _ids(value: dict | list) -> list[str]:
    return [v["@id"] for v in (value if isinstance(value, list) else [value])]


def fake_chain(root: Path) -> tuple[Path, Path, Path]:
    """results/<recipe>/{data,smoke,train,export} shaped like the Snakemake chain's, and a Snakefile."""
    chain = root / "results" / "tiny_cpu"
    chain.mkdir(parents=True)
    run = fake_run(chain).rename(chain / "train")
    data = chain / "data"
    data.mkdir()
    for name in ("train.parquet", "test.parquet"):
        (data / name).write_bytes(b"PAR1 " + name.encode())
    files = {"train.parquet": {"rows": 8}, "test.parquet": {"rows": 4}}
    (data / "manifest.json").write_text(json.dumps({"dataset": "synthetic", "files": files}))
    smoke = chain / "smoke"
    smoke.mkdir()
    times = {"start": "2025-01-01T00:00:00+00:00", "end": "2025-01-01T00:00:30+00:00"}
    (smoke / "run.json").write_text(run_record(**times, steps_done=1, last_step=1, target_steps=1))
    export = chain / "export"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"weights")
    report = {"step": "1", "method": "verl", "verification": {"structure": {"keys": 9, "dtype": "bfloat16"}}}
    (export / "export.json").write_text(json.dumps(report))
    (export / "SHA256SUMS").write_text(f"{hashlib.sha256(b'weights').hexdigest()}  model.safetensors\n")
    snakefile = root / "Snakefile"
    snakefile.write_text("rule all:\n    input: []\n")
    return run, export, snakefile


def test_run_crate_passes_the_validator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENGINE_PUBLISHER", raising=False)
    monkeypatch.delenv("ENGINE_PUBLISHER_URL", raising=False)
    run = fake_run(tmp_path)
    provenance.write(run)
    assert claimed(run) == [
        "process-run-crate-0.5",
        "ro-crate-1.1",
        "workflow-ro-crate-1.0",
        "workflow-run-crate-0.5",
    ]
    assert check_all(run, tmp_path / "cache") == {
        **{f"{p} REQUIRED": [] for p in claimed(run)},
        "ro-crate-1.1 RECOMMENDED": [],
        "workflow-run-crate-0.5 RECOMMENDED": [],
    }
    # the one RECOMMENDED check left out above fails on the main workflow file, and only there
    unskipped = validate(run, "workflow-run-crate-0.5", "RECOMMENDED", tmp_path / "cache")
    assert all(i.startswith(WORKFLOW_FILE_ID_CHECK) for i in unskipped), unskipped
    # reported per type: the main workflow is the only entity of these types
    assert sorted(i.split()[2] for i in unskipped) == [
        "http://schema.org/SoftwareSourceCode:",
        "https://bioschemas.org/ComputationalWorkflow:",
    ]
    graph = _graph(run)
    assert graph["./"]["mainEntity"] == {"@id": "launch.sh"}
    assert graph["./"]["publisher"] == {"@id": rocrate.project()["source"]}
    assert graph["#run"]["actionStatus"] == "http://schema.org/CompletedActionStatus"
    assert (run / "README.md").read_text().startswith("# Run record of tiny_cpu")


def test_validator_fails_a_broken_crate(tmp_path: Path) -> None:
    """The check can fail: the reporter's finding (root without description) is caught again."""
    run = fake_run(tmp_path)
    provenance.write(run)
    path = run / "ro-crate-metadata.json"
    crate = json.loads(path.read_text())
    for node in crate["@graph"]:
        if node["@id"] == "./":
            del node["description"]
    path.write_text(json.dumps(crate))
    issues = validate(run, "ro-crate-1.1", "REQUIRED", tmp_path / "cache")
    assert [i.split()[0] for i in issues] == ["ro-crate-1.1_8.2"], issues


def test_chain_is_a_provenance_run_crate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_AUTHOR", "A. Researcher")
    monkeypatch.setenv("ENGINE_PUBLISHER", "Example Lab")
    monkeypatch.setenv("ENGINE_PUBLISHER_URL", "https://lab.example.org/")
    run, export, snakefile = fake_chain(tmp_path)
    provenance.write(run, exports=[export], workflow=snakefile)
    assert "provenance-run-crate-0.5" in claimed(run)
    assert all(not issues for issues in check_all(run, tmp_path / "cache").values())
    graph = _graph(run)
    workflow = graph[graph["./"]["mainEntity"]["@id"]]
    assert workflow["@id"] == f"file://{snakefile}" and "HowTo" in workflow["@type"]
    steps = [graph[i] for i in _ids(workflow["step"])]
    assert [(s["name"], s["position"]) for s in steps] == [
        ("prepare_data", 1),
        ("smoke", 2),
        ("train", 3),
        ("export", 4),
    ]
    # one action per step, run by the step's engine command, under a ControlAction of the step
    organize = next(n for n in graph.values() if n["@type"] == "OrganizeAction")
    controls = [graph[i] for i in _ids(organize["object"])]
    actions = [graph[c["object"]["@id"]] for c in controls]
    assert [c["instrument"]["@id"] for c in controls] == [s["@id"] for s in steps]
    assert [graph[a["instrument"]["@id"]]["name"] for a in actions] == [
        "python -m engine prepare-data",
        "python -m engine run",
        "python -m engine run",
        "python -m engine export",
    ]
    assert actions[2]["@id"] == "#run" and all(a["endTime"] for a in actions)
    # inputs and outputs chain up: the export read the checkpoint the train step wrote
    assert set(_ids(actions[3]["object"])) <= set(_ids(actions[2]["result"]))
    assert f"file://{run.parent}/data/train.parquet" in _ids(actions[0]["result"])
    assert graph[organize["result"]["@id"]]["instrument"]["@id"] == workflow["@id"]
    assert graph["#agent"]["name"] == "A. Researcher"
    assert graph["./"]["publisher"] == {"@id": "https://lab.example.org/"}
    assert provenance.verify(run / "provenance.json") == []


def test_chain_without_its_steps_is_refused(tmp_path: Path) -> None:
    run, export, snakefile = fake_chain(tmp_path)
    (run.parent / "smoke" / "run.json").unlink()
    with pytest.raises(UserError, match=r"smoke/run.json is missing, so the chain's smoke step"):
        provenance.write(run, exports=[export], workflow=snakefile)
    assert not (run / "provenance.json").exists()


def test_chain_data_changed_since_prepared_is_refused(tmp_path: Path) -> None:
    """The data step's manifest.json holds each file's sha256 as prepare-data wrote it."""
    run, export, snakefile = fake_chain(tmp_path)
    manifest = run.parent / "data" / "manifest.json"
    files = {"train.parquet": {"rows": 8, "sha256": hashlib.sha256(b"other rows").hexdigest()}}
    manifest.write_text(json.dumps({"dataset": "synthetic", "files": files}))
    with pytest.raises(UserError, match=r"train.parquet: changed since written"):
        provenance.write(run, exports=[export], workflow=snakefile)
    assert not (run / "provenance.json").exists()


def test_publisher_needs_name_and_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_PUBLISHER", "Example Lab")
    monkeypatch.delenv("ENGINE_PUBLISHER_URL", raising=False)
    with pytest.raises(UserError, match="ENGINE_PUBLISHER and ENGINE_PUBLISHER_URL go together"):
        provenance.write(fake_run(tmp_path))
