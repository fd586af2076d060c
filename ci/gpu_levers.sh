#!/usr/bin/env bash
# The trainer levers on one GPU, unattended (docs/reference/trainer-levers.md, "The GPU run"): install the carried
# wheelhouses, build the random-init models, bench each lever (one process group per lever and repeat),
# compare with the regression baselines, check the levers' numerics on the GPU. Every stage logs to OUT
# and appends "NAME exit CODE TIME" to OUT/stages.txt; a failed stage does not stop the next.
# Usage: ci/gpu_levers.sh OUT WHEELHOUSE...      e.g. ci/gpu_levers.sh results/levers wh-gpu wh-levers
# Environment: STAGES (default moe,dense,moe-padded,numerics), REPEATS (3), STEPS (3), SITE (/tmp/site),
# MODELS (results/gpu); SMALL=1 builds the tiny models and shapes instead (a CPU rehearsal of the script).
set -uo pipefail
out=${1:?usage: ci/gpu_levers.sh OUT WHEELHOUSE...}
shift
site=${SITE:-/tmp/site}
models=${MODELS:-results/gpu}
stages=",${STAGES:-moe,dense,moe-padded,numerics},"
repeats=${REPEATS:-3}
steps=${STEPS:-3}
mkdir -p "$out" "$models"
log() { echo "$1 $(date -u +%H:%M:%S)" >>"$out/stages.txt"; }
stage() { # NAME CMD...: run CMD with its output in OUT/NAME.log, record its exit
    local name=$1 code=0
    shift
    log "$name start"
    "$@" >"$out/$name.log" 2>&1 || code=$?
    log "$name exit $code"
    return 0
}
want() { [[ $stages == *",$1,"* ]]; }

for wheelhouse in "$@"; do
    stage "install-$(basename "$wheelhouse")" python3 -m engine wheelhouse install "$wheelhouse" --target "$site"
done
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DO_NOT_TRACK=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/results/triton-cache}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/results/inductor-cache} # torchao's step
python3 -m pip freeze --path "$site" >"$out/wheelhouse-installed.txt" 2>/dev/null || true
python3 -c "import torch, transformers, verl, torchao; print(torch.__version__, transformers.__version__, \
verl.__version__, torchao.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" \
    >"$out/stack.txt" 2>&1

moe=$models/qwen35-35b-a3b-6l-random dense=$models/qwen35-0p8b-random
make=(python3 -m engine make-model) kernels=fla
moe_shapes=4/2/2048,4/4/2048,8/4/2048 one_shape=4/4/2048 # one_shape: today's rows' batch and sequence
if [ "${SMALL:-0}" = 1 ]; then # the same commands at tiny sizes, on a CPU
    make+=(--small) kernels=torch moe_shapes=2/1/32,2/2/32,4/2/32 one_shape=2/2/32
fi
[ -f "$moe/config.json" ] || stage make-moe "${make[@]}" --model Qwen3.5-35B-A3B-6L --out "$moe"
[ -f "$dense/config.json" ] || stage make-dense "${make[@]}" --model Qwen3.5-0.8B --out "$dense"

bench=(python3 -m benchmarks.gpu_bench run --kernels "$kernels" --steps "$steps" --repeats "$repeats")
if [ "${SMALL:-0}" = 1 ]; then bench+=(--warmup 1); fi
# 1. the 35B-A3B architecture at 6 layers: every lever (foreach is torch's default on a GPU: `baseline`),
#    packed, micro-batches 2 and 4 and two micro-batches per step (where no-sync can act)
want moe && stage moe "${bench[@]}" --model "$moe" --modes verl-packed --shapes "$moe_shapes" \
    --levers baseline,fused,no-reshard,no-sync,bf16-sr,fast,fast-bf16+no-sync --out "$out/moe.jsonl"
# 2. the dense 0.8B through verl against plain FSDP2 (the ceiling, fused AdamW of its own)
want dense && stage dense "${bench[@]}" --model "$dense" --modes plain,verl-packed --shapes "$one_shape" \
    --levers baseline,fast,fast-bf16 --out "$out/dense.jsonl"
# 3. packing on the MoE: padded rows beside the packed ones of stage 1
want moe-padded && stage moe-padded "${bench[@]}" --model "$moe" --modes verl-padded \
    --shapes "$one_shape" --levers baseline,fast-bf16 --out "$out/moe-padded.jsonl"
# 4. the levers' numerics through verl's engine on the GPU (dense 0.8B; the CPU check uses the tiny MoE)
want numerics && stage numerics python3 -m benchmarks.trainer_numerics --model "$dense" \
    --seq "${NUMERICS_SEQ:-512}" --lr "${NUMERICS_LR:-1e-4}" --out "$out/numerics.jsonl"

for rows in "$out"/moe.jsonl "$out"/dense.jsonl "$out"/moe-padded.jsonl; do
    [ -f "$rows" ] && stage "compare-$(basename "$rows" .jsonl)" python3 -m benchmarks.compare "$rows" \
        --json "$out/compare-$(basename "$rows" .jsonl).json"
done
log "all done"
