#!/usr/bin/env bash
# Workflow targets on a GPU machine without a package index (docs/guide/workflow.md): install the carried
# wheelhouses (engine wheelhouse build), check the imports, run Snakemake. ci/gpu_chain.sh WHEELHOUSE... -- ARGS:
#   ci/gpu_chain.sh wh-gpu wh-workflow -- --profile profiles/h200 run_qwen35_35b
#   CHECK_IMPORTS=bench ci/gpu_chain.sh wh-gpu wh-workflow wh-levers -- --profile profiles/h200 bench_levers
# CHECK_IMPORTS picks what the import check covers (engine check-imports --what; default all: the vLLM
# rollout too): `bench` for a wheelhouse built from containers/wheelhouse-gpu.txt alone, `none` to skip it
# (a later target on a machine already checked).
set -euo pipefail
site=${SITE:-/tmp/site}
until [ "${1:---}" = -- ]; do python3 -m engine wheelhouse install "$1" --target "$site"; shift; done
shift
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/results/triton-cache}  # the smoke warms it for the run
# autotuning timings kept beside the kernels: every later process (a bench group, the run after the smoke)
# takes the first one's choice instead of timing every configuration again
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/results/inductor-cache}  # torchao's step
mkdir -p results
check=${CHECK_IMPORTS:-all}
[ "$check" = none ] || python3 -m engine check-imports --what "$check" --site "$site" --out results/imports.json
exec python3 -m snakemake "$@"
