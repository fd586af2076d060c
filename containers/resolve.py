"""`python -m containers.resolve`: fill the UNRESOLVED pins where the network allows it.

Base image digests come from the registry (skopeo inspect), the FSDPTurbo commit from its repository
(git ls-remote of the default branch: review it before committing), archive and installer checksums from
downloading them once. Each placeholder string in pins.yaml is unique, so it is replaced in place and
the file keeps its comments. Nothing is written unless every lookup that was asked for succeeded.
"""

from __future__ import annotations

import hashlib
import subprocess
import urllib.request
from collections.abc import Callable

import yaml

from engine import paths
from engine.env.pins import is_unresolved, load_pins
from engine.errors import ArgumentParser, UserError, entry
from engine.fsutil import atomic_write

PINS_FILE = paths.REPOSITORY_PINS


def registry_digest(name: str) -> str:
    out = subprocess.run(
        ["skopeo", "inspect", "--format", "{{.Digest}}", f"docker://{name}"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def remote_head(repository: str) -> str:
    out = subprocess.run(["git", "ls-remote", repository, "HEAD"], capture_output=True, text=True, check=True)
    return out.stdout.split()[0]


def url_sha256(url: str) -> str:
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=600) as response:
        for chunk in iter(lambda: response.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def plan() -> list[tuple[str, Callable[[], str]]]:
    """(placeholder, lookup) for every unresolved value, in dependency order (commit before archive)."""
    pins = load_pins(PINS_FILE)
    todo: list[tuple[str, Callable[[], str]]] = []
    turbo = pins["fsdp_turbo"]
    if is_unresolved(turbo["commit"]):
        todo.append((turbo["commit"], lambda: remote_head(turbo["repository"])))
    for stack in pins["stacks"].values():
        base = stack.get("base_image", {})
        if is_unresolved(base.get("digest")):
            todo.append((base["digest"], lambda name=base["name"]: registry_digest(name)))
        for item in stack.get("cann", {}).get("installers", []):
            for arch, value in item["sha256"].items():
                if is_unresolved(value):
                    todo.append((value, lambda u=item["url"], a=arch: url_sha256(u.replace("{arch}", a))))
        ascend = stack.get("vllm_ascend", {})
        if is_unresolved(ascend.get("sha256")):
            url = ascend["archive_url"].replace("{commit}", ascend["commit"])
            todo.append((ascend["sha256"], lambda u=url: url_sha256(u)))
    return todo


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m containers.resolve", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite containers/pins.yaml (default: print)")
    args = parser.parse_args(argv)
    text = PINS_FILE.read_text(encoding="utf-8")
    seen: set[str] = set()
    for placeholder, lookup in plan():
        if placeholder in seen:
            continue
        seen.add(placeholder)
        try:
            value = lookup()
        except (OSError, subprocess.CalledProcessError) as err:
            detail = getattr(err, "stderr", None) or err
            raise UserError(
                f"{placeholder}: lookup failed ({str(detail).strip()[:200]}); nothing written"
            ) from None
        print(f"{placeholder} -> {value}")
        text = text.replace(placeholder, value)
    # the FSDPTurbo archive checksum depends on the commit just resolved
    pins_now = yaml.safe_load(text)
    turbo = pins_now["fsdp_turbo"]
    if is_unresolved(turbo["sha256"]) and not is_unresolved(turbo["commit"]):
        url = turbo["archive_url"].replace("{commit}", turbo["commit"])
        try:
            value = url_sha256(url)
        except OSError as err:
            raise UserError(f"cannot download {url} ({err}); resolve needs the network") from None
        print(f"{turbo['sha256']} -> {value}")
        text = text.replace(turbo["sha256"], value)
    if args.write:
        atomic_write(PINS_FILE, text)
    return 0


if __name__ == "__main__":
    entry(main)
