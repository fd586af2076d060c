"""Pinned versions of each stack (containers/pins.yaml) against what is installed: `verify-env`.

Kept light on purpose (no torch, verl or Ray import): preflight, provenance and the container entrypoint
call it, and it must answer in well under a second. Installed versions come from package metadata, never
from importing the packages themselves.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from engine import fsutil, paths
from engine.errors import ArgumentParser, UserError
from engine.procs import command_output

STACK_ENV = "ENGINE_STACK"  # stack baked into an image; `cpu` (this repository's dev/CI venv) otherwise
DEFAULT_STACK = "cpu"
UNRESOLVED = "UNRESOLVED:"
ENGINE_DISTRIBUTION = "qwen35-grpo-engine"

# Report keys -> distribution names. These keys are what provenance and preflight read.
TRACKED: dict[str, str] = {
    "torch": "torch",
    "torch_npu": "torch-npu",
    "torchvision": "torchvision",
    "torchaudio": "torchaudio",
    "verl": "verl",
    "transformers": "transformers",
    "vllm": "vllm",
    "vllm_ascend": "vllm-ascend",
    "flash-linear-attention": "flash-linear-attention",
    "ray": "ray",
    "TransferQueue": "TransferQueue",
    "hydra-core": "hydra-core",
    "numpy": "numpy",
}
_HEX40 = re.compile(r"\b[0-9a-f]{40}\b")


# What the readers of a pins file index besides each stack's packages (verify-env, provenance, the
# RO-Crate, the image builder): checked when it is loaded, so a gap is one error line, not a KeyError.
REQUIRED = (
    ("engine", "version"),
    ("image", "source"),
    ("fsdp_turbo", "repository"),
    ("fsdp_turbo", "commit"),
)


def load_pins(path: Path | str | None = None) -> dict[str, Any]:
    """Parse the pins file and check what its readers index; a bad file is a UserError naming it."""
    target = Path(path) if path is not None else paths.pins_file()
    where = f"{paths.PINS_ENV}=<path to containers/pins.yaml>"
    if not target.exists():
        raise UserError(f"pins file {target} not found: set {where}")
    data = fsutil.read_yaml(target, "pins file", f"fix it or set {where}")
    if not isinstance(data, dict) or not isinstance(data.get("stacks"), dict) or "engine" not in data:
        raise UserError(f"pins file {target}: needs top-level 'engine' and 'stacks' mappings")
    problems = [f"no {key}.{field} value" for key, field in REQUIRED if not _scalar(data.get(key), field)]
    for name, stack in data["stacks"].items():
        packages = stack.get("packages") if isinstance(stack, dict) else None
        if not isinstance(packages, dict) or not all(_scalar(packages, package) for package in packages):
            problems.append(f"stacks.{name} has no 'packages' mapping of package: version")
    if problems:
        raise UserError(f"pins file {target}: {'; '.join(problems)}; add them (as in containers/pins.yaml)")
    return data


def _scalar(section: Any, key: str) -> bool:
    value = section.get(key) if isinstance(section, dict) else None
    return isinstance(value, str | int | float) and not isinstance(value, bool)


def stack_pins(stack: str, pins: dict[str, Any] | None = None) -> dict[str, Any]:
    """One stack's section; unknown names are a UserError listing the known ones."""
    pins = pins if pins is not None else load_pins()
    stacks = pins["stacks"]
    if stack not in stacks:
        raise UserError(f"unknown stack '{stack}': use one of {', '.join(sorted(stacks))}")
    return stacks[stack]


def is_unresolved(value: object) -> bool:
    """True for a placeholder that `python -m containers.resolve` still has to fill."""
    return isinstance(value, str) and value.startswith(UNRESOLVED)


def expected_versions(stack: str, pins: dict[str, Any] | None = None) -> dict[str, str]:
    """What the stack pins, keyed like installed_versions(): packages, engine and FSDPTurbo commit."""
    pins = pins if pins is not None else load_pins()
    section = stack_pins(stack, pins)
    by_name = {canonicalize_name(dist): key for key, dist in TRACKED.items()}
    expected = {by_name.get(canonicalize_name(name), name): str(v) for name, v in section["packages"].items()}
    expected["engine"] = str(pins["engine"]["version"])
    if section.get("kind") == "image":
        expected["fsdp_turbo_commit"] = str(pins["fsdp_turbo"]["commit"])
    return expected


