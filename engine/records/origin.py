"""Where a run came from: the code (git), the people (author, publisher), the machine and the software.

Each is read at record time, never from verl (which records none of it); `provenance write` puts them into
the record, the RO-Crate turns them into entities. Nothing here fails a record: what cannot be read is
recorded as unknown.
"""

from __future__ import annotations

import getpass
import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any

from engine.errors import UserError
from engine.procs import command_output
from engine.run.redact import scrub


def git_info(repo: Path | None) -> dict[str, Any]:
    """Commit, dirty flag, branch and (scrubbed) remote of the checkout the engine runs from."""
    if repo is None:
        return {"commit": None, "dirty": None, "note": "not a git checkout (an installed engine)"}
    commit = command_output(["git", "rev-parse", "HEAD"], repo)
    if commit is None:
        return {"commit": None, "dirty": None, "note": "not a git checkout"}
    status = command_output(["git", "status", "--porcelain", "--untracked-files=no"], repo) or ""
    remote = command_output(["git", "remote", "get-url", "origin"], repo)
    return {
        "commit": commit,
        "dirty": bool(status),
        "branch": command_output(["git", "branch", "--show-current"], repo),
        "remote": scrub(remote) if remote else None,
    }


def container_info() -> dict[str, Any]:
    """Image reference, digest and labels when running inside one of the project's containers."""
    info: dict[str, Any] = {"inside": Path("/.dockerenv").exists() or Path("/run/.containerenv").exists()}
    for key, var in (("image", "ENGINE_IMAGE"), ("digest", "ENGINE_IMAGE_DIGEST")):
        info[key] = os.environ.get(var)
    containerenv = Path("/run/.containerenv")
    if containerenv.is_file():  # podman writes image=/imageid= here
        for line in containerenv.read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key in ("image", "imageid"):
                info.setdefault("containerenv", {})[key] = value.strip('"')
    labels = Path(os.environ.get("ENGINE_IMAGE_LABELS", "/etc/engine/image-labels.json"))
    if labels.is_file():
        info["labels"] = json.loads(labels.read_text())
    return info


def versions(device: str | None = None) -> dict[str, Any]:
    """Pins versus installed versions (engine.env.pins when present, else package metadata), judged
    against the stack preflight used for this device."""
    try:
        from engine.env import pins

        installed = pins.installed_versions()
        try:
            drift = pins.drift(pins.stack_for(device))
        except Exception as err:  # a stack the pins file lacks must not lose the record
            drift = [f"unavailable: {err.__class__.__name__}"]
        return {"installed": installed, "drift": drift, "pins_source": "engine.env.pins"}
    except ImportError:
        names = ["torch", "verl", "transformers", "vllm", "vllm-ascend", "ray", "TransferQueue", "snakemake"]
        found = {}
        for name in names:
            try:
                found[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                found[name] = None
        return {"installed": found, "drift": "unavailable", "pins_source": "package metadata"}


def _git_user(repo: Path | None) -> str | None:
    return command_output(["git", "config", "user.name"], repo) or None


def agent(repo: Path | None) -> dict[str, str]:
    """Who ran it: $ENGINE_AUTHOR, else git's user.name, else the login name."""
    if os.environ.get("ENGINE_AUTHOR"):
        return {"name": os.environ["ENGINE_AUTHOR"], "source": "ENGINE_AUTHOR"}
    name = _git_user(repo)
    if name:
        return {"name": name, "source": "git user.name"}
    try:
        return {"name": getpass.getuser(), "source": "login name"}
    except (OSError, KeyError):
        return {"name": f"uid {os.getuid()}", "source": "uid"}


def publisher() -> dict[str, str] | None:
    """The organisation publishing the record: $ENGINE_PUBLISHER + $ENGINE_PUBLISHER_URL, or None."""
    name, url = os.environ.get("ENGINE_PUBLISHER"), os.environ.get("ENGINE_PUBLISHER_URL")
    if not name and not url:
        return None
    if not (name and url and url.startswith(("https://", "http://"))):
        raise UserError(
            "ENGINE_PUBLISHER and ENGINE_PUBLISHER_URL go together: set both (the URL as https://...) "
            "or neither"
        )
    return {"name": name, "url": url}
