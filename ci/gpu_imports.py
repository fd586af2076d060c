"""Import what a vLLM-rollout GRPO run imports; add a wheel for each module that is still missing.

Usage: python3 ci/gpu_imports.py SITE [FALLBACK_WHEEL_DIR]. The wheelhouse of containers/wheelhouse-gpu.txt
is meant to be complete; when an import fails with ModuleNotFoundError, the wheel providing that module
is taken from FALLBACK_WHEEL_DIR (other wheels of the same lock), installed into SITE and the imports are
tried again. Every addition is printed as JSON, so the selection file can be corrected from the record.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

MODULES = [
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
    "fla.ops.gated_delta_rule",
    "fla.modules.causal_conv1d",
    "engine.kernels",
    "engine.verl_ext",
]


def providers(wheel_dir: Path) -> dict[str, Path]:
    """top-level import name -> the wheel that ships it."""
    found: dict[str, Path] = {}
    for wheel in sorted(wheel_dir.glob("*.whl")):
        for name in zipfile.ZipFile(wheel).namelist():
            top = name.split("/", 1)[0]
            if not top.endswith((".dist-info", ".data")):
                found.setdefault(top.removesuffix(".py"), wheel)
    return found


def main(argv: list[str]) -> int:
    site = argv[0]
    extra = providers(Path(argv[1])) if len(argv) > 1 else {}
    added: list[str] = []
    code = f"import importlib\nfor m in {MODULES!r}: importlib.import_module(m)"
    for _ in range(25):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
        if done.returncode == 0:
            print(json.dumps({"imports": "ok", "added": added}))
            return 0
        missing = re.findall(r"No module named '([^'.]+)", done.stderr)
        wheel = extra.get(missing[-1]) if missing else None
        if wheel is None:
            print(done.stderr[-3000:])
            print(json.dumps({"imports": "failed", "added": added, "missing": missing[-1:]}))
            return 1
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site]
        subprocess.run([*pip, str(wheel)], check=True)
        added.append(wheel.name)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
