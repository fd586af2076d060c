"""Provenance: secrets never reach disk, records round-trip through verify, RO-Crate shape, reruns."""

from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path

import pytest

from engine.errors import UserError
from engine.records import provenance, rerun
from engine.run import redact
from tests.conftest import Launch, Published, engine
from tests.support.runs import SECRETS, fake_run


def test_scrub_removes_planted_credentials_and_keeps_the_rest() -> None:
    text = (
        "push https://user:pa55word@host.example/repo.git token=ghp_ABCDEFGHIJKLMNOPQRSTUVWXYZ012345 "
        "Authorization: Bearer abcdefghijklmnop AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG "
        f"{SECRETS['MY_DB_PASSWORD']} lr=1e-3 step=2 https://huggingface.co/Qwen"
    )
    out = redact.scrub(text, env=SECRETS)
    for leaked in ("pa55word", "ghp_ABC", "abcdefghijklmnop", "wJalrXUtnFEMI", SECRETS["MY_DB_PASSWORD"]):
        assert leaked not in out
    assert "lr=1e-3 step=2 https://huggingface.co/Qwen" in out
    assert "https://***@host.example/repo.git" in out
    # settings whose names merely contain a secret word stay readable (recipe.yaml must still parse)
    settings = "max_num_batched_tokens: 8192\nTOKENIZERS_PARALLELISM=false\nmax_new_tokens=16"
    assert redact.scrub(settings, env=SECRETS) == settings
    assert redact.redact_env({"TOKENIZERS_PARALLELISM": "false"}) == {"TOKENIZERS_PARALLELISM": "false"}


def test_redact_env_keeps_only_the_allowlist_and_masks_credentials() -> None:
    env = SECRETS | {
        "RAY_ADDRESS": "https://alice:s3cr3tpw@ray.example.com:8265",
        "NCCL_DEBUG": "WARN",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "HOME": "/root",
        "PATH": "/bin",
    }
    kept = redact.redact_env(env)
    assert kept["NCCL_DEBUG"] == "WARN" and kept["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert "HOME" not in kept and "HF_TOKEN" not in kept and "WANDB_API_KEY" not in kept
    assert kept["NCCL_SOCKET_TOKEN"] == redact.REDACTED
    assert kept["RAY_ADDRESS"] == "https://***@ray.example.com:8265"


def test_the_hardware_is_the_machine_the_launch_recorded(tmp_path: Path) -> None:
    """A provenance record written on another machine (a login node) names the run's machine, as its
    run.json does; a run.json older than that field gets the writing machine's, host included."""
    run = fake_run(tmp_path)
    gpu = {"host": "gpu-node-7", "accelerator": "gpu", "count": 1, "devices": ["NVIDIA H100 80GB HBM3"]}
    written = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps(written | {"hardware": gpu}))
    assert json.loads(provenance.write(run).read_text())["hardware"] == gpu
    (run / "run.json").write_text(json.dumps(written))
    here = json.loads(provenance.write(run, force=True).read_text())["hardware"]
    assert here["host"] == socket.gethostname() and here["accelerator"] in ("cpu", "gpu", "npu")


def test_write_verify_and_tamper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    run = fake_run(tmp_path)
    export_dir = tmp_path / "export"
    export_dir.mkdir()
    (export_dir / "model.safetensors").write_bytes(b"weights")
    path = provenance.write(run, exports=[export_dir])
    record = json.loads(path.read_text())
    assert record["schema"] == provenance.SCHEMA
    assert record["git"]["commit"] and isinstance(record["git"]["dirty"], bool)
    assert record["overrides"] == ["algorithm.adv_estimator=grpo", "trainer.total_training_steps=2"]
    assert record["metrics"]["per_step"][1] == {
        "step": 2,
        "data": {"actor/pg_loss": 0.2, "critic/score/mean": 0.5},
    }
    roles = {e["role"] for e in record["outputs"]}
    assert roles == {"checkpoint", "export"}
    assert record["hardware"]["accelerator"] in ("cpu", "gpu", "npu")
    assert "torch" in json.dumps(record["versions"])
    on_disk = path.read_text() + (run / "ro-crate-metadata.json").read_text()
    for value in SECRETS.values():
        assert value not in on_disk
    assert provenance.verify(path) == []
    assert provenance.cli_main(["verify", str(run)]) == 0
    (run / "checkpoints" / "global_step_1" / "actor" / "model_world_size_1_rank_0.pt").write_bytes(
        b"tampered"
    )
    (export_dir / "model.safetensors").unlink()
    problems = provenance.verify(path)
    assert any(
        p.startswith("changed: checkpoints/global_step_1/actor/model_world_size_1_rank_0.pt")
        for p in problems
    )
    assert any(p.startswith("missing: ") and "model.safetensors" in p for p in problems)
    assert provenance.cli_main(["verify", str(path)]) == 1


