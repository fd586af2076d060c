"""`python -m engine wheelhouse`: carry a pinned Python stack to a machine that cannot reach an index.

`build` resolves nothing: it takes exact pins (a hashed lock, a requirements file or `NAME==VERSION`
arguments), downloads one wheel per pin for the *target* interpreter and platform, builds a wheel from the
sdist where a package publishes none (e.g. antlr4-python3-runtime), drops pins the target already has
(`--skip`, or `--skip-from` a `pip freeze` of it: skipped only where the target has the same version),
keeps only the names of `--only` files (what a run imports, with reasons), checks every downloaded wheel
against the lock's `--hash=sha256:` lines, and splits any file over `--max-part-mib` into byte-exact
parts, so a bundle fits size-limited transfers without leaving files out. `manifest.json` records each
wheel's sha256 and its parts. `install` reassembles and verifies every wheel before pip sees any of them,
then installs with `--no-index`: a missing or corrupted part stops the install before it starts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name
from rich.console import Console
from rich.progress import Progress

from engine import fsutil
from engine.env.pins import public_version
from engine.errors import ArgumentParser, OutputError, UserError
from engine.hashing import sha256_file

MANIFEST = "manifest.json"
MIB = 1024 * 1024
# The GPU image's platform: its CUDA 13 base is Ubuntu 24.04 (glibc 2.39), and some pins ship only
# newer manylinux tags (llguidance 1.7.6: manylinux_2_31). Older targets pass --platform.
DEFAULT_PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(39, 16, -1)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;\\]+)")
HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")
console = Console(stderr=True, highlight=False)


def parse_pins(text: str, source: str = "<pins>") -> dict[str, str]:
    """`name==version` pins from a requirements/lock text (hashes, markers, comments, `via` lines ignored).

    Anything that is not an exact pin is refused: a wheelhouse must not depend on what an index says today.
    """
    pins: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith(("#", "--hash", "-")) or raw[:1].isspace():
            continue
        match = PIN.match(line)
        if not match:
            raise UserError(f"{source}:{number}: {line!r} is not an exact NAME==VERSION pin; pin it")
        name, version = canonicalize_name(match.group(1)), match.group(3)
        if pins.get(name, version) != version:
            raise UserError(f"{source}:{number}: {name} pinned twice ({pins[name]} and {version}); keep one")
        pins[name] = version
    return pins


def lock_hashes(text: str) -> dict[str, set[str]]:
    """name -> the sha256 values a hashed lock allows for its pinned files (one per wheel or sdist)."""
    hashes: dict[str, set[str]] = {}
    current = None
    for raw in text.splitlines():
        match = PIN.match(raw.strip()) if not raw[:1].isspace() else None
        if match:
            current = canonicalize_name(match.group(1))
        elif not raw[:1].isspace():
            current = None
        if current:
            hashes.setdefault(current, set()).update(HASH.findall(raw))
    return {name: found for name, found in hashes.items() if found}


def read_names(path: str) -> set[str]:
    """Package names, one a line (`#` comments allowed): the `--only` selection."""
    names = set()
    for raw in fsutil.read_text(path, "--only", "list one package name a line").splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", line):
                raise UserError(f"--only {path}: {line!r} is not a package name; one name a line")
            names.add(canonicalize_name(line))
    return names


def split_file(path: Path, max_bytes: int) -> list[Path]:
    """Cut `path` into NAME.part000, NAME.part001, ... of at most max_bytes each; remove the original."""
    parts: list[Path] = []
    with path.open("rb") as handle:
        while block := handle.read(max_bytes):
            part = path.with_name(f"{path.name}.part{len(parts):03d}")
            part.write_bytes(block)
            parts.append(part)
    path.unlink()
    return parts


def _pip(python: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-m", "pip", *args], capture_output=True, text=True)


def _fetch_one(name: str, version: str, dest: Path, args: argparse.Namespace) -> tuple[Path, bool]:
    """One wheel for the target (and whether it was built from the sdist, when the index has no wheel)."""
    before = set(dest.iterdir())
    target = ["--python-version", args.python_version, "--implementation", "cp", "--abi", args.abi]
    for platform in args.platform or DEFAULT_PLATFORMS:
        target += ["--platform", platform]
    spec = f"{name}=={version}"
    got = _pip(
        args.pip_python, "download", "-q", "--no-deps", "--only-binary=:all:", *target, "-d", str(dest), spec
    )
    built_here = got.returncode != 0
    if built_here:
        with tempfile.TemporaryDirectory() as tmp:
            sdist = _pip(args.pip_python, "download", "-q", "--no-deps", "--no-binary=:all:", "-d", tmp, spec)
            built = sdist.returncode == 0 and _pip(
                args.pip_python, "wheel", "-q", "--no-deps", "-w", str(dest), *Path(tmp).iterdir()
            )
            if not built or built.returncode != 0:
                detail = (got.stderr or "").strip().splitlines()[-1:] or ["no detail"]
                raise UserError(f"{spec}: no wheel for the target and no buildable sdist ({detail[0]})")
    new = sorted(set(dest.iterdir()) - before)
    wheels = [path for path in new if path.name.endswith(".whl")]
    if len(wheels) != 1:
        raise UserError(f"{spec}: expected one wheel, got {[p.name for p in new]}")
    if not _pure(wheels[0].name) and "linux" not in wheels[0].name:
        raise UserError(f"{spec}: built {wheels[0].name}, which is not for Linux; build it on the target")
    return wheels[0], built_here


def _pure(filename: str) -> bool:
    return filename.endswith("-none-any.whl")


def _skipped(args: argparse.Namespace, pins: dict[str, str]) -> tuple[set[str], dict[str, str]]:
    """(names to leave out, name -> the other version the target has, carried anyway).

    A `pip freeze` line skips a pin only at the same public version (torch 2.11.0+cu130 is 2.11.0):
    the target's transformers 5.17.0 does not stand in for a pinned 5.9.0.
    """
    names = {canonicalize_name(name) for name in args.skip}
    differs: dict[str, str] = {}
    for path in args.skip_from:
        for name, version in _freeze(Path(path)).items():
            if name in pins and public_version(version) == public_version(pins[name]):
                names.add(name)
            elif name in pins:
                differs[name] = version
    return names, {n: v for n, v in differs.items() if n not in names}


def _freeze(path: Path) -> dict[str, str]:
    """`pip freeze` / `pip list --format=freeze` output; editable and URL lines are not versions."""
    text = fsutil.read_text(path, "--skip-from", "save `pip freeze` of the target there")
    found = {}
    for raw in text.splitlines():
        match = PIN.match(raw.strip())
        if match:
            found[canonicalize_name(match.group(1))] = match.group(3)
    return found


def build(args: argparse.Namespace) -> dict[str, Any]:
    """Download/build each pinned wheel into a fresh directory, split oversize ones, write the manifest."""
    pins: dict[str, str] = {}
    hashes: dict[str, set[str]] = {}
    for path in args.requirements:
        text = fsutil.read_text(path, "--requirements", "pass a lock or requirements file")
        pins |= parse_pins(text, str(path))
        hashes |= lock_hashes(text)
    pins |= parse_pins("\n".join(args.pins), "argv")
    if args.only:
        only = set().union(*(read_names(path) for path in args.only))
        unknown = sorted(only - set(pins))
        if unknown:
            raise UserError(f"--only names {', '.join(unknown)}, which the pins lack; pin them or drop them")
        pins = {name: version for name, version in pins.items() if name in only}
    skipped, differs = _skipped(args, pins)
    wanted = {name: version for name, version in sorted(pins.items()) if name not in skipped}
    if not wanted:
        raise UserError("nothing to put in the wheelhouse: give --requirements or NAME==VERSION pins")
    out = Path(args.out)
    tar = out.name.endswith(".tar")
    final_dir = out.with_name(out.name[: -len(".tar")]) if tar else out
    final_dir = fsutil.check_out_dir(final_dir)  # a tar is packed from a fresh directory beside it
    if tar:
        out = fsutil.check_out_file(out)
        if final_dir.exists():
            raise OutputError(f"--out {out}: {final_dir} exists, and the tar is packed from there; move it")
    max_bytes = int(args.max_part_mib * MIB)
    entries: list[dict[str, Any]] = []
    with fsutil.publish_dir(final_dir) as work:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("wheels", total=len(wanted))
            for name, version in wanted.items():
                progress.update(task, description=f"{name}=={version}")
                wheel, built_here = _fetch_one(name, version, work, args)
                entry: dict[str, Any] = {
                    "name": name,
                    "version": version,
                    "file": wheel.name,
                    "sha256": sha256_file(wheel),
                    "size": wheel.stat().st_size,
                }
                if built_here:
                    entry["built_from_sdist"] = True
                elif name in hashes and entry["sha256"] not in hashes[name]:
                    raise UserError(f"{wheel.name}: sha256 {entry['sha256']} is not one the lock allows")
                if name in differs:
                    entry["target_has"] = differs[name]
                if entry["size"] > max_bytes:
                    parts = split_file(wheel, max_bytes)
                    entry["parts"] = [{"file": p.name, "sha256": sha256_file(p)} for p in parts]
                entries.append(entry)
                progress.advance(task)
        manifest = {
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "python_version": args.python_version,
            "abi": args.abi,
            "platforms": args.platform or DEFAULT_PLATFORMS,
            "max_part_bytes": max_bytes,
            "skipped": sorted(skipped & set(pins)),
            "wheels": entries,
        }
        (work / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    if tar:
        with fsutil.atomic_path(out) as tmp_tar, tarfile.open(tmp_tar, "w") as handle:
            handle.add(final_dir, arcname=final_dir.name)
        shutil.rmtree(final_dir)  # made above by this invocation
    return manifest


def load_manifest(source: Path) -> tuple[Path, dict[str, Any]]:
    """The wheelhouse directory (a tar is unpacked beside a temp dir) and its manifest."""
    if source.is_file() and tarfile.is_tarfile(source):
        unpacked = Path(tempfile.mkdtemp(prefix="wheelhouse."))
        try:
            with tarfile.open(source) as tar:
                tar.extractall(unpacked, filter="data")
        except (tarfile.TarError, EOFError) as err:
            raise UserError(f"{source}: damaged tar ({err}); copy the wheelhouse again") from None
        found = list(unpacked.glob(f"*/{MANIFEST}")) + list(unpacked.glob(MANIFEST))
        if not found:
            raise UserError(f"{source}: tar holds no {MANIFEST}; build it with `wheelhouse build`")
        source = found[0].parent
    manifest_path = source / MANIFEST
    if not manifest_path.is_file():
        raise UserError(f"{source}: no {MANIFEST}; pass a directory or tar made by `wheelhouse build`")
    fix = "rebuild the wheelhouse with `wheelhouse build`"
    manifest = fsutil.read_json(manifest_path, "manifest", fix)
    wheels = manifest.get("wheels")
    fields_ok = isinstance(wheels, list) and all(
        isinstance(w, dict)
        and all(isinstance(w.get(k), str) for k in ("name", "file", "sha256"))
        and all(isinstance(p, dict) and isinstance(p.get("file"), str) for p in w.get("parts") or [])
        for w in wheels
    )
    if not fields_ok:
        raise UserError(f"manifest {manifest_path}: 'wheels' is not a list of {{name, file, sha256}}; {fix}")
    return source, manifest


def missing(source: Path, manifest: dict[str, Any]) -> list[str]:
    """Files the manifest names that are not in the directory (e.g. a part not yet transferred)."""
    names = [p["file"] for w in manifest["wheels"] for p in w.get("parts", [])]
    names += [w["file"] for w in manifest["wheels"] if not w.get("parts")]
    return [name for name in names if not (source / name).is_file()]


def assemble(source: Path, manifest: dict[str, Any], dest: Path) -> list[Path]:
    """Every wheel, whole and sha256-verified, in dest; UserError naming the first bad or missing file."""
    absent = missing(source, manifest)
    if absent:
        raise UserError(f"{source}: {len(absent)} file(s) missing, e.g. {absent[0]}; copy them in first")
    wheels = []
    for entry in manifest["wheels"]:
        target = dest / entry["file"]
        if entry.get("parts"):
            with target.open("wb") as handle:
                for part in entry["parts"]:
                    data = (source / part["file"]).read_bytes()
                    if hashlib.sha256(data).hexdigest() != part["sha256"]:
                        raise UserError(f"{source / part['file']}: sha256 mismatch; copy that part again")
                    handle.write(data)
        else:
            shutil.copyfile(source / entry["file"], target)
        if sha256_file(target) != entry["sha256"]:
            raise UserError(f"{entry['file']}: sha256 mismatch after assembly; copy the wheelhouse again")
        wheels.append(target)
    return wheels


def install(source: Path, target: str | None, python: str, dry_run: bool = False) -> list[str]:
    """Assemble, verify and `pip install --no-index --no-deps` the whole set (into --target if given)."""
    source, manifest = load_manifest(source)
    with tempfile.TemporaryDirectory(prefix="wheelhouse-install.") as tmp:
        wheels = assemble(source, manifest, Path(tmp))
        cmd = [python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-cache-dir", "--upgrade", "-q"]
        if target:
            cmd += ["--target", target]
        cmd += [str(w) for w in wheels]
        if dry_run:
            return [w.name for w in wheels]
        console.print(f"installing {len(wheels)} wheel(s){' into ' + target if target else ''}")
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise UserError(f"pip install from {source} failed: {last}")
    return [w.name for w in wheels]


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m engine wheelhouse", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    b = sub.add_parser("build", help="download/build pinned wheels for a target, split oversize ones")
    b.add_argument("pins", nargs="*", help="extra NAME==VERSION pins")
    b.add_argument("-r", "--requirements", action="append", default=[], help="lock/requirements file")
    b.add_argument("--out", required=True, help="new directory, or NAME.tar for one tar file")
    b.add_argument("--python-version", default="3.12", help="target interpreter, e.g. 3.12")
    b.add_argument("--abi", default=None, help="target ABI tag (default cpXY from --python-version)")
    b.add_argument("--platform", action="append", help="target platform tag (repeatable; default manylinux)")
    b.add_argument("--skip", action="append", default=[], help="package the target already has (repeatable)")
    b.add_argument(
        "--skip-from", action="append", default=[], help="`pip freeze` of the target: skip same versions"
    )
    b.add_argument("--only", action="append", default=[], help="file of names (one a line) to take from pins")
    b.add_argument("--max-part-mib", type=float, default=60.0, help="split files larger than this")
    b.add_argument("--pip-python", default=sys.executable, help="interpreter whose pip downloads/builds")
    i = sub.add_parser("install", help="verify, reassemble and install a wheelhouse offline")
    i.add_argument("source", type=Path, help="wheelhouse directory or tar")
    i.add_argument("--target", help="install into this directory (then put it on PYTHONPATH)")
    i.add_argument("--python", default=sys.executable, help="interpreter to install for")
    i.add_argument("--dry-run", action="store_true", help="verify and list, install nothing")
    v = sub.add_parser("verify", help="report missing or corrupt parts without installing")
    v.add_argument("source", type=Path)
    return parser


def cli_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.action == "build":
        if args.max_part_mib <= 0:
            raise UserError("--max-part-mib must be positive, e.g. 60")
        if not re.fullmatch(r"3\.\d+", args.python_version):
            raise UserError(f"--python-version {args.python_version!r}: give MAJOR.MINOR, e.g. 3.12")
        args.abi = args.abi or "cp" + args.python_version.replace(".", "")
        manifest = build(args)
        split = sum(1 for w in manifest["wheels"] if w.get("parts"))
        size = sum(w["size"] for w in manifest["wheels"]) / MIB
        print(f"wheelhouse {args.out}: {len(manifest['wheels'])} wheels, {size:.1f} MiB, {split} split")
        return 0
    if not args.source.exists():
        raise UserError(f"{args.source}: no such wheelhouse; pass the directory or tar `build` wrote")
    if args.action == "verify":
        source, manifest = load_manifest(args.source)
        with tempfile.TemporaryDirectory() as tmp:
            assemble(source, manifest, Path(tmp))
        print(f"wheelhouse {args.source}: {len(manifest['wheels'])} wheels complete and verified")
        return 0
    names = install(args.source, args.target, args.python, args.dry_run)
    print(f"{'verified' if args.dry_run else 'installed'} {len(names)} wheel(s) from {args.source}")
    return 0
