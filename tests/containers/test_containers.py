"""Images: hadolint, pins <-> Dockerfiles <-> locks, conflicts = overrides, lock drift, a real build."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser
from packaging.utils import canonicalize_name

from containers import build, lock
from engine.env.pins import is_unresolved, load_pins
from tests.conftest import ROOT

PINS = load_pins(ROOT / "containers" / "pins.yaml")
IMAGE_STACKS = [name for name, s in PINS["stacks"].items() if s.get("kind") == "image"]
DOCKERFILES = sorted({PINS["stacks"][s]["dockerfile"] for s in IMAGE_STACKS})
OPTIONAL_ARGS = {"PIP_CERT"}  # only the local build passes it (host CA bundle for the index)


def _parse(path: str) -> DockerfileParser:
    return DockerfileParser(fileobj=io.BytesIO((ROOT / path).read_bytes()))


def _declared_args(path: str) -> set[str]:
    return {i["value"].split("=", 1)[0] for i in _parse(path).structure if i["instruction"] == "ARG"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint_clean(dockerfile: str) -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or "hadolint"
    result = subprocess.run(
        [hadolint, "--config", "containers/.hadolint.yaml", dockerfile],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("stack", IMAGE_STACKS)
def test_build_args_match_dockerfile(stack: str) -> None:
    """Every ARG the Dockerfile reads is derived from the pins, and nothing the pins give goes unused."""
    dockerfile = PINS["stacks"][stack]["dockerfile"]
    args = build.build_args(stack, PINS, revision="0" * 40)
    assert _declared_args(dockerfile) - OPTIONAL_ARGS == set(args)
    base = PINS["stacks"][stack]["base_image"]
    assert args["BASE_IMAGE"] == f"{base['name']}@{base['digest']}"
    assert is_unresolved(base["digest"]) or re.fullmatch(r"sha256:[0-9a-f]{64}", base["digest"])


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_has_no_floating_reference(dockerfile: str) -> None:
    parsed = _parse(dockerfile)
    stages = [i["value"] for i in parsed.structure if i["instruction"] == "FROM"]
    assert stages[0].startswith("${BASE_IMAGE}")
    assert all(s.split()[0] in ("${BASE_IMAGE}", "os", "cann") for s in stages)
    text = (ROOT / dockerfile).read_text()
    assert ":latest" not in text and "git clone" not in text
    for line in re.findall(r"pip install[^\n]*", text):
        assert "--no-deps" in line and (
            "--require-hashes" in line or "#sha256=" in line or "/src/engine" in line
        )
    labels = parsed.labels
    for key in ("version", "revision", "created", "source", "base.name", "base.digest"):
        assert f"org.opencontainers.image.{key}" in labels
    for key in ("torch", "vllm", "transformers", "verl", "fsdp-turbo", "engine", "flash-linear-attention"):
        assert f"io.qwen35-grpo.pins.{key}" in labels
    assert "USER 10001:10001" in text and str(PINS["image"]["uid"]) == "10001"
    assert "VERL_USE_EXTERNAL_MODULES=" + PINS["engine"]["verl_extension_module"] in text


@pytest.mark.parametrize("stack", IMAGE_STACKS)
def test_locks_agree_with_pins(stack: str) -> None:
    section = PINS["stacks"][stack]
    sources = section.get("source_builds", {})
    for entry in section["locks"]:
        path = ROOT / entry["path"]
        if entry["status"] != "resolved":
            assert not path.exists() and entry.get("why")
            continue
        locked = lock.parse_lock(path.read_text())
        for name, version in section["packages"].items():
            if name in sources:
                assert str(canonicalize_name(name)) not in locked
            else:
                assert locked[str(canonicalize_name(name))] == str(version), name
        reqs, overrides = lock.lock_inputs(stack, PINS)
        family = lock.family(stack)
        assert (path.parent / f"{family}.in").read_text().splitlines()[1:] == reqs
        assert (path.parent / f"{family}.overrides.txt").read_text().splitlines()[1:] == overrides
        blocks = lock.lock_blocks(path.read_text())
        for name, block in lock.lock_blocks(lock.build_lock_path(path).read_text()).items():
            assert blocks[name] == block
        assert all("--hash=sha256:" in b for b in blocks.values())
        for name, kind in sources.items():
            if kind == "pypi-sdist":
                src = lock.parse_lock(lock.sources_lock_path(path).read_text())
                assert src[str(canonicalize_name(name))] == str(section["packages"][name])


@pytest.mark.parametrize("stack", ["gpu", "ascend-a2"])
def test_only_conflicts_are_recorded_overrides(stack: str) -> None:
    section = PINS["stacks"][stack]
    recorded = sorted(o["conflicts"] for o in section["overrides"] if o["conflicts"])
    for entry in section["locks"]:
        if entry["status"] != "resolved":
            continue
        path = ROOT / entry["path"]
        snapshot = json.loads(lock.metadata_path(path).read_text())
        assert set(snapshot) == set(lock.parse_lock(path.read_text()))
        top, _ = lock.lock_inputs(stack, PINS)
        found = lock.conflicts(path.read_text(), snapshot, top, entry["python"], entry["python_platform"])
        assert [re.sub(r" \(locked .*\)$", "", c) for c in found] == recorded


def test_release_build_refuses_placeholders() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "containers.build", "ascend-a2", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "fsdp_turbo.sha256" in result.stderr and "base_image.digest" in result.stderr
    dry = subprocess.run(
        [sys.executable, "-m", "containers.build", "gpu", "--dry-run", "--allow-unresolved"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert dry.returncode == 0 and "--provenance=mode=max" in dry.stdout and "--sbom=true" in dry.stdout


@pytest.mark.parametrize("stack", IMAGE_STACKS)
def test_lock_entries_are_well_formed(stack: str) -> None:
    """Each package once, pinned exactly, every file hash a sha256 digest (what --require-hashes needs)."""
    for entry in PINS["stacks"][stack]["locks"]:
        if entry["status"] != "resolved":
            continue
        text = (ROOT / entry["path"]).read_text()
        names = [
            lock._LOCK_LINE.match(line).group(1) for line in text.splitlines() if lock._LOCK_LINE.match(line)
        ]
        assert len(names) == len({str(canonicalize_name(n)) for n in names}), "a package is locked twice"
        for name, block in lock.lock_blocks(text).items():
            hashes = re.findall(r"--hash=(\S+)", block)
            assert hashes and all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), name


def test_sbom_lists_every_locked_package_with_its_hashes(tmp_path: Path) -> None:
    """The image's CycloneDX SBOM (containers/build.py, after a build) from the GPU lock: each locked
    package at its locked version, with the lock's file hashes."""
    entry = next(e for e in PINS["stacks"]["gpu"]["locks"] if e["status"] == "resolved")
    text = (ROOT / entry["path"]).read_text()
    sbom = json.loads(build.write_sbom(build.sbom_tool(), "gpu", entry["path"], tmp_path).read_text())
    assert sbom["bomFormat"] == "CycloneDX" and sbom["specVersion"] == "1.6"
    listed = {str(canonicalize_name(c["name"])): c["version"] for c in sbom["components"]}
    assert listed == lock.parse_lock(text)
    for component in sbom["components"]:
        name = str(canonicalize_name(component["name"]))
        hashes = {f"sha256:{h['content']}" for ref in component["externalReferences"] for h in ref["hashes"]}
        assert hashes == set(re.findall(r"--hash=(\S+)", lock.lock_blocks(text)[name])), name


