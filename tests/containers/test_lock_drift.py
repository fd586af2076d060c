"""The drift report against a package index served on loopback: uv under a cut-off, and the reasons.

The index is PEP 691 JSON with upload times, like PyPI's; its state changes between resolutions the way
a live index does (a file listed late, a file without upload time, a yank), and the report must name
the cause each time. Nothing here reaches the network.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from containers import drift, lock

UV = shutil.which("uv", path=str(Path(sys.executable).parent)) or "uv"
CUTOFF = "2026-06-01T00:00:00Z"


def _wheel(folder: Path, version: str) -> Path:
    path = folder / f"pkgx-{version}-py3-none-any.whl"
    info = f"pkgx-{version}.dist-info/"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("pkgx/__init__.py", "")
        wheel.writestr(info + "METADATA", f"Metadata-Version: 2.1\nName: pkgx\nVersion: {version}\n")
        wheel.writestr(info + "WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(info + "RECORD", "")
    return path


class Index:
    """A one-project simple index whose listing the test rewrites between resolutions."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.listing: list[dict] = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.rstrip("/") == "/simple/pkgx":
                    body = json.dumps(
                        {"meta": {"api-version": "1.1"}, "name": "pkgx", "files": index.listing}
                    )
                    self._send(body.encode(), "application/vnd.pypi.simple.v1+json")
                elif (index.folder / self.path.lstrip("/")).is_file():
                    self._send((index.folder / self.path.lstrip("/")).read_bytes(), "application/zip")
                else:
                    self.send_error(404)

            def do_HEAD(self) -> None:
                self.head_only = True
                self.do_GET()

            def _send(self, body: bytes, kind: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not getattr(self, "head_only", False):
                    self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/simple"

    def publish(self, version: str, uploaded: str | None, yanked: str | None = None) -> None:
        wheel = _wheel(self.folder, version)
        entry = {
            "filename": wheel.name,
            "url": f"/{wheel.name}",
            "hashes": {"sha256": hashlib.sha256(wheel.read_bytes()).hexdigest()},
        }
        if uploaded:
            entry["upload-time"] = uploaded
        if yanked:
            entry["yanked"] = yanked
        self.listing = [f for f in self.listing if f["filename"] != wheel.name] + [entry]


@pytest.fixture
def index(tmp_path: Path) -> Iterator[Index]:
    served = Index(tmp_path)
    thread = threading.Thread(target=served.server.serve_forever, daemon=True)
    thread.start()
    yield served
    served.server.shutdown()


def _resolve(index: Index, folder: Path) -> str:
    """A fresh resolution: a new output file, since uv keeps the versions of an existing one."""
    (folder / "in.txt").write_text("pkgx\n")
    (folder / "out.txt").unlink(missing_ok=True)
    result = subprocess.run(
        [UV, "pip", "compile", "in.txt", "--index-url", index.url, "--exclude-newer", CUTOFF,
         "--python-version", "3.11", "--generate-hashes", "--no-header", "--quiet", "--no-cache",
         "-o", "out.txt"],
        cwd=folder, capture_output=True, text=True, env=lock._env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return (folder / "out.txt").read_text()


def _report(index: Index, old: str, new: str) -> list[drift.Change]:
    return drift.changes(
        lock.parse_lock(old), lock.parse_lock(new), lock._hashed_blocks(old), lock._hashed_blocks(new),
        index.url, CUTOFF,
    )  # fmt: skip


def test_report_names_the_cause_of_each_drift(index: Index, tmp_path: Path) -> None:
    index.publish("1.0", "2026-01-01T00:00:00Z")
    committed = _resolve(index, tmp_path)
    assert lock.parse_lock(committed) == {"pkgx": "1.0"}
    assert _report(index, committed, committed) == []

    # listed late with an upload time before the cut-off; one without upload time; one after the cut-off
    index.publish("1.1", "2026-03-01T12:00:00Z")
    index.publish("1.2", None)
    index.publish("1.3", "2026-07-01T00:00:00Z")
    today = _resolve(index, tmp_path)
    assert lock.parse_lock(today) == {"pkgx": "1.1"}  # uv leaves out 1.2 (no upload time) and 1.3
    (change,) = _report(index, committed, today)
    assert (change.old, change.new) == ("1.0", "1.1")
    assert "uploaded 2026-03-01T12:00:00Z, before the cut-off" in change.line()
    assert "regenerate the locks" in change.line()

    index.publish("1.1", "2026-03-01T12:00:00Z", yanked="broken build")
    later = _resolve(index, tmp_path)
    assert lock.parse_lock(later) == {"pkgx": "1.0"}
    (change,) = _report(index, today, later)
    assert "1.1 (was locked) is yanked (broken build)" in change.line()


def test_report_names_missing_upload_times(index: Index) -> None:
    index.publish("2.0", None)
    cutoff = drift.datetime.fromisoformat("2026-06-01T00:00:00+00:00")
    (fact,) = drift.explain("2.0", "now picked", index.listing, cutoff)
    assert fact.startswith("the index gives no upload time for 1 file(s) of 2.0")
    (gone,) = drift.explain("9.9", "was locked", index.listing, cutoff)
    assert gone == "9.9 (was locked) is no longer listed by the index"