def dist_version(name: str) -> str | None:
    """Installed version of a distribution (None when it is not installed)."""
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _direct_url_commit(dist: md.Distribution) -> str | None:
    """The commit a distribution was installed from (VCS install, or a commit archive URL)."""
    raw = dist.read_text("direct_url.json")
    if not raw:
        return None
    info = json.loads(raw)
    commit = info.get("vcs_info", {}).get("commit_id")
    if commit:
        return str(commit)
    found = _HEX40.findall(info.get("url", ""))
    return found[-1] if found else None


def _git_head(directory: Path) -> str | None:
    """HEAD of a git checkout that holds the package (the PYTHONPATH style of install)."""
    for parent in (directory, *directory.parents):
        if (parent / ".git").exists():
            return command_output(["git", "-C", str(parent), "rev-parse", "HEAD"]) or None
    return None


def fsdp_turbo_info(import_name: str = "fsdp_turbo") -> dict[str, str | None]:
    """Version, commit and location of FSDPTurbo without importing it (it imports torch)."""
    info: dict[str, str | None] = {"version": None, "commit": None, "location": None}
    for dist_name in md.packages_distributions().get(import_name, []):
        dist = md.distribution(dist_name)
        info["version"] = dist.version
        info["commit"] = _direct_url_commit(dist)
        break
    try:
        spec = importlib.util.find_spec(import_name)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        location = Path(spec.origin).parent
        info["location"] = str(location)
        if info["version"] is None:
            info["version"] = "unpackaged"
        if info["commit"] is None:
            info["commit"] = _git_head(location)
    return info


def installed_versions(also: Iterable[str] = ()) -> dict[str, str | None]:
    """Installed versions of the tracked packages and of `also` (None: not installed)."""
    found: dict[str, str | None] = {key: dist_version(dist) for key, dist in TRACKED.items()}
    found |= {name: dist_version(name) for name in also if name not in found}
    turbo = fsdp_turbo_info()
    found["fsdp_turbo"] = turbo["version"]
    found["fsdp_turbo_commit"] = turbo["commit"]
    engine_version = dist_version(ENGINE_DISTRIBUTION)
    if engine_version is None:
        import engine

        engine_version = engine.__version__
    found["engine"] = engine_version
    return found


