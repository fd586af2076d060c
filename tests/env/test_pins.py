"""engine.env.pins and `python -m engine verify-env`: real metadata of this venv, real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from engine.env import pins
from tests.conftest import ROOT


def _verify(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k not in ("ENGINE_STACK", "ENGINE_PINS")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "engine", "verify-env", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=ROOT,
    )


def test_engine_version_pinned_matches_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert pins.load_pins()["engine"]["version"] == project["version"]


def test_cpu_stack_verifies_in_this_environment() -> None:
    result = _verify("--stack", "cpu")
    assert result.returncode == 0, result.stderr
    assert "torch" in result.stdout and "verl" in result.stdout


def test_gpu_stack_drifts_here_and_allow_drift_exits_zero() -> None:
    gpu = pins.load_pins()["stacks"]["gpu"]["packages"]
    strict = _verify("--stack", "gpu")
    assert strict.returncode == 1
    assert f"torch: pinned {gpu['torch']}, installed 2.13.0" in strict.stderr
    allowed = _verify("--stack", "gpu", "--allow-drift", "--json")
    assert allowed.returncode == 0
    record = json.loads(allowed.stdout)
    assert record["stack"] == "gpu" and not record["ok"]
    assert record["expected"]["vllm"] == str(gpu["vllm"]) and record["installed"]["vllm"] is None


def test_stack_defaults_to_image_env(tmp_path: Path) -> None:
    result = _verify(
        "--json", "--allow-drift", "--output", str(tmp_path / "rec.json"), env={"ENGINE_STACK": "gpu"}
    )
    assert json.loads(result.stdout)["stack"] == "gpu"
    assert json.loads((tmp_path / "rec.json").read_text())["stack"] == "gpu"


def test_bad_input_is_one_line_exit_2(tmp_path: Path) -> None:
    unknown = _verify("--stack", "tpu")
    assert unknown.returncode == 2 and unknown.stderr.strip().count("\n") == 0
    assert "unknown stack 'tpu'" in unknown.stderr
    bad = tmp_path / "pins.yaml"
    bad.write_text("engine: [unclosed\n")
    broken = _verify(env={"ENGINE_PINS": str(bad)})
    assert broken.returncode == 2 and "not valid YAML" in broken.stderr
    assert "Traceback" not in broken.stderr


def test_drift_compares_public_versions_and_flags_placeholders() -> None:
    data = pins.load_pins()
    installed = {k: None for k in pins.TRACKED} | {"engine": data["engine"]["version"]}
    installed.update(torch="2.13.0+cpu", verl="0.9.1", transformers="5.10.4", ray="2.60.0")
    installed.update(TransferQueue="0.1.11", **{"hydra-core": "1.3.8"})
    assert pins.drift("cpu", installed, data) == []
    installed["transformers"] = "5.11.0"
    assert pins.drift("cpu", installed, data) == ["transformers: pinned 5.10.4, installed 5.11.0"]
    gpu = pins.drift("gpu", installed, data)
    assert f"fsdp_turbo_commit: pinned {data['fsdp_turbo']['commit']}, not installed" in gpu
    assert f"vllm: pinned {data['stacks']['gpu']['packages']['vllm']}, not installed" in gpu


def test_every_pinned_package_is_looked_up_and_the_launch_env_names_the_extension() -> None:
    data = pins.load_pins()
    data["stacks"]["gpu"]["packages"]["PyYAML"] = "0.0.1"  # pinned, installed here, not in TRACKED
    gpu = pins.drift("gpu", pins=data, env={})
    assert any(line.startswith("PyYAML: pinned 0.0.1, installed ") for line in gpu)
    assert any(line.startswith("verl extension:") for line in gpu)
    named = {"VERL_USE_EXTERNAL_MODULES": "engine.runtime.kernels,engine.verl_ext"}
    assert not [line for line in pins.drift("gpu", pins=data, env=named) if "verl extension" in line]


def test_fsdp_turbo_commit_found_from_install_record(tmp_path: Path) -> None:
    commit = "89abcdef" * 5
    (tmp_path / "fsdp_turbo").mkdir()
    (tmp_path / "fsdp_turbo" / "__init__.py").write_text("")
    info = tmp_path / "fsdp_turbo-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fsdp-turbo\nVersion: 1.2.3\n")
    (info / "top_level.txt").write_text("fsdp_turbo\n")
    (info / "direct_url.json").write_text(
        json.dumps({"url": f"https://x/FSDPTurbo-{commit}.tar.gz", "archive_info": {}})
    )
    code = "import json; from engine.env import pins; print(json.dumps(pins.installed_versions()))"
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    found = json.loads(out.stdout)
    assert found["fsdp_turbo"] == "1.2.3" and found["fsdp_turbo_commit"] == commit


def test_pins_module_stays_light() -> None:
    code = (
        "import sys, engine.env.pins; print(sorted(m for m in ('torch', 'verl', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_every_image_pin_cites_what_validated_it() -> None:
    """Each pinned package and base image of an image stack names its source (verl metadata, an image...)."""
    loaded = pins.load_pins()
    for name, stack in loaded["stacks"].items():
        if stack.get("kind") != "image":
            continue
        cited = stack.get("validated_by", {})
        missing = sorted(set(stack["packages"]) - set(cited)) + (
            [] if "base_image" in cited else ["base_image"]
        )
        assert not missing, f"{name}: no validated_by entry for {missing}"
        assert all(isinstance(v, str) and len(v) > 10 for v in cited.values())


def test_one_stack_per_run_for_preflight_and_the_record(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.records import origin

    monkeypatch.delenv("ENGINE_STACK", raising=False)
    assert [pins.stack_for(d) for d in ("gpu", "npu", "cpu", None)] == ["gpu", "ascend-a3", "cpu", "cpu"]
    # a GPU run outside the image is judged by the GPU pins in its record too, not the CI venv's
    assert origin.versions("gpu")["drift"] == pins.drift("gpu") != pins.drift("cpu")
    monkeypatch.setenv("ENGINE_STACK", "ascend-a2")  # inside an image, the image's stack wins
    assert pins.stack_for("gpu") == "ascend-a2"