def test_an_export_changed_since_it_was_written_is_not_recorded(tmp_path: Path) -> None:
    """The record would vouch for it (its card says verified): SHA256SUMS is what `engine export` wrote."""
    run = fake_run(tmp_path)
    export_dir = tmp_path / "export"
    export_dir.mkdir()
    (export_dir / "model.safetensors").write_bytes(b"weights")
    (export_dir / "SHA256SUMS").write_text(f"{hashlib.sha256(b'weights').hexdigest()}  model.safetensors\n")
    assert provenance.write(run, exports=[export_dir]).is_file()
    (run / "provenance.json").unlink()
    (export_dir / "model.safetensors").write_bytes(b"swapped")
    with pytest.raises(
        UserError, match=r"model.safetensors: changed since written \(the export's SHA256SUMS"
    ):
        provenance.write(run, exports=[export_dir])
    assert not (run / "provenance.json").exists()


def test_ro_crate_follows_the_workflow_run_profile(tmp_path: Path) -> None:
    run = fake_run(tmp_path)
    provenance.write(run)
    crate = json.loads((run / "ro-crate-metadata.json").read_text())
    graph = {node["@id"]: node for node in crate["@graph"]}
    assert graph["ro-crate-metadata.json"]["about"] == {"@id": "./"}
    root = graph["./"]
    assert {"@id": "https://w3id.org/ro/wfrun/workflow/0.5"} in root["conformsTo"]
    assert "ComputationalWorkflow" in graph[root["mainEntity"]["@id"]]["@type"]
    action = graph["#run"]
    assert action["@type"] == "CreateAction" and action["startTime"] and action["endTime"]
    assert action["actionStatus"] == "http://schema.org/CompletedActionStatus"
    refs = [
        r
        for key in ("object", "result")
        for r in ([action[key]] if isinstance(action[key], dict) else action[key])
    ]
    assert refs and all(ref["@id"] in graph for ref in refs)
    files = [n for n in crate["@graph"] if n.get("@type") == "File" and "sha256" in n]
    assert files and all(len(n["sha256"]) == 64 for n in files)
    assert len(graph) == len(crate["@graph"])  # no duplicate ids


def test_compare_metrics_detects_drift() -> None:
    old = [{"step": 1, "data": {"a": 1.0}}, {"step": 2, "data": {"a": 2.0}}]
    assert rerun.compare_metrics(old, old, ["a"], 1e-6) == []
    assert rerun.compare_metrics(old, old[:1], ["a"], 1e-6)[0].startswith("steps")
    drift = [{"step": 1, "data": {"a": 1.0}}, {"step": 2, "data": {"a": 2.1}}]
    assert rerun.compare_metrics(old, drift, ["a"], 1e-3) == ["step 2 a: 2.1 != recorded 2.0"]
    # a zero-mean loss of ~1e-8 is noise: only an absolute tolerance can compare it
    tiny_old, tiny_new = [{"step": 1, "data": {"a": -5.2e-8}}], [{"step": 1, "data": {"a": -8.2e-8}}]
    assert rerun.compare_metrics(tiny_old, tiny_new, ["a"], 1e-3, atol=1e-6) == []
    assert rerun.compare_metrics(tiny_old, tiny_new, ["a"], 1e-3) != []
    # a NaN or infinite metric reproduces nothing, whatever the tolerance (engine.bounds)
    for bad in (float("nan"), float("inf")):
        broken = [{"step": 1, "data": {"a": bad}}]
        assert rerun.compare_metrics(broken, broken, ["a"], 1.0, atol=1.0) == [
            f"step 1 a: {bad} != recorded {bad}"
        ]
        assert rerun.compare_metrics(tiny_old, broken, ["a"], 1.0, atol=1.0) != []