def verl_extension(
    pins: dict[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Whether verl will load the engine's extension (named in VERL_USE_EXTERNAL_MODULES, importable).

    `env` is the environment the launch will have (a plan's exports); the process's own by default.
    """
    pins = pins if pins is not None else load_pins()
    module = str(pins["engine"].get("verl_extension_module", ""))
    env = os.environ if env is None else env
    named = [m.strip() for m in env.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m.strip()]
    try:
        importable = bool(module) and importlib.util.find_spec(module) is not None
    except ImportError:
        importable = False
    return {"module": module, "enabled": module in named, "importable": importable}


def public_version(version: str) -> str:
    """The version without its local label (torch 2.11.0+cu130 -> 2.11.0); unparsable ones as given."""
    try:
        return Version(version).public
    except InvalidVersion:
        return version.split("+", 1)[0]


def _same_version(pinned: str, installed: str) -> bool:
    """Pins name public versions; wheels may add a local label (torch 2.11.0+cu130)."""
    return public_version(installed) == public_version(pinned)


def drift(
    stack: str,
    installed: dict[str, str | None] | None = None,
    pins: dict[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """One line per difference between the stack's pins and the installed versions; empty when none."""
    pins = pins if pins is not None else load_pins()
    expected = expected_versions(stack, pins)
    installed = installed if installed is not None else installed_versions(expected)
    problems: list[str] = []
    for key, pinned in expected.items():
        have = installed.get(key)
        if is_unresolved(pinned):
            problems.append(f"{key}: pin is unresolved ({pinned}); installed {have or 'nothing'}")
        elif have is None:
            problems.append(f"{key}: pinned {pinned}, not installed")
        elif not _same_version(pinned, have):
            problems.append(f"{key}: pinned {pinned}, installed {have}")
    if stack_pins(stack, pins).get("kind") == "image":
        ext = verl_extension(pins, env)
        if not ext["enabled"]:
            problems.append(f"verl extension: {ext['module']} is not in $VERL_USE_EXTERNAL_MODULES")
        elif not ext["importable"]:
            problems.append(f"verl extension: {ext['module']} is named but cannot be imported")
    return problems


DEVICE_STACKS = {"gpu": "gpu", "npu": "ascend-a3", "cpu": "cpu"}


def stack_for(device: str | None = None) -> str:
    """The stack whose pins apply: the image's ($ENGINE_STACK), else the device's, else the CI venv's.

    Preflight, verify-env and the provenance record all ask here, so they judge one run by one stack.
    """
    return os.environ.get(STACK_ENV) or DEVICE_STACKS.get(device or "", DEFAULT_STACK)


def report(stack: str | None = None) -> dict[str, Any]:
    """Everything verify-env knows, as the provenance record stores it."""
    pins = load_pins()
    stack = stack or stack_for()
    installed = installed_versions(expected_versions(stack, pins))
    problems = drift(stack, installed, pins)
    return {
        "stack": stack,
        "pins_file": str(paths.pins_file()),
        "expected": expected_versions(stack, pins),
        "installed": installed,
        "verl_extension": verl_extension(pins),
        "image": {k: os.environ.get(k) for k in ("ENGINE_IMAGE_REVISION", "ENGINE_IMAGE_VERSION")},
        "python": sys.version.split()[0],
        "drift": problems,
        "ok": not problems,
    }


def _print_table(rec: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"verify-env: stack {rec['stack']} ({rec['pins_file']})")
    for column in ("package", "pinned", "installed", ""):
        table.add_column(column)
    keys = list(rec["expected"]) + [k for k in rec["installed"] if k not in rec["expected"]]
    for key in keys:
        pinned = rec["expected"].get(key, "-")
        have = rec["installed"].get(key)
        if key not in rec["expected"]:
            mark = ""
        elif have is not None and not is_unresolved(pinned) and _same_version(pinned, have):
            mark = "[green]ok[/green]"
        else:
            mark = "[red]drift[/red]"
        table.add_row(key, pinned, have or "-", mark)
    console = Console(width=120)
    console.print(table)
    ext = rec["verl_extension"]
    console.print(f"verl extension {ext['module']}: enabled={ext['enabled']} importable={ext['importable']}")


def _own_record(path: Path) -> str | None:
    """--output replaces an earlier verify-env record, and no other file."""
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):
        earlier = None
    if isinstance(earlier, dict) and {"stack", "expected", "installed", "drift"} <= set(earlier):
        return None
    return "it exists and is not a verify-env record"


def cli_main(argv: list[str]) -> int:
    """`python -m engine verify-env`: print pinned vs installed; exit 1 on drift unless allowed."""
    parser = ArgumentParser(prog="python -m engine verify-env", description=cli_main.__doc__)
    parser.add_argument("--stack", help=f"stack in the pins file (default: ${STACK_ENV} or {DEFAULT_STACK})")
    parser.add_argument("--allow-drift", action="store_true", help="report drift but exit 0")
    parser.add_argument("--json", action="store_true", help="print the record as JSON")
    parser.add_argument("--output", type=Path, help="also write the JSON record to this file")
    args = parser.parse_args(argv)
    if args.stack is not None and not args.stack.strip():
        raise UserError(f"--stack is empty: name a stack of the pins file, or leave it out for ${STACK_ENV}")
    if args.output:
        args.output = fsutil.check_out_file(args.output, "--output", reuse=_own_record)
    rec = report(args.stack)
    if args.output:
        fsutil.atomic_write(args.output, json.dumps(rec, indent=2) + "\n")
    if args.json:
        print(json.dumps(rec, indent=2))
    else:
        _print_table(rec)
    for line in rec["drift"]:
        print(f"verify-env: drift: {line}", file=sys.stderr)
    if rec["drift"] and not args.allow_drift:
        print(
            f"verify-env: {len(rec['drift'])} difference(s) from the pins (--allow-drift to go on)",
            file=sys.stderr,
        )
        return 1
    return 0
