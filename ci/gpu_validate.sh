#!/usr/bin/env bash
# Everything docs/performance.md and docs/containers.md report for one GPU, in one unattended run:
#   1. install the wheelhouse and check imports (ci/gpu_smoke.sh install imports);
#   2. fla's gated-delta-rule gradients against the fp32 torch reference with the pinned Triton, and with
#      the machine's own Triton (whether the Triton override is still needed; benchmarks.gdn_grad), each
#      while a GRPO run starts up (Ray and vLLM: minutes of CPU work, the GPU idle);
#   3. the vLLM-rollout GRPO smoke, its export with --verify-logits and its gates (ci/gpu_smoke.sh);
#   4. the same run with the weight sync broken (ENGINE_TEST_BREAK=no_weight_sync): the agreement gate
#      must fail, which shows it can;
#   5. the trainer throughput rows of `python -m benchmarks.gpu_bench`, REPEATS times (medians, not single runs).
# Usage: WHEELHOUSE=DIR [GPUS=N] ci/gpu_validate.sh RECORD_DIR [--set KEY=VALUE ...] (the sets go to both
# GRPO runs). GPUS=2 or more runs the upstream smoke's parallel layout: the actor sharded over N GPUs
# (parallel.fsdp=N) and vLLM at tensor-parallel 2, and the trainer rows over N GPUs.
# Each stage's output lands in RECORD_DIR as it finishes, so a run cut short still leaves what it
# measured; stages.txt lists each stage with its exit status. It runs for ~20 min on one H200 with warm
# disks: start it detached (setsid) where a session's commands are time-limited.
set -uo pipefail
record=${1:?usage: ci/gpu_validate.sh RECORD_DIR [--set KEY=VALUE ...]}
shift
py=${PYTHON:-python3}
site=${SITE:-/tmp/site}
model=results/gpu/qwen35-0p8b-random
gpus=${GPUS:-1}
if [ "$gpus" -gt 1 ]; then
    set -- --set parallel.fsdp="$gpus" --set parallel.rollout_tp=2 --set cluster.devices_per_node="$gpus" "$@"
fi
mkdir -p "$record"
record=$(cd "$record" && pwd)
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
done_stage() { echo "$1 exit $2 $(date -u +%H:%M:%S)" | tee -a "$record/stages.txt"; }

STAGES="install imports" bash ci/gpu_smoke.sh "$record/smoke"
code=$?
done_stage install+imports $code
[ $code -eq 0 ] || exit $code
export PYTHONPATH=$site:$PWD

# 2. gradients with the pinned pairing (Triton 3.7.1 + fla): small, so it runs while the smoke's Ray and
#    vLLM start (minutes of CPU work before the first GPU step); it also fills the Triton cache
$py -m benchmarks.gdn_grad >"$record/gdn_grad-pinned.json" 2>"$record/gdn_grad-pinned.err" &
grad=$!

# 3. the smoke (assets, model, run, export --verify-logits, gates)
STAGES="run post" bash ci/gpu_smoke.sh "$record/smoke" "$@"
done_stage smoke $?
wait $grad
done_stage gdn_grad-pinned $?

# 2b. fla over the machine's own Triton (torch's pin): refused, then forced; also during a start-up
machine_grad() {
    rm -rf /tmp/fla-only
    $py -m pip install -q --no-index --no-deps --target /tmp/fla-only \
        "$WHEELHOUSE"/flash_linear_attention-*.whl "$WHEELHOUSE"/fla_core-*.whl || return 1
    for guard in "" --bypass-guard; do
        PYTHONPATH=/tmp/fla-only:$PWD $py -m benchmarks.gdn_grad $guard \
            >>"$record/gdn_grad-machine-triton.json" 2>>"$record/gdn_grad-machine-triton.err"
    done
}
grad=
if [ -n "${WHEELHOUSE:-}" ]; then
    machine_grad &
    grad=$!
fi

# 4. the same run with the weight sync broken: its gates must fail
STAGES=no_sync bash ci/gpu_smoke.sh "$record/no_sync" "$@" >"$record/no_sync-run.log" 2>&1
done_stage "no_sync (0 = gates failed, as they must)" $?
if [ -n "$grad" ]; then
    wait $grad
    done_stage gdn_grad-machine-triton $?
fi

# 5. trainer throughput rows, repeated
for rep in $(seq 1 "${REPEATS:-3}"); do
    $py -m benchmarks.gpu_bench run --model $model --kernels fla --steps 3 --gpus "$gpus" \
        --out "$record/bench/rep$rep.jsonl" >"$record/bench-rep$rep.log" 2>&1
    done_stage "bench rep $rep" $?
done
done_stage all 0
