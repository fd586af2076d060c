"""`python -m containers.lock`: hashed lock files per image and platform, produced from the pins.

Inputs come from two places only: the engine's dependencies (pyproject.toml, base + the extras named
in the pins) and the stack's pinned packages; the overrides file holds the stack's recorded overrides.
Both are written next to the locks so a reader sees exactly what was resolved. `--check` resolves again
into a scratch directory and explains any difference (a maintainer's drift report, containers/drift.py);
`--no-metadata` skips the Requires-Dist snapshot that the offline conflict check reads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from engine import paths
from engine.env.pins import load_pins, stack_pins
from engine.errors import ArgumentParser, UserError, entry
from engine.fsutil import atomic_write as _write
from engine.fsutil import read_text

ROOT = paths.SOURCE_ROOT  # the checkout (containers/ is tooling of the repository, not of the wheel)
LOCK_DIR = ROOT / "containers" / "locks"
_LOCK_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def pyproject_requirements(extras: list[str]) -> list[str]:
    """The engine's base dependencies plus the named extras, as written in pyproject.toml."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    return lines


def family(stack: str) -> str:
    """Stacks that share one Python environment share locks (A2 and A3 differ only below Python)."""
    return stack.split("-", 1)[0]


def lock_inputs(stack: str, pins: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(requirements, overrides) for a stack's lock."""
    section = pins["stacks"][stack]
    lines = [f"{name}=={version}" for name, version in section["packages"].items()]
    lines += pyproject_requirements(pins["engine"]["extras"])
    # the engine and FSDPTurbo are installed from source without build isolation: their build backend
    # must come from the lock too
    lines += ["setuptools", "wheel", *section.get("build_requirements", [])]
    overrides = [entry["requirement"] for entry in section.get("overrides", [])]
    return lines, overrides


def parse_lock(text: str) -> dict[str, str]:
    """name -> version of every package in a requirements-style lock."""
    found = {}
    for line in text.splitlines():
        match = _LOCK_LINE.match(line)
        if match:
            found[str(canonicalize_name(match.group(1)))] = match.group(2)
    return found


def uv_command(
    stack: str, lock: dict[str, Any], pins: dict[str, Any], in_path: str, ov_path: str, out: str
) -> list[str]:
    """The uv call that produces one lock (relative paths, so the lock's annotations are stable)."""
    resolver = pins["resolver"]
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv") or "uv"
    cmd = [
        uv, "pip", "compile", in_path, "--overrides", ov_path,
        "--python-platform", lock["python_platform"], "--python-version", lock["python"],
        "--generate-hashes", "--only-binary", ":all:", "--index-url", resolver["index_url"],
        "--exclude-newer", resolver["exclude_newer"], "--no-header", "--quiet", "-o", out,
    ]  # fmt: skip
    for name in resolver.get("sdist_only", []):
        cmd += ["--no-binary", name]
    for name in pins["stacks"][stack].get("source_builds", []):
        cmd += ["--no-emit-package", name]
    return cmd


def _env() -> dict[str, str]:
    env = dict(os.environ, UV_PYTHON_DOWNLOADS="never", UV_NO_CONFIG="1")
    for key in ("PIP_CONSTRAINT", "UV_CONSTRAINT", "UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "UV_FIND_LINKS"):
        env.pop(key, None)
    return env


def header(stack: str, lock: dict[str, Any], pins: dict[str, Any]) -> str:
    return (
        f"# Hashed lock for the {family(stack)} images, {lock['python_platform']}, Python {lock['python']}.\n"
        "# Generated from containers/pins.yaml by "
        f"`python -m containers.lock --stack {stack}`; do not edit.\n"
        f"# Resolver: uv {pins['resolver']['version']}, "
        f"packages uploaded before {pins['resolver']['exclude_newer']}.\n"
    )


def resolve(
    stack: str, lock: dict[str, Any], pins: dict[str, Any], out_dir: Path, extra_index: str | None
) -> Path:
    """Write <family>.in, <family>.overrides.txt and the lock into out_dir; returns the lock path."""
    reqs, overrides = lock_inputs(stack, pins)
    name = family(stack)
    in_path, ov_path = out_dir / f"{name}.in", out_dir / f"{name}.overrides.txt"
    _write(
        in_path,
        "# Generated from containers/pins.yaml by python -m containers.lock\n" + "\n".join(reqs) + "\n",
    )
    _write(ov_path, "# Recorded overrides (reasons in containers/pins.yaml)\n" + "\n".join(overrides) + "\n")
    target = out_dir / Path(lock["path"]).name
    scratch = target.with_name(target.name + ".uv-out")
    cmd = uv_command(stack, lock, pins, in_path.name, ov_path.name, scratch.name)
    if extra_index:
        cmd += ["--extra-index-url", extra_index, "--index-strategy", "unsafe-best-match"]
    result = subprocess.run(cmd, cwd=out_dir, env=_env(), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        scratch.unlink(missing_ok=True)
        raise RuntimeError(f"{target.name}: uv failed:\n{result.stderr.strip()}")
    _write(target, header(stack, lock, pins) + scratch.read_text())
    scratch.unlink()
    return target


def lock_blocks(text: str) -> dict[str, str]:
    """canonical name -> that package's full entry (requirement line and its hash lines)."""
    blocks: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        match = _LOCK_LINE.match(line)
        if match:
            current = str(canonicalize_name(match.group(1)))
            blocks[current] = line + "\n"
        elif current and line.startswith("    "):
            blocks[current] += line + "\n"
        else:
            current = None
    return blocks


def build_lock_path(lock_path: Path) -> Path:
    return lock_path.with_name(lock_path.name.removesuffix(".lock") + ".build.lock")


def sources_lock_path(lock_path: Path) -> Path:
    return lock_path.with_name(lock_path.name.removesuffix(".lock") + ".sources.lock")


def write_derived(stack: str, lock: dict[str, Any], pins: dict[str, Any], produced: Path) -> list[Path]:
    """The build-backend subset (installed first) and the hashed sdists of source-built packages."""
    blocks = lock_blocks(produced.read_text())
    build = build_lock_path(produced)
    names = ["setuptools", "wheel", *pins["stacks"][stack].get("build_requirements", [])]
    body = "".join(blocks[str(canonicalize_name(n))] for n in names if str(canonicalize_name(n)) in blocks)
    _write(build, "# Build backends, taken from " + produced.name + " (installed before it)\n" + body)
    written = [build]
    sdists = [n for n, kind in pins["stacks"][stack].get("source_builds", {}).items() if kind == "pypi-sdist"]
    if sdists:
        src = sources_lock_path(produced)
        req = src.with_name(src.name + ".in")
        _write(req, "".join(f"{n}=={pins['stacks'][stack]['packages'][n]}\n" for n in sdists))
        resolver = pins["resolver"]
        cmd = [
            uv_command(stack, lock, pins, "x", "x", "x")[0], "pip", "compile", req.name, "--no-deps",
            "--generate-hashes", "--no-header", "--quiet", "--index-url", resolver["index_url"],
            "--exclude-newer", resolver["exclude_newer"], "--python-platform", lock["python_platform"],
            "--python-version", lock["python"], "-o", src.name + ".uv-out",
        ]  # fmt: skip
        for name in sdists:
            cmd += ["--no-binary", name]
        result = subprocess.run(cmd, cwd=src.parent, env=_env(), capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{src.name}: uv failed:\n{result.stderr.strip()}")
        out = src.with_name(src.name + ".uv-out")
        _write(src, "# Source distributions built in the image without dependencies\n" + out.read_text())
        out.unlink()
        req.unlink()
        written.append(src)
    return written


def metadata_path(lock_path: Path) -> Path:
    return lock_path.with_name(lock_path.name.removesuffix(".lock") + ".requires.json")


def _marker_env(python: str, platform: str) -> dict[str, str]:
    env = default_environment()
    machine = platform.split("-", 1)[0]
    full = {"3.11": "3.11.13", "3.12": "3.12.3"}.get(python, python + ".0")
    env.update(
        python_version=python, python_full_version=full, platform_machine=machine, sys_platform="linux",
        platform_system="Linux", os_name="posix", implementation_name="cpython",
        platform_python_implementation="CPython",
    )  # fmt: skip
    return env


def conflicts(
    lock_text: str, snapshot: dict[str, dict], top: list[str], python: str, platform: str
) -> list[str]:
    """Every declared requirement among locked packages that the locked versions do not satisfy."""
    locked = parse_lock(lock_text)
    env = _marker_env(python, platform)
    extras: dict[str, set[str]] = {name: {""} for name in locked}
    pending = []
    for line in top:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        extras.setdefault(str(canonicalize_name(req.name)), {""}).update(req.extras)
    found: set[str] = set()
    changed = True
    while changed:  # extras requested by one package switch on more requirements of another
        changed = False
        for name, info in snapshot.items():
            for raw in info.get("requires_dist") or []:
                req = Requirement(raw)
                active = [
                    e
                    for e in extras.get(name, {""})
                    if req.marker is None or req.marker.evaluate({**env, "extra": e})
                ]
                if not active:
                    continue
                dep = str(canonicalize_name(req.name))
                new = set(req.extras) - extras.setdefault(dep, {""})
                if new:
                    extras[dep] |= new
                    changed = True
                pending.append((name, info["version"], req, dep))
    for name, version, req, dep in pending:
        have = locked.get(dep)
        if have is not None and req.specifier and not req.specifier.contains(have, prereleases=True):
            found.add(f"{name}=={version} requires {req.name}{req.specifier} (locked {have})")
    return sorted(found)


def locks_for(
    stacks: list[str], pins: dict[str, Any], include_unresolved: bool
) -> list[tuple[str, dict[str, Any]]]:
    """(stack, lock entry) once per lock file."""
    seen: set[str] = set()
    chosen = []
    for stack in stacks:
        for lock in pins["stacks"][stack].get("locks", []):
            if lock["path"] in seen or (lock["status"] != "resolved" and not include_unresolved):
                continue
            seen.add(lock["path"])
            chosen.append((stack, lock))
    return chosen


def _hashed_blocks(text: str) -> dict[str, str]:
    """Entries without their `# via` annotations: only versions and hashes count as drift."""
    return {
        name: "".join(line + "\n" for line in block.splitlines() if not line.lstrip().startswith("#"))
        for name, block in lock_blocks(text).items()
    }


def report_drift(committed: Path, produced: Path, resolver: dict[str, Any]) -> int:
    """Print each changed package with the index's reason; 1 when the lock drifted."""
    from containers import drift

    old_text = committed.read_text() if committed.exists() else ""
    new_text = produced.read_text()
    found = drift.changes(
        parse_lock(old_text), parse_lock(new_text), _hashed_blocks(old_text), _hashed_blocks(new_text),
        resolver["index_url"], resolver["exclude_newer"],
    )  # fmt: skip
    print(f"lock: {committed.name}: {'drift' if found else 'unchanged'}")
    for change in found:
        print(f"  {change.line()}")
    return int(bool(found))


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m containers.lock", description=__doc__.splitlines()[0])
    parser.add_argument("--stack", action="append", help="stack(s) to lock (default: every image stack)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="resolve again against the live index into a scratch dir and explain each difference "
        "(a maintainer's drift report; exit 1 on drift), write nothing",
    )
    parser.add_argument("--index-url", help="resolve against this index instead of the pinned one (a mirror)")
    parser.add_argument("--no-metadata", action="store_true", help="skip the Requires-Dist snapshot")
    parser.add_argument("--include-unresolved", action="store_true", help="also try locks marked unresolved")
    parser.add_argument("--extra-index-url", help="e.g. https://download.pytorch.org/whl/cpu (Ascend x86_64)")
    args = parser.parse_args(argv)
    pins = load_pins()
    if args.index_url:
        pins["resolver"] = {**pins["resolver"], "index_url": args.index_url}
    stacks = args.stack or [s for s, v in pins["stacks"].items() if v.get("kind") == "image"]
    for stack in args.stack or []:
        if not stack_pins(stack, pins).get("locks"):
            with_locks = sorted(s for s, v in pins["stacks"].items() if v.get("locks"))
            raise UserError(
                f"--stack {stack} has no locks in the pins file; lock one of {', '.join(with_locks)}"
            )
    chosen = locks_for(stacks, pins, args.include_unresolved)
    if not chosen:
        raise UserError(
            f"no resolved lock for {', '.join(stacks)}; pass --include-unresolved to try the others"
        )
    for _, lock in chosen if args.check else []:  # the drift report compares against these
        if (ROOT / lock["path"]).exists():
            read_text(ROOT / lock["path"], "lock", "regenerate it with `python -m containers.lock`")
    failed = 0
    for stack, lock in chosen:
        committed = ROOT / lock["path"]
        with tempfile.TemporaryDirectory() as scratch:
            out_dir = Path(scratch) if args.check else committed.parent
            out_dir.mkdir(parents=True, exist_ok=True)
            try:
                produced = resolve(stack, lock, pins, out_dir, args.extra_index_url)
            except RuntimeError as err:
                print(f"lock: {err}", file=sys.stderr)
                failed += 1
                continue
            if args.check:
                failed += report_drift(committed, produced, pins["resolver"])
                continue
        extra = write_derived(stack, lock, pins, produced)
        print(f"lock: wrote {lock['path']} ({len(parse_lock(produced.read_text()))} packages)", *extra)
        if not args.no_metadata:
            from containers import wheelmeta

            machine = lock["python_platform"].split("-", 1)[0]
            snap = wheelmeta.snapshot(parse_lock(produced.read_text()), machine, lock["python"])
            _write(metadata_path(produced), json.dumps(snap, indent=1, sort_keys=True) + "\n")
            top, _ = lock_inputs(stack, pins)
            found = conflicts(produced.read_text(), snap, top, lock["python"], lock["python_platform"])
            print(f"lock: {len(found)} conflict(s) in {produced.name}:", *found, sep="\n  ")
    return 1 if failed else 0


if __name__ == "__main__":
    entry(main)
