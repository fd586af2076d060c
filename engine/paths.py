"""Where the project's own files are, named once.

`SOURCE_ROOT` is the directory that holds the `engine` package: the repository root in a checkout, the
site-packages of an installed wheel. verl's processes import the engine from there (PYTHONPATH). The
checkout's tooling (containers/, the pins file, the git commit of a record) lives beside the package
only in a checkout: `checkout()` says whether there is one.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE_ROOT = PACKAGE_DIR.parent
PINS_ENV = "ENGINE_PINS"
REPOSITORY_PINS = SOURCE_ROOT / "containers" / "pins.yaml"  # the source of truth `containers.*` edit


def checkout() -> Path | None:
    """The repository root when the engine runs from a checkout (None for an installed wheel)."""
    return SOURCE_ROOT if (SOURCE_ROOT / "pyproject.toml").is_file() else None


def pins_file() -> Path:
    """The pins file in use: $ENGINE_PINS (the images set it), else the checkout's containers/pins.yaml."""
    env = os.environ.get(PINS_ENV)
    return Path(env) if env else REPOSITORY_PINS
