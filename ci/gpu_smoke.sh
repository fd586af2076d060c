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
# The opt-in stage no_sync (STAGES=no_sync, its own RECORD_DIR) is the control: the same run with the
# weight sync broken (ENGINE_TEST_BREAK=no_weight_sync), no checkpoint; it exits 0 when the gates fail, as
# they must, and 6 when they pass (they cannot see a broken sync). NO_SYNC_CHECKPOINT=1 keeps its
# checkpoint (the actor trains as usual; only the rollout's copy stays stale) and points the post stage
# at that run: one GRPO run then gives both the control and an exported trained checkpoint.
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

# grpo_run OUT [--set ...]: one engine run of the recipe with nvidia-smi sampling, its records kept
grpo_run() {
    local out=$1 code smi
    shift
    rm -rf "$out"  # engine run refuses a non-empty --out: nothing may be written there before it
    nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader -lms 500 \
        >"$record/nvidia-smi.csv" 2>/dev/null &
    smi=$!
    $py -m engine run "$recipe" --device gpu --set actor.strategy=fsdp2 "$@" --out "$out"
    code=$?
    kill $smi 2>/dev/null
    cp "$out"/run.json "$out"/recipe.yaml "$out"/metrics.jsonl "$out"/overrides.txt "$record/" 2>/dev/null
    gzip -c "$out"/train.log >"$record/train.log.gz"
    return $code
}

model=$(PYTHONPATH=${PYTHONPATH:-$PWD} $py -c \
    "import sys; from engine.recipes import loader; print(loader.load(sys.argv[1], 'gpu').model.path)" "$recipe")
[ -n "$model" ] || { echo "cannot read model.path of $recipe"; exit 3; }
if want run || want no_sync; then
    stage assets
    [ -f results/assets/data/synthetic/train.parquet ] || $py -m engine assets --out results/assets || exit 3
    [ -f "$model/config.json" ] || $py -m benchmarks.gpu_bench make-model --model "${MODEL:-Qwen3.5-0.8B}" \
        --out "$model" || exit 3
fi
if want run; then
    stage run
    grpo_run $run "$@"
    code=$?
    [ $code -eq 0 ] || { echo "run failed ($code)"; exit $code; }
fi

if want no_sync; then
    stage no_sync
    no_save=(--set trainer.save_freq=-1)
    [ "${NO_SYNC_CHECKPOINT:-0}" = 1 ] && no_save=()
    ENGINE_TEST_BREAK=no_weight_sync grpo_run ${run}_no_sync "$@" "${no_save[@]}"
    echo "run exit $? (3: a gate failed)"
    $py -m engine smoke-report ${run}_no_sync >"$record/report.txt" 2>&1
    gates=$?
    cp ${run}_no_sync/smoke_report.json "$record/" 2>/dev/null
    tail -12 "$record/report.txt"
    [ $gates -eq 1 ] && { echo "gates failed, as they must"; exit 0; }
    echo "gates exit $gates: the broken sync was not caught"
    exit 6
fi
want post || exit 0
[ "${NO_SYNC_CHECKPOINT:-0}" = 1 ] && run=${run}_no_sync

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
