"""Wheelhouse: pin parsing, byte-exact split/reassembly, and refusal of corrupt or missing parts."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from engine.env import wheelhouse
from engine.errors import UserError
from engine.hashing import sha256_file
from tests.conftest import ROOT


def test_parse_pins_reads_hashed_lock_and_refuses_ranges() -> None:
    lock = "foo-bar==1.2 \\\n    --hash=sha256:abc\n    # via x\nbaz[extra]==3.0 ; python_version>'3'\n"
    assert wheelhouse.parse_pins(lock) == {"foo-bar": "1.2", "baz": "3.0"}
    with pytest.raises(UserError, match="not an exact"):
        wheelhouse.parse_pins("foo>=1\n")
    with pytest.raises(UserError, match="pinned twice"):
        wheelhouse.parse_pins("foo==1\nFoo==2\n")


def _house(tmp_path: Path, size: int, max_bytes: int) -> Path:
    """A wheelhouse directory holding one real (zip) wheel of about `size` bytes, split at max_bytes."""
    house = tmp_path / "house"
    house.mkdir()
    wheel = house / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("demo/__init__.py", "VALUE = 42\n")
        zf.writestr("demo/blob.bin", bytes(range(256)) * (size // 256))
        zf.writestr("demo-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n")
        zf.writestr(
            "demo-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr("demo-1.0.dist-info/RECORD", "")
    entry = {"name": "demo", "version": "1.0", "file": wheel.name, "sha256": sha256_file(wheel)}
    entry["size"] = wheel.stat().st_size
    if entry["size"] > max_bytes:
        parts = wheelhouse.split_file(wheel, max_bytes)
        entry["parts"] = [{"file": p.name, "sha256": sha256_file(p)} for p in parts]
    (house / "manifest.json").write_text(json.dumps({"wheels": [entry]}))
    return house


def test_split_parts_reassemble_byte_exact(tmp_path: Path) -> None:
    house = _house(tmp_path, 300_000, 100_000)
    manifest = json.loads((house / "manifest.json").read_text())
    parts = manifest["wheels"][0]["parts"]
    assert len(parts) >= 3 and not (house / manifest["wheels"][0]["file"]).exists()
    out = tmp_path / "out"
    out.mkdir()
    (wheel,) = wheelhouse.assemble(house, manifest, out)
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() == manifest["wheels"][0]["sha256"]
    assert zipfile.ZipFile(wheel).read("demo/__init__.py") == b"VALUE = 42\n"


def test_missing_or_corrupt_part_stops_before_install(tmp_path: Path) -> None:
    house = _house(tmp_path, 300_000, 100_000)
    manifest = json.loads((house / "manifest.json").read_text())
    part = house / manifest["wheels"][0]["parts"][1]["file"]
    data = bytearray(part.read_bytes())
    data[10] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(UserError, match="sha256 mismatch"):
        wheelhouse.install(house, str(tmp_path / "site"), "python3")
    part.unlink()
    assert wheelhouse.missing(house, manifest) == [part.name]
    with pytest.raises(UserError, match="missing"):
        wheelhouse.install(house, str(tmp_path / "site"), "python3")
    assert not (tmp_path / "site").exists()


def test_install_offline_into_target(tmp_path: Path) -> None:
    import sys

    house = _house(tmp_path, 50_000, 20_000)
    target = tmp_path / "site"
    assert wheelhouse.install(house, str(target), sys.executable) == ["demo-1.0-py3-none-any.whl"]
    assert (target / "demo" / "__init__.py").read_text() == "VALUE = 42\n"


def test_cli_refuses_bad_input(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such wheelhouse"):
        wheelhouse.cli_main(["install", str(tmp_path / "absent")])
    with pytest.raises(UserError, match="exact NAME==VERSION"):
        wheelhouse.cli_main(["build", "--out", str(tmp_path / "w"), "foo>=1"])


def test_lock_hashes_only_and_version_aware_skip(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    lock.write_text(
        f"foo==1.0 \\\n    --hash=sha256:{'a' * 64} \\\n    --hash=sha256:{'b' * 64}\n    # via bar\n"
        f"bar==2.0 \\\n    --hash=sha256:{'c' * 64}\nbaz==3.0\n"
    )
    assert wheelhouse.lock_hashes(lock.read_text()) == {"foo": {"a" * 64, "b" * 64}, "bar": {"c" * 64}}
    only = tmp_path / "only.txt"
    only.write_text("# what the run imports\nfoo  # reason\nBar\n")
    assert wheelhouse.read_names(str(only)) == {"foo", "bar"}
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("foo==1.0+cu130\nbar==2.5\n-e git+https://x/y#egg=z\n")
    args = wheelhouse._parser().parse_args(["build", "--out", "o", "--skip-from", str(freeze)])
    skipped, differs = wheelhouse._skipped(args, {"foo": "1.0", "bar": "2.0", "baz": "3.0"})
    assert skipped == {"foo"} and differs == {"bar": "2.5"}  # another version is carried, not skipped
    bad = tmp_path / "bad.txt"
    bad.write_text("foo>=1\n")
    with pytest.raises(UserError, match="not a package name"):
        wheelhouse.read_names(str(bad))
    (tmp_path / "o2").write_text("qux\n")
    with pytest.raises(UserError, match="which the pins lack"):
        wheelhouse.cli_main(
            ["build", "--out", str(tmp_path / "w"), "-r", str(lock), "--only", str(bad.parent / "o2")]
        )


def test_install_runs_where_the_project_stack_is_absent(tmp_path: Path) -> None:
    """`python -m engine wheelhouse install` is the first command on a bare GPU machine: it must not
    import what the wheelhouse is about to bring (the machine's image has torch, PyYAML, rich and
    packaging, containers/targets/h200.freeze.txt, but not the recipe stack)."""
    import subprocess
    import sys

    house, target = _house(tmp_path, 50_000, 20_000), tmp_path / "s"
    absent = ["pydantic", "omegaconf", "hydra", "verl", "ray", "vllm", "snakemake"]
    image = (ROOT / "containers/targets/h200.freeze.txt").read_text().lower()
    assert not [name for name in absent if f"\n{name}==" in f"\n{image}"]
    code = (
        "import runpy, sys\n"
        f"for name in {absent!r}:\n    sys.modules[name] = None\n"
        f"sys.argv = ['engine', 'wheelhouse', 'install', {str(house)!r}, '--target', {str(target)!r}]\n"
        "runpy.run_module('engine', run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (target / "demo" / "__init__.py").exists()
