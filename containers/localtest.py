"""`python -m containers.localtest`: build Dockerfile.gpu's stages for real, offline from registries.

Remote base images cannot be pulled where this runs, so the structure is built on a minimal Debian
rootfs made here (debootstrap, cached under results/containers/), the Python layer installs the
engine's base dependencies from a hashed lock made here, and FSDPTurbo is a stub package served from a
local HTTP server (same download-and-hash path as the real archive). Then, inside the image, it runs
`python -m engine verify-env` and `python -m engine render qwen35_35b --device gpu`.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import json
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

from containers.build import build_args, build_command
from containers.lock import ROOT, _env
from engine.env.pins import load_pins
from engine.errors import ArgumentParser, entry

CACHE = ROOT / "results" / "containers"
BASE_TAG = "localhost/engine-testbase:bookworm"
IMAGE_TAG = "localhost/qwen35-engine:localtest"
STUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
RUN_FLAGS = [
    "--runtime", "runc", "run", "--rm", "--network", "none",
    "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
]  # fmt: skip


def _run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)


def ensure_base() -> str:
    """A minimal bookworm image with python3, venv and CA certificates; returns its image id."""
    found = _run(["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", BASE_TAG])
    if found.returncode == 0:
        return found.stdout.strip()
    rootfs = CACHE / "rootfs"
    if not (rootfs / "usr" / "bin" / "python3").exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
             "bookworm", str(rootfs), "http://deb.debian.org/debian"],
            check=True, capture_output=True,
        )  # fmt: skip
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(["podman", "import", "-", BASE_TAG], stdin=tar.stdout, check=True, capture_output=True)
    tar.wait()
    return _run(
        ["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", BASE_TAG]
    ).stdout.strip()


def test_locks() -> tuple[str, str]:
    """Hashed locks (engine base deps; build backends) for the test base: Debian 12, CPython 3.11."""
    out = CACHE / "testlocks"
    out.mkdir(parents=True, exist_ok=True)
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (out / "engine.in").write_text("\n".join(deps) + "\n")
    (out / "build.in").write_text("setuptools\nwheel\n")
    pins = load_pins()
    for name in ("engine", "build"):
        cmd = [
            str(Path(sys.executable).parent / "uv"), "pip", "compile", f"{name}.in", "--generate-hashes",
            "--python-platform", "x86_64-manylinux_2_28", "--python-version", "3.11",
            "--only-binary", ":all:",
            "--index-url", pins["resolver"]["index_url"], "--no-header", "--quiet", "-o", f"{name}.lock",
        ]  # fmt: skip
        subprocess.run(cmd, cwd=out, env=_env(), check=True, capture_output=True)
    return str((out / "engine.lock").relative_to(ROOT)), str((out / "build.lock").relative_to(ROOT))


def stub_fsdp_turbo() -> bytes:
    """A tiny installable fsdp_turbo package, as a commit archive (top directory FSDPTurbo-<commit>)."""
    files = {
        "pyproject.toml": '[build-system]\nrequires = ["setuptools"]\n'
        'build-backend = "setuptools.build_meta"\n'
        '[project]\nname = "fsdp-turbo"\nversion = "0.0.0"\n[tool.setuptools]\npackages = ["fsdp_turbo"]\n',
        "fsdp_turbo/__init__.py": '"""Stand-in for the structure test."""\n',
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"FSDPTurbo-{STUB_COMMIT}/{name}")
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def serve(directory: Path) -> tuple[http.server.ThreadingHTTPServer, int]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def run_in_image(*command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    flags = [f for key, value in (env or {}).items() for f in ("-e", f"{key}={value}")]
    return _run(["podman", *RUN_FLAGS, *flags, IMAGE_TAG, *command])


def build_and_check() -> dict[str, Any]:
    """Build the image and collect what the structure test asserts; timings in seconds."""
    timings: dict[str, float] = {}
    start = time.monotonic()
    base_id = ensure_base()
    timings["base"] = time.monotonic() - start
    lock, build_lock = test_locks()
    serve_dir = CACHE / "serve"
    serve_dir.mkdir(parents=True, exist_ok=True)
    archive = stub_fsdp_turbo()
    (serve_dir / f"FSDPTurbo-{STUB_COMMIT}.tar.gz").write_bytes(archive)
    server, port = serve(serve_dir)
    pins = load_pins()
    args = build_args("gpu", pins, revision="localtest")
    args.update(
        BASE_IMAGE=BASE_TAG, BASE_DIGEST=f"sha256:{base_id}", APT_SNAPSHOT="", PYTHON_VERSION="3.11",
        LOCK_FILE=lock, BUILD_LOCK_FILE=build_lock, FSDPTURBO_COMMIT=STUB_COMMIT,
        FSDPTURBO_URL=f"http://127.0.0.1:{port}/FSDPTurbo-{STUB_COMMIT}.tar.gz",
        FSDPTURBO_SHA256=hashlib.sha256(archive).hexdigest(), PIP_CERT="/run/host-ca.crt",
    )  # fmt: skip
    cmd = build_command("buildah", "containers/Dockerfile.gpu", args, [IMAGE_TAG], push=False, platform=None)
    cmd[2:2] = ["-v", f"{HOST_CA}:/run/host-ca.crt:ro"]
    start = time.monotonic()
    try:
        built = _run(cmd, cwd=ROOT)
    finally:
        server.shutdown()
    timings["build"] = time.monotonic() - start
    if built.returncode != 0:
        raise RuntimeError(f"image build failed:\n{built.stdout[-4000:]}\n{built.stderr[-4000:]}")
    start = time.monotonic()
    off = {"ENGINE_VERIFY_ENV": "off"}
    inspect = json.loads(_run(["buildah", "inspect", "--type", "image", IMAGE_TAG]).stdout)
    result = {
        "labels": inspect["OCIv1"]["config"].get("Labels", {}),
        "user": inspect["OCIv1"]["config"].get("User"),
        "verify_json": run_in_image(
            "python", "-m", "engine", "verify-env", "--json", "--allow-drift", env=off
        ),
        "verify_strict": run_in_image("python", "-m", "engine", "verify-env", env=off),
        "entrypoint_strict": run_in_image("true"),
        "entrypoint_warn": run_in_image("true", env={"ENGINE_VERIFY_ENV": "warn"}),
        "render": run_in_image("python", "-m", "engine", "render", "qwen35_35b", "--device", "gpu", env=off),
        "id": run_in_image("id", "-u", env=off),
        "import_turbo": run_in_image(
            "sh", "-c", "cd / && env -u PYTHONPATH python -c 'import fsdp_turbo'", env=off
        ),
    }
    timings["checks"] = time.monotonic() - start
    result["timings"] = timings
    return result


def main(argv: list[str] | None = None) -> int:
    ArgumentParser(prog="python -m containers.localtest", description=__doc__.splitlines()[0]).parse_args(
        argv
    )
    result = build_and_check()
    for key, value in result.items():
        if isinstance(value, subprocess.CompletedProcess):
            print(f"== {key}: exit {value.returncode}\n{value.stdout[-1500:]}{value.stderr[-1500:]}")
        else:
            print(f"== {key}: {json.dumps(value, indent=1)}")
    return 0


if __name__ == "__main__":
    entry(main)
