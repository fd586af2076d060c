"""`python -m containers.build STACK`: build an image from the pins, tag it, and write its SBOM.

docker buildx where a daemon answers (SBOM + SLSA provenance attestations from BuildKit), buildah or
podman otherwise (no attestation support there: the CycloneDX SBOM of the Python layer is written from
the hashed lock either way). A release build refuses any unresolved pin; `--allow-unresolved` exists only
for the local structure test, which also swaps in a local base image.
"""

from __future__ import annotations

import datetime as dt
import difflib
import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from containers.lock import ROOT, build_lock_path, sources_lock_path
from engine import paths
from engine.env.pins import is_unresolved, load_pins, stack_pins
from engine.errors import ArgumentParser, UserError, entry

OUT_DIR = ROOT / "results" / "containers"


def git_revision() -> str:
    """Full commit of the work tree; `-dirty` appended when tracked files differ from it."""
    rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    if rev.returncode != 0:
        return "unknown"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT, check=False).returncode != 0
    return rev.stdout.strip() + ("-dirty" if dirty else "")


def image_lock(section: dict[str, Any]) -> dict[str, Any]:
    """The resolved lock an image installs from (the first resolved one of its stack)."""
    for lock in section.get("locks", []):
        if lock["status"] == "resolved":
            return lock
    raise UserError(
        "no resolved lock for this stack in containers/pins.yaml; run `python -m containers.lock`"
    )


