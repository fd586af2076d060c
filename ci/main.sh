#!/usr/bin/env bash
# The main job on the embedded default: set up .venv, build the tiny offline assets, train tiny_cpu
# with verl's real GRPO loop on the CPU (2 steps), export the checkpoint and reload it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source ci/bootstrap.sh
py=.venv/bin/python
$py -m engine preflight tiny_cpu --device cpu
rm -rf results/tiny_cpu  # a fresh run each time: resume and export never mix two invocations
$py -m engine assets --out results/assets
$py -m engine run tiny_cpu --device cpu --out results/tiny_cpu
$py -m engine export results/tiny_cpu/checkpoints --out results/tiny_cpu/export
$py - <<'PY'
from transformers import AutoModelForImageTextToText
model = AutoModelForImageTextToText.from_pretrained("results/tiny_cpu/export")
print(f"main: exported model reloads ({sum(p.numel() for p in model.parameters()):,} parameters)")
PY