def test_rerun_verifies_the_record_before_it_launches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A record whose recipe was edited afterwards is not the recorded run: refused with what changed,
    unless --allow-changed, which hands the changes to `engine run` for its run.json."""
    run = fake_run(tmp_path)
    provenance.write(run)
    argv = [str(run), "--out", str(tmp_path / "again"), "--dry-run"]
    assert rerun.rerun_main(argv) == 0
    assert "--rerun-changed" not in capsys.readouterr().out
    recipe = run / "recipe.yaml"
    recipe.write_text(recipe.read_text().replace("total_training_steps: 2", "total_training_steps: 3"))
    (run / "metrics.jsonl").unlink()
    with pytest.raises(
        UserError, match=r"2 file\(s\) it names changed .*\(changed: recipe.yaml \(run\) .*missing"
    ):
        rerun.rerun_main(argv)
    assert rerun.rerun_main([*argv, "--allow-changed"]) == 0
    out, err = capsys.readouterr()
    assert f"--rerun-of {run / 'provenance.json'} --rerun-changed" in out
    assert "rerun: changed: recipe.yaml (run)" in err and "rerun: missing: metrics.jsonl (run)" in err
    assert not (tmp_path / "again").exists()


def test_bad_record_is_a_user_error(tmp_path: Path) -> None:
    (tmp_path / "provenance.json").write_text(json.dumps({"schema": "other"}))
    with pytest.raises(UserError, match="not a run record"):
        provenance.cli_main(["verify", str(tmp_path)])
    with pytest.raises(UserError, match="not found"):
        rerun.rerun_main([str(tmp_path / "nope.json"), "--out", str(tmp_path / "o")])


def _check_record_and_card(run: Path, export: Path, cache: Path) -> None:
    """A real run's crate passes rocrate-validator; the export's model card parses (huggingface_hub)."""
    from huggingface_hub import ModelCard

    from tests.support.rocrate_validation import check_all

    found = check_all(run, cache)
    assert len(found) == 6 and not any(found.values()), found
    card = ModelCard.load(export / "README.md")
    assert card.data.license == "apache-2.0" and "logits on a fixed" in card.text
    assert f"python -m engine provenance verify {run.resolve()}" in card.text


@pytest.mark.slow
def test_tiny_run_with_planted_secrets_leaves_none_on_disk_and_reruns(
    tiny_cpu_run: Launch, tiny_cpu_published: Published, tiny_cpu_rerun: Launch
) -> None:
    """A whole tiny CPU run (train, checkpoint, export, record, rerun) with credentials in its
    environment (the session's run, tests/conftest.py)."""
    run, export = tiny_cpu_run.out, tiny_cpu_published.export
    assert engine("provenance", "verify", str(run)).returncode == 0
    _check_record_and_card(run, export, run.parent / "validator-cache")
    assert tiny_cpu_rerun.proc.returncode == 0, tiny_cpu_rerun.why()
    assert "step metrics reproduced" in tiny_cpu_rerun.proc.stdout
    # the rerun verified the record, and its own run.json names it
    repeated = tiny_cpu_rerun.record["rerun"]
    assert repeated["record"] == str((run / "provenance.json").resolve()) and repeated["changed"] == []
    outputs = (tiny_cpu_run.proc, tiny_cpu_published.exported, tiny_cpu_published.wrote, tiny_cpu_rerun.proc)
    for out in outputs:
        for value in SECRETS.values():
            assert value not in out.stdout + out.stderr
    for path in [*run.parent.rglob("*"), *tiny_cpu_rerun.out.rglob("*")]:
        if path.is_file():
            data = path.read_bytes()
            for value in SECRETS.values():
                assert value.encode() not in data, f"{value[:6]}... found in {path}"
