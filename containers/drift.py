"""Why a lock resolved again today differs from the committed one.

An `--exclude-newer` cut-off makes re-resolution repeatable only for the files the index listed when
the lock was made: a file whose upload time lies before the cut-off but that the index did not list
then (a lagging mirror, a cached page) enters a later resolution, and a yanked or deleted file leaves
it. None of that is a change in the repository, so re-resolution is a maintainer's report, not a
blocking test. For every changed package this module asks the index (PEP 691 JSON) for the facts that
explain the change: upload times against the cut-off, missing upload times (uv leaves such files out
under a cut-off), yanked or vanished files.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from datetime import datetime

from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

_ACCEPT = "application/vnd.pypi.simple.v1+json"


@dataclass(frozen=True)
class Change:
    """One package whose locked entry differs; `reasons` say why, from the index's own data."""

    name: str
    old: str | None
    new: str | None
    reasons: tuple[str, ...]

    def line(self) -> str:
        what = f"{self.old or '(absent)'} -> {self.new or '(absent)'}"
        if self.old == self.new:
            what = f"{self.old}: other files or hashes"
        return f"{self.name} {what}: " + "; ".join(self.reasons)


def index_files(index_url: str, name: str, timeout: float = 30.0) -> list[dict]:
    """The project's files as the index lists them now (PEP 691)."""
    url = f"{index_url.rstrip('/')}/{canonicalize_name(name)}/"
    request = urllib.request.Request(url, headers={"Accept": _ACCEPT})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())["files"]


def file_version(filename: str) -> Version | None:
    try:
        if filename.endswith(".whl"):
            return parse_wheel_filename(filename)[1]
        return parse_sdist_filename(filename)[1]
    except (ValueError, InvalidVersion):
        return None


def _when(entry: dict) -> datetime | None:
    stamp = entry.get("upload-time")
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")) if stamp else None


def explain(version: str | None, role: str, files: list[dict], cutoff: datetime) -> list[str]:
    """Facts about one version's files: `role` is 'now picked' or 'was locked'."""
    if version is None:
        return []
    mine = [f for f in files if file_version(f["filename"]) == Version(version)]
    if not mine:
        return [f"{version} ({role}) is no longer listed by the index"]
    facts = []
    yanked = [f for f in mine if f.get("yanked")]
    if yanked:
        why = yanked[0]["yanked"] if isinstance(yanked[0]["yanked"], str) else "no reason given"
        facts.append(f"{version} ({role}) is yanked ({why})")
    untimed = [f["filename"] for f in mine if _when(f) is None]
    if untimed:
        facts.append(
            f"the index gives no upload time for {len(untimed)} file(s) of {version} ({role}), "
            "which uv leaves out under a cut-off"
        )
    timed = sorted(t for f in mine if (t := _when(f)) is not None)
    if timed and role == "now picked":
        first = timed[0].strftime("%Y-%m-%dT%H:%M:%SZ")
        if timed[0] < cutoff:
            facts.append(
                f"{version} was uploaded {first}, before the cut-off: the committed lock was resolved "
                "against an index view that did not list it yet (mirror lag or a cached page); "
                "regenerate the locks"
            )
        else:
            facts.append(f"{version} was uploaded {first}, after the cut-off (a resolver bug)")
    return facts


def changes(
    old: dict[str, str],
    new: dict[str, str],
    old_blocks: dict[str, str],
    new_blocks: dict[str, str],
    index_url: str,
    cutoff: str,
) -> list[Change]:
    """Every package whose entry differs, each with the index's explanation."""
    limit = datetime.fromisoformat(cutoff.replace("Z", "+00:00"))
    found = []
    for name in sorted(set(old) | set(new)):
        if old_blocks.get(name) == new_blocks.get(name):
            continue
        before, after = old.get(name), new.get(name)
        if before is None or after is None:
            what = "added" if before is None else "removed"
            reasons = [f"{what} by the resolution (a dependency of a changed package changed)"]
        else:
            try:
                files = index_files(index_url, name)
            except OSError as err:
                reasons = [f"index not reachable for {name}: {err}"]
            else:
                reasons = explain(after, "now picked", files, limit)
                reasons += explain(before, "was locked", files, limit) if before != after else []
                if before == after:
                    reasons.append("same version, other files: a wheel was added or removed")
            reasons = reasons or ["no index fact explains it"]
        found.append(Change(name, before, after, tuple(reasons)))
    return found
