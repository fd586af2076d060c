"""Requires-Dist of locked wheels, read with HTTP range requests (no wheel is downloaded whole).

The conflict check needs every locked package's declared requirements. The package index used here
does not serve PEP 658 metadata files, so the METADATA member is read out of the wheel's zip directory
with two or three range requests; the result is committed next to each lock so the check runs offline.
"""

from __future__ import annotations

import json
import re
import struct
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from email.parser import Parser

INDEX = "https://pypi.org/simple"
_ACCEPT = "application/vnd.pypi.simple.v1+json"


def _get(url: str, byte_range: str | None = None, accept: str | None = None) -> bytes:
    request = urllib.request.Request(url)
    if byte_range:
        request.add_header("Range", f"bytes={byte_range}")
    if accept:
        request.add_header("Accept", accept)
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read()


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pick_wheel(files: list[dict], name: str, version: str, arch: str, python: str) -> dict | None:
    """A wheel of that exact version, preferring the target arch and CPython version."""
    stem = re.sub(r"[-_.]+", "_", name).lower()
    cp = "cp" + python.replace(".", "")
    best: tuple[int, dict] | None = None
    for entry in files:
        fname = entry["filename"]
        if not fname.endswith(".whl") or entry.get("yanked"):
            continue
        parts = fname[:-4].split("-")
        if _normalize(parts[0]) != _normalize(stem) or parts[1] != version:
            continue
        score = (arch in fname) * 2 + ("none-any" in fname) + (cp in fname) * 2 + ("abi3" in fname)
        if best is None or score > best[0]:
            best = (score, entry)
    return best[1] if best else None


def _read_zip_member(url: str, suffix: str) -> bytes:
    """One member of a remote zip whose name ends with `suffix`, via range requests."""
    tail = _get(url, "-65536")
    eocd = tail.rfind(b"PK\x05\x06")
    if eocd < 0:
        raise ValueError(f"{url}: no zip end record in the last 64 KiB")
    cd_size, cd_offset = struct.unpack("<II", tail[eocd + 12 : eocd + 20])
    directory = _get(url, f"{cd_offset}-{cd_offset + cd_size - 1}")
    pos = 0
    while pos < len(directory) and directory[pos : pos + 4] == b"PK\x01\x02":
        method, _, _, _, csize, _, nlen, elen, clen = struct.unpack(
            "<HHHIIIHHH", directory[pos + 10 : pos + 34]
        )
        offset = struct.unpack("<I", directory[pos + 42 : pos + 46])[0]
        fname = directory[pos + 46 : pos + 46 + nlen].decode()
        pos += 46 + nlen + elen + clen
        if not (fname.endswith(suffix) and fname.count("/") == 1):
            continue
        header = _get(url, f"{offset}-{offset + 29}")
        lnlen, lelen = struct.unpack("<HH", header[26:30])
        start = offset + 30 + lnlen + lelen
        data = _get(url, f"{start}-{start + csize - 1}")
        return zlib.decompress(data, -15) if method == 8 else data
    raise ValueError(f"{url}: no {suffix} member")


def requires_dist(name: str, version: str, arch: str, python: str) -> dict:
    """{'requires_dist': [...], 'wheel': filename} or {'requires_dist': None, 'note': why}."""
    listing = json.loads(_get(f"{INDEX}/{_normalize(name)}/", accept=_ACCEPT))
    wheel = _pick_wheel(listing["files"], name, version, arch, python)
    if wheel is None:
        return {"requires_dist": None, "note": "no wheel (sdist only): metadata not read"}
    meta = Parser().parsestr(_read_zip_member(wheel["url"], ".dist-info/METADATA").decode("utf-8", "replace"))
    return {"requires_dist": meta.get_all("Requires-Dist") or [], "wheel": wheel["filename"]}


def snapshot(locked: dict[str, str], arch: str, python: str, workers: int = 16) -> dict[str, dict]:
    """Requires-Dist of every locked name==version, fetched in parallel."""

    def one(item: tuple[str, str]) -> tuple[str, dict]:
        name, version = item
        return name, {"version": version, **requires_dist(name, version, arch, python)}

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(sorted(pool.map(one, sorted(locked.items()))))