def _walk(value: Any, path: str) -> list[str]:
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _walk(v, f"{path}.{k}" if path else str(k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _walk(v, f"{path}[{i}]")]
    return [path] if is_unresolved(value) else []


def unresolved(stack: str, pins: dict[str, Any]) -> list[str]:
    """Pins paths this stack's image depends on that still hold a placeholder."""
    return _walk(pins["fsdp_turbo"], "fsdp_turbo") + _walk(stack_pins(stack, pins), f"stacks.{stack}")


def _fmt(template: str, **values: str) -> str:
    for key, value in values.items():
        template = template.replace("{" + key + "}", value)
    return template


def build_args(stack: str, pins: dict[str, Any], revision: str, arch: str = "x86_64") -> dict[str, str]:
    """Every build argument of the stack's Dockerfile, derived from the pins alone."""
    section = stack_pins(stack, pins)
    packages = section["packages"]
    lock = ROOT / image_lock(section)["path"]
    turbo = pins["fsdp_turbo"]
    base = section["base_image"]
    args = {
        "BASE_IMAGE": f"{base['name']}@{base['digest']}",
        "BASE_DIGEST": str(base["digest"]),
        "APT_SNAPSHOT": str(section.get("apt_snapshot", "")),
        "PYTHON_VERSION": str(section["python"]),
        "LOCK_FILE": str(lock.relative_to(ROOT)),
        "BUILD_LOCK_FILE": str(build_lock_path(lock).relative_to(ROOT)),
        "FSDPTURBO_URL": _fmt(turbo["archive_url"], commit=str(turbo["commit"])),
        "FSDPTURBO_SHA256": str(turbo["sha256"]),
        "FSDPTURBO_COMMIT": str(turbo["commit"]),
        "ENGINE_VERSION": str(pins["engine"]["version"]),
        "REVISION": revision,
        "CREATED": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "IMAGE_SOURCE": pins["image"]["source"],
        "IMAGE_LICENSES": pins["image"]["licenses"],
        "STACK": stack,
        "PINS_SHA256": hashlib.sha256(paths.REPOSITORY_PINS.read_bytes()).hexdigest(),
        "TORCH_VERSION": str(packages["torch"]),
        "VLLM_VERSION": str(packages["vllm"]),
        "TRANSFORMERS_VERSION": str(packages["transformers"]),
        "FLA_VERSION": str(packages["flash-linear-attention"]),
        "VERL_VERSION": str(packages["verl"]),
    }
    if "cuda" in section:
        args["CUDA_VERSION"] = str(section["cuda"])
    if "cann" in section:
        installers = {item["name"]: item for item in section["cann"]["installers"]}
        for name in ("toolkit", "ops", "nnal"):
            args[f"CANN_{name.upper()}_URL"] = _fmt(installers[name]["url"], arch=arch)
            args[f"CANN_{name.upper()}_SHA256"] = str(installers[name]["sha256"][arch])
        ascend = section["vllm_ascend"]
        args.update(
            CANN_VERSION=str(section["cann"]["version"]),
            SOC_VERSION=str(section["soc_version"]),
            TORCH_NPU_VERSION=str(packages["torch-npu"]),
            VLLM_ASCEND_COMMIT=str(ascend["commit"]),
            VLLM_ASCEND_URL=_fmt(ascend["archive_url"], commit=str(ascend["commit"])),
            VLLM_ASCEND_SHA256=str(ascend["sha256"]),
            SOURCES_LOCK_FILE=str(sources_lock_path(lock).relative_to(ROOT)),
        )
    return args


def tags(stack: str, pins: dict[str, Any], revision: str) -> list[str]:
    """<repo>:<engine>-<stack>-torch<torch>-<rev12> (immutable) and <repo>:<engine>-<stack>."""
    repo = pins["image"]["repository"]
    section = stack_pins(stack, pins)
    version = pins["engine"]["version"]
    short = revision.replace("-dirty", "")[:12] + ("-dirty" if revision.endswith("-dirty") else "")
    return [
        f"{repo}:{version}-{stack}-torch{section['packages']['torch']}-{short}",
        f"{repo}:{version}-{stack}",
    ]


def builder() -> str:
    """docker (buildx) when a daemon answers, else buildah, else podman."""
    if (
        shutil.which("docker")
        and subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0
    ):
        return "docker"
    for tool in ("buildah", "podman"):
        if shutil.which(tool):
            return tool
    raise UserError("none of docker (with a daemon), buildah or podman is available; install one")


def build_command(
    tool: str, dockerfile: str, args: dict[str, str], image_tags: list[str], push: bool, platform: str | None
) -> list[str]:
    """The builder invocation (without running it)."""
    if tool == "docker":
        cmd = [
            "docker",
            "buildx",
            "build",
            "--provenance=mode=max",
            "--sbom=true",
            "--push" if push else "--load",
        ]
    else:
        cmd = [
            tool,
            "build",
            "--isolation",
            "chroot",
            "--layers",
            "--pull=never" if "localhost/" in args["BASE_IMAGE"] else "--pull",
        ]
    if platform:
        cmd += ["--platform", platform]
    cmd += ["-f", dockerfile, "--target", "runtime"]
    for key, value in args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    for tag in image_tags:
        cmd += ["-t", tag]
    return [*cmd, str(ROOT)]


def sbom_tool() -> str:
    """cyclonedx-py, next to this interpreter (a checkout's .venv links it there) or on PATH; looked up
    before a build, so a missing tool does not surface after an hour of building."""
    tool = shutil.which("cyclonedx-py", path=str(Path(sys.executable).parent)) or shutil.which("cyclonedx-py")
    if tool is None:
        raise UserError(
            "cyclonedx-py (the image SBOM) not found: run `bash ci/bootstrap.sh` in the checkout, or "
            "`uv tool install -c ci/constraints-cpu.txt cyclonedx-bom` (docs/guide/install.md)"
        )
    return tool


def write_sbom(tool: str, stack: str, lock_file: str, out_dir: Path) -> Path:
    """CycloneDX SBOM of the image's Python layer, from its hashed lock, by `tool` (sbom_tool())."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{stack}.cdx.json"
    subprocess.run([tool, "requirements", str(ROOT / lock_file), "-o", str(target)], check=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m containers.build", description=__doc__.splitlines()[0])
    parser.add_argument("stack", help="gpu, ascend-a2 or ascend-a3")
    parser.add_argument("--push", action="store_true", help="push (docker buildx) / push the tags afterwards")
    parser.add_argument("--platform", help="e.g. linux/arm64 for the aarch64 Ascend image")
    parser.add_argument("--dry-run", action="store_true", help="print the build command, build nothing")
    parser.add_argument("--allow-unresolved", action="store_true", help="local structure test only")
    parser.add_argument(
        "--build-arg", action="append", default=[], metavar="KEY=VALUE", help="override one arg"
    )
    args = parser.parse_args(argv)
    pins = load_pins()
    section = stack_pins(args.stack, pins)
    if section.get("kind") != "image":
        images = sorted(name for name, v in pins["stacks"].items() if v.get("kind") == "image")
        raise UserError(f"stack {args.stack} is not an image; build one of {', '.join(images)}")
    declared = set(re.findall(r"^\s*ARG\s+(\w+)", (ROOT / section["dockerfile"]).read_text(), re.M))
    overrides = {}
    for item in args.build_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--build-arg {item!r}: expected KEY=VALUE, e.g. --build-arg PIP_CERT=/ca.crt")
        if key not in declared:
            close = difflib.get_close_matches(key, sorted(declared), n=1)
            hint = f"did you mean {close[0]}?" if close else f"{section['dockerfile']} declares no such ARG"
            raise UserError(f"--build-arg {key}: unknown build argument; {hint}")
        overrides[key] = value
    sbom = None if args.dry_run else sbom_tool()
    missing = unresolved(args.stack, pins)
    if missing and not args.allow_unresolved:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise UserError(
            f"unresolved pins {', '.join(missing[:3])}{more}: run `python -m containers.resolve` first"
        )
    revision = git_revision()
    arch = "aarch64" if args.platform and "arm64" in args.platform else "x86_64"
    bargs = build_args(args.stack, pins, revision, arch)
    bargs.update(overrides)
    tool = "docker" if args.dry_run else builder()
    image_tags = tags(args.stack, pins, revision)
    cmd = build_command(tool, section["dockerfile"], bargs, image_tags, args.push, args.platform)
    print(" ".join(cmd))
    if args.dry_run:
        return 0
    subprocess.run(cmd, check=True)
    if args.push and tool != "docker":
        for tag in image_tags:
            subprocess.run([tool, "push", tag], check=True)
    assert sbom is not None  # a dry run returned above
    print(f"build: SBOM {write_sbom(sbom, args.stack, bargs['LOCK_FILE'], OUT_DIR / 'sbom')}")
    return 0


if __name__ == "__main__":
    entry(main)
