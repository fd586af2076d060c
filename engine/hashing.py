"""sha256 of files, streamed: data manifests, export manifests and provenance records hash alike."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any


def sha256_file(path: Path, progress: Any = None) -> str:
    """Hex sha256 of a file read in 8 MiB chunks; `progress` (a rich Progress) shows large files."""
    digest = hashlib.sha256()
    task = progress.add_task(f"hash {path.name}", total=path.stat().st_size) if progress else None
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
            if progress:
                progress.advance(task, len(chunk))
    return digest.hexdigest()