def test_a_build_without_the_sbom_tool_is_refused_before_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build.shutil, "which", lambda *args, **kwargs: None)
    started = []
    monkeypatch.setattr(build.subprocess, "run", lambda *args, **kwargs: started.append(args))
    with pytest.raises(build.UserError, match=r"cyclonedx-py \(the image SBOM\) not found"):
        build.main(["gpu", "--allow-unresolved"])
    assert not started  # neither docker info nor a build ran


def test_the_sbom_tools_validation_stack_stays_out_of_the_project_environment() -> None:
    """cyclonedx-bom has its own environment (ci/bootstrap.sh): its validation extra brings rfc3987-syntax,
    which jsonschema imports and which builds a grammar at import, in every process that imports Ray."""
    for module in ("cyclonedx", "rfc3987_syntax"):
        assert importlib.util.find_spec(module) is None, f"{module} is in the project environment"


@pytest.mark.slow
def test_image_builds_and_runs_the_engine() -> None:
    if shutil.which("buildah") is None or shutil.which("podman") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(
                "CI=true but buildah/podman are missing: apt-get install buildah podman runc debootstrap"
            )
        pytest.skip("buildah/podman not installed (apt-get install buildah podman runc debootstrap)")
    from containers import localtest

    result = localtest.build_and_check()
    labels = result["labels"]
    assert labels["org.opencontainers.image.revision"] == "localtest"
    assert labels["io.qwen35-grpo.pins.vllm"] == PINS["stacks"]["gpu"]["packages"]["vllm"]
    assert labels["io.qwen35-grpo.pins.fsdp-turbo"] == localtest.STUB_COMMIT
    assert labels["org.opencontainers.image.licenses"] == PINS["image"]["licenses"]
    assert labels["io.qwen35-grpo.notice"].startswith("/opt/engine/NOTICE")
    assert result["user"] == "10001:10001" and result["id"].stdout.strip() == "10001"
    record = json.loads(result["verify_json"].stdout)
    assert result["verify_json"].returncode == 0 and record["stack"] == "gpu"
    assert record["installed"]["engine"] == PINS["engine"]["version"]
    assert record["installed"]["fsdp_turbo_commit"] == localtest.STUB_COMMIT
    assert record["verl_extension"] == {"module": "engine.verl_ext", "enabled": True, "importable": True}
    assert result["verify_strict"].returncode == 1 and result["entrypoint_strict"].returncode == 1
    assert result["entrypoint_warn"].returncode == 0
    assert result["render"].returncode == 0, result["render"].stderr
    assert "actor_rollout_ref.actor.strategy=fsdp_turbo" in result["render"].stdout
    assert result["import_turbo"].returncode == 0, result["import_turbo"].stderr
