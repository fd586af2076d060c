"""Fail at once in verl's driver when the launch selects the `fsdp_turbo` strategy and the `fsdp_turbo`
package cannot be imported (step 6 of `engine.runtime.install`).

Why at import time: verl offers no hook in the driver between Hydra composing the config and Ray starting
workers (`auto_set_device`/`validate_config` are plain functions, not registries). The external-module
import is the earliest point verl hands us in the driver, so the check reads what selects the strategy —
the Hydra overrides on the command line (`sys.orig_argv`) and, when given, the `--config-path/--config-name`
file — and exits with one message before Ray is initialised. It never runs inside Ray workers (their argv
is Ray's worker entry point) and never on other verl commands.
"""

from __future__ import annotations

import os
import sys
from importlib.util import find_spec
from pathlib import Path

TURBO_STRATEGY = "fsdp_turbo"
TURBO_MISSING = (
    "fsdp_turbo strategy selected but the FSDPTurbo library is not importable (import name 'fsdp_turbo'). "
    "It is not on PyPI: the project's gpu/npu containers install it from its git repository at the pinned "
    "commit; run inside those images, or pick actor/ref strategy fsdp2 (the cpu profile does)."
)
TRAINER_MODULE = "verl.trainer.main_ppo"


def turbo_strategy_requested(argv: list[str]) -> bool:
    """True when the Hydra command line (or its config file) selects strategy=fsdp_turbo anywhere."""
    config_path = config_name = None
    for index, arg in enumerate(argv):
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~").endswith(".strategy") and value.strip("'\"") == TURBO_STRATEGY:
            return True
        for flag in ("--config-path", "--config-name", "-cp", "-cn"):
            if arg == flag and index + 1 < len(argv):
                value, sep = argv[index + 1], "="
            elif arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
            else:
                continue
            if flag in ("--config-path", "-cp"):
                config_path = value
            else:
                config_name = value
    if config_path and config_name:
        path = Path(config_path) / (config_name if config_name.endswith(".yaml") else config_name + ".yaml")
        if path.is_file():
            text = path.read_text(errors="replace")
            return any(
                line.split("#", 1)[0].strip().replace(" ", "") == f"strategy:{TURBO_STRATEGY}"
                for line in text.splitlines()
            )
    return False


def is_trainer_driver(argv: list[str]) -> bool:
    """The process is `python -m verl.trainer.main_ppo` (or its file), not a Ray worker or another tool."""
    for index, arg in enumerate(argv):
        if arg == "-m" and index + 1 < len(argv):
            return argv[index + 1] == TRAINER_MODULE
        if arg.endswith(os.path.join("verl", "trainer", "main_ppo.py")):
            return True
    return False


def check_turbo(argv: list[str] | None = None) -> str | None:
    """The one-line problem when fsdp_turbo is selected but missing, else None."""
    argv = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    if not is_trainer_driver(argv) or not turbo_strategy_requested(argv):
        return None
    return None if find_spec(TURBO_STRATEGY) is not None else TURBO_MISSING
