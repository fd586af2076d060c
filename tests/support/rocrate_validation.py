"""rocrate-validator run offline: the JSON-LD contexts it fetches come from tests/fixtures/jsonld.

The validator resolves `@context` URLs through its own HTTP cache (requests-cache, SQLite) and, in
offline mode, answers only from that cache. The cache is filled here from the pinned copies, through a
requests transport adapter, so the validator itself runs unchanged. Sources and sha256 of the copies:
tests/fixtures/jsonld/SOURCES.md.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import requests
import urllib3
from requests.adapters import BaseAdapter, HTTPAdapter

from engine.records import rocrate
from tests.conftest import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "jsonld"
# context URL -> (pinned copy, sha256 of the copy)
CONTEXTS = {
    "https://w3id.org/ro/crate/1.1/context": (
        FIXTURES / "ro-crate-1.1-context.jsonld",
        "4a8c4cbdfd73d3d11be5ebe135f6122a0fc711fd1433e4258a748c80cc257ab7",
    ),
    "https://w3id.org/ro/terms/workflow-run/context": (
        FIXTURES / "workflow-run-context.jsonld",
        "1e2f771d72a9f8c8e9d85be3cdb029862f48383c857e13a9204db250a1117eb9",
    ),
}
# conformsTo URI -> the validator's profile identifier
PROFILES = {
    rocrate.RO_CRATE: "ro-crate-1.1",
    rocrate.WORKFLOW_RO_CRATE: "workflow-ro-crate-1.0",
    rocrate.PROCESS_RUN: "process-run-crate-0.5",
    rocrate.WORKFLOW_RUN: "workflow-run-crate-0.5",
    rocrate.PROVENANCE_RUN: "provenance-run-crate-0.5",
}
# Process Run Crate 5.1 (RECOMMENDED) wants an http(s) @id for every SoftwareSourceCode and
# ComputationalWorkflow, while Workflow RO-Crate (REQUIRED) wants the main workflow, which has both types,
# to be a file of the crate: no crate satisfies both (open upstream: crs4/rocrate-validator#51).
WORKFLOW_FILE_ID_CHECK = "process-run-crate-0.5_5.1"
# what the validator's JSON-LD loader sends (rocrate_validator.utils.document_loader)
ACCEPT = {"Accept": "application/ld+json, application/json, */*;q=0.1"}


class _PinnedContexts(BaseAdapter):
    """Answers GETs of the pinned context URLs from the files; nothing reaches the network."""

    def send(self, request: requests.PreparedRequest, **kwargs: object) -> requests.Response:
        path, digest = CONTEXTS[str(request.url)]
        body = path.read_bytes()
        assert hashlib.sha256(body).hexdigest() == digest, f"{path} differs from its recorded sha256"
        raw = urllib3.HTTPResponse(
            body=io.BytesIO(body),
            status=200,
            headers={"Content-Type": "application/ld+json"},
            preload_content=False,
        )
        return HTTPAdapter().build_response(request, raw)

    def close(self) -> None:
        pass


def seed_cache(cache_path: Path) -> None:
    """Store the pinned contexts in a requests-cache database laid out as the validator's."""
    from requests_cache import CachedSession

    session = CachedSession(
        cache_name=str(cache_path), backend="sqlite", allowable_methods=("GET",), allowable_codes=(200,)
    )
    for url in CONTEXTS:
        session.mount(url, _PinnedContexts())
        assert session.get(url, headers=ACCEPT).status_code == 200
    session.close()


def validate(
    crate_dir: Path, profile: str, severity: str, cache_path: Path, skip: tuple[str, ...] = ()
) -> list[str]:
    """Issues (one line each) of rocrate-validator for one profile at one severity; [] when it passes."""
    from rocrate_validator import services

    if not Path(f"{cache_path}.sqlite").exists():
        seed_cache(cache_path)
    result = services.validate(
        {
            "rocrate_uri": str(crate_dir),
            "profile_identifier": profile,
            "requirement_severity": severity,
            "offline": True,
            "cache_path": str(cache_path),
            "skip_checks": list(skip),
        }
    )
    issues = [
        f"{i.check.identifier} [{i.severity.name}] {i.violatingEntity or ''}: {i.message}"
        for i in result.get_issues()
    ]
    assert result.passed() == (not issues)
    return issues


def claimed(crate_dir: Path) -> list[str]:
    """Validator ids of the profiles a crate claims (descriptor and root `conformsTo`)."""
    import json

    graph = {n["@id"]: n for n in json.loads((crate_dir / "ro-crate-metadata.json").read_text())["@graph"]}
    refs = []
    for node in (graph["ro-crate-metadata.json"], graph["./"]):
        value = node["conformsTo"]
        refs += value if isinstance(value, list) else [value]
    return sorted({PROFILES[ref["@id"]] for ref in refs})


def check_all(crate_dir: Path, cache_path: Path) -> dict[str, list[str]]:
    """REQUIRED for every claimed profile, RECOMMENDED for ro-crate-1.1 and workflow-run-crate-0.5."""
    found = {f"{p} REQUIRED": validate(crate_dir, p, "REQUIRED", cache_path) for p in claimed(crate_dir)}
    for profile in ("ro-crate-1.1", "workflow-run-crate-0.5"):
        found[f"{profile} RECOMMENDED"] = validate(
            crate_dir, profile, "RECOMMENDED", cache_path, skip=(WORKFLOW_FILE_ID_CHECK,)
        )
    return found
