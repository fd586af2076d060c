"""`python -m engine check-imports`: import what a GRPO run with verl's vLLM rollout imports, before it runs.

A wheelhouse (containers/wheelhouse-gpu.txt, with containers/wheelhouse-vllm.txt for the rollout)
carried to a machine without an index is meant to be
complete; this finds out in seconds instead of minutes into a launch. With `--fallback DIR` (more wheels
of the same lock), each module still missing is taken from the wheel in DIR that ships it, installed into
`--site`, and the imports are tried again; every addition is reported, so the selection file can be
corrected from the record. The report (JSON) goes to stdout and, with `--out`, to a file.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from engine import fsutil
from engine.errors import ArgumentParser, UserError

# what verl's FSDP engine, as the actor and the trainer benchmarks drive it, imports with the fast kernels,
# and the modules of this project that verl loads (containers/wheelhouse-gpu.txt)
TRAIN_MODULES = (
    "verl.workers.engine",
    "verl.workers.config",
    "verl.workers.utils.losses",
    "fla.ops.gated_delta_rule",
    "fla.modules.causal_conv1d",
    "engine.kernels",
    "engine.verl_ext",
)
# what the trainer, verl's vLLM server and vLLM's engine/worker import for a Qwen3.5 rollout
# (containers/wheelhouse-vllm.txt on top)
RUN_MODULES = (
    "verl.trainer.main_ppo",
    "verl.workers.rollout.vllm_rollout.vllm_async_server",
    "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer",
    "vllm.entrypoints.openai.api_server",
    "vllm.v1.engine.core",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.model_executor.models.qwen3_5",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.attention.backends.gdn_attn",
    "vllm.device_allocator.cumem",
    *TRAIN_MODULES,
)
WORKFLOW_MODULES = ("snakemake", "snakemake.cli", "matplotlib.pyplot")
MAX_ADDED = 25


def providers(wheel_dir: Path) -> dict[str, Path]:
    """Top-level import name -> the wheel that ships it."""
    found: dict[str, Path] = {}
    for wheel in sorted(wheel_dir.glob("*.whl")):
        for name in zipfile.ZipFile(wheel).namelist():
            top = name.split("/", 1)[0]
            if not top.endswith((".dist-info", ".data")):
                found.setdefault(top.removesuffix(".py"), wheel)
    return found


def check(modules: tuple[str, ...], site: Path | None, fallback: dict[str, Path]) -> dict[str, object]:
    """Import `modules` in a fresh interpreter; add fallback wheels for missing ones until all import."""
    added: list[str] = []
    code = f"import importlib\nfor m in {list(modules)!r}: importlib.import_module(m)"
    while True:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
        if done.returncode == 0:
            return {"imports": "ok", "modules": list(modules), "added": added}
        missing = re.findall(r"No module named '([^'.]+)", done.stderr)
        wheel = fallback.get(missing[-1]) if missing else None
        if wheel is None or site is None or len(added) >= MAX_ADDED:
            lines = done.stderr.strip().splitlines() or ["no output"]
            return {"imports": "failed", "added": added, "missing": missing[-1:], "error": lines[-1]}
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site)]
        subprocess.run([*pip, str(wheel)], check=True)
        added.append(wheel.name)


def cli_main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m engine check-imports", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--what",
        choices=("train", "run", "workflow", "bench", "all"),
        default="all",
        help="train: verl's engine and the kernels; run: trainer + vLLM rollout; workflow: Snakemake and "
        "the report's plotting; bench: train + workflow (the trainer benchmarks); all: run + workflow",
    )
    parser.add_argument(
        "--module", action="append", default=[], help="import this module instead (repeatable)"
    )
    parser.add_argument("--site", type=Path, help="where `wheelhouse install --target` put the stack")
    parser.add_argument("--fallback", type=Path, help="a folder of further wheels for modules still missing")
    parser.add_argument("--out", type=Path, help="also write the report (JSON) here")
    args = parser.parse_args(argv)
    if args.fallback is not None and not args.fallback.is_dir():
        raise UserError(f"--fallback {args.fallback}: no such directory; pass a folder of wheels")
    if args.fallback is not None and args.site is None:
        raise UserError("--fallback needs --site: the folder the missing wheels are installed into")
    out = fsutil.check_out_file(args.out, reuse=lambda _: None) if args.out else None
    modules = tuple(args.module) or {
        "train": TRAIN_MODULES,
        "run": RUN_MODULES,
        "workflow": WORKFLOW_MODULES,
        "bench": TRAIN_MODULES + WORKFLOW_MODULES,
    }.get(args.what, RUN_MODULES + WORKFLOW_MODULES)
    report = check(modules, args.site, providers(args.fallback) if args.fallback else {})
    text = json.dumps(report, indent=2) + "\n"
    if out:
        fsutil.atomic_write(out, text)
    print(text, end="")
    return 0 if report["imports"] == "ok" else 1
