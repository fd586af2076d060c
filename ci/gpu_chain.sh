#!/usr/bin/env bash
# A workflow target on a GPU machine without a package index (docs/guide/workflow.md, "One H200"): install the
# carried wheelhouses (engine wheelhouse build; docs/reference/containers.md), check the imports, run Snakemake.
# Usage: ci/gpu_chain.sh WHEELHOUSE... -- SNAKEMAKE_ARGS, e.g.
#   ci/gpu_chain.sh wh-gpu wh-workflow -- --profile profiles/h200 run_qwen35_35b
set -euo pipefail
site=${SITE:-/tmp/site}
until [ "${1:---}" = -- ]; do python3 -m engine wheelhouse install "$1" --target "$site"; shift; done
shift
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/results/triton-cache}  # the smoke warms it for the run
mkdir -p results
python3 -m engine check-imports --site "$site" --out results/imports.json
exec python3 -m snakemake "$@"
