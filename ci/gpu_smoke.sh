#!/usr/bin/env bash
# The GPU smoke on one GPU: verl's async vLLM rollout + FSDP2 (in place of fsdp_turbo, a visible --set)
# on a random-init Qwen3.5-0.8B-shaped model and the synthetic task, then its gates (engine smoke-report),
# the export with logit verification and the policy drift that makes the weight-sync gate meaningful.
# Usage: ci/gpu_smoke.sh RECORD_DIR [extra --set ...]. RECIPE and MODEL pick another GPU recipe and the
# registry shape make-model builds for it (default: smoke_qwen35_0p8b_h200, Qwen3.5-0.8B; the recipe's
# model.path is where the model goes). python3 holds the GPU stack, or WHEELHOUSE names a
# wheelhouse (engine wheelhouse build) installed into SITE first, with FALLBACK_WHEELS (a folder of wheels)
# for imports still missing (ci/gpu_imports.py records each). Exit status: that of the gates (1), or of
# the first failing stage.
set -uo pipefail
record=${1:?usage: ci/gpu_smoke.sh RECORD_DIR [--set KEY=VALUE ...]}
shift
py=${PYTHON:-python3}
recipe=${RECIPE:-smoke_qwen35_0p8b_h200}
run=results/$recipe
mkdir -p "$record"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
stages=" ${STAGES:-install imports run post} "  # a subset splits the smoke over several short allocations
want() { [[ $stages == *" $1 "* ]]; }
stage() { echo "== $1 $(date -u +%H:%M:%S)"; }

if [ -n "${WHEELHOUSE:-}" ] && want install; then
    stage install
    site=${SITE:-/tmp/site}
    $py -m pip freeze >"$record/target-freeze.txt"
    PYTHONPATH=$PWD $py -m engine wheelhouse install "$WHEELHOUSE" --target "$site" || exit 4
    export PYTHONPATH=$site:$PWD
    $py -m pip list --path "$site" --format=freeze >"$record/wheelhouse-installed.txt"
fi
[ -n "${WHEELHOUSE:-}" ] && export PYTHONPATH=${SITE:-/tmp/site}:$PWD
if want imports; then
    stage imports
    $py ci/gpu_imports.py "${SITE:-/tmp/site}" ${FALLBACK_WHEELS:-} | tee "$record/imports.json" | tail -5
    [ "${PIPESTATUS[0]}" -eq 0 ] || exit 5
fi

model=$(PYTHONPATH=${PYTHONPATH:-$PWD} $py -c \
    "import sys; from engine.recipes import loader; print(loader.load(sys.argv[1], 'gpu').model.path)" "$recipe")
[ -n "$model" ] || { echo "cannot read model.path of $recipe"; exit 3; }
if want run; then
stage assets
[ -f results/assets/data/synthetic/train.parquet ] || $py -m engine assets --out results/assets || exit 3
[ -f "$model/config.json" ] || $py -m benchmarks.gpu_bench make-model --model "${MODEL:-Qwen3.5-0.8B}" \
    --out "$model" || exit 3

stage run
rm -rf $run  # engine run refuses a non-empty --out: nothing may be written there before it
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader -lms 500 \
    >"$record/nvidia-smi.csv" 2>/dev/null &
smi=$!
$py -m engine run "$recipe" --device gpu --set actor.strategy=fsdp2 "$@" --out $run
code=$?
kill $smi 2>/dev/null
cp $run/run.json $run/recipe.yaml $run/metrics.jsonl $run/overrides.txt "$record/" 2>/dev/null
gzip -c $run/train.log >"$record/train.log.gz"
[ $code -eq 0 ] || { echo "run failed ($code)"; exit $code; }
fi
want post || exit 0

stage export
$py -m engine export $run/checkpoints --out $run/export --verify-logits 2>&1 | tail -15
code=$?
cp $run/export/*.json "$record/" 2>/dev/null

stage report
drift=(--drift "$model" $run/export)
[ "${DRIFT:-1}" = 0 ] && drift=()  # DRIFT=0: no initial model to compare with
$py -m engine smoke-report $run "${drift[@]}"
gates=$?
cp $run/smoke_report.json "$record/"
awk -F', ' '{gsub(/ MiB/,"",$2); if ($2+0 > m) m = $2+0} END {print "peak GPU memory (nvidia-smi): " m " MiB"}' \
    "$record/nvidia-smi.csv"
[ $code -eq 0 ] || exit $code
exit $gates
