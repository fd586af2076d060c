#!/usr/bin/env bash
# The 35B-A3B architecture at 6 layers on one GPU (recipe qwen35_35b_h200; docs/performance.md, "The
# 35B-A3B architecture on one H200"), everything in one unattended run:
#   1. install the wheelhouse and check imports (ci/gpu_smoke.sh install imports);
#   2. the random-init model (benchmarks.gpu_bench make-model --model Qwen3.5-35B-A3B-6L);
#   3. trainer throughput and peak memory through verl's FSDP2 engine (packed, fla) at the SHAPES below,
#      one process (the 6 B-parameter model loads once), then one profiled step: the MoE calibration
#      settings of engine/preflight/memory.py and the MFU figures;
#   4. the vLLM-rollout GRPO run with the weight sync checked after each update, its gates, the export
#      with --verify-logits and the drift (ci/gpu_smoke.sh run post);
#   5. the same run with the weight sync broken: the MoE agreement gate must fail (ci/gpu_smoke.sh no_sync).
# Usage: WHEELHOUSE=DIR [BENCH=0] [ONE_RUN=1] ci/gpu_moe.sh RECORD_DIR [--set KEY=VALUE ...] (the sets go
# to both GRPO runs; BENCH=0 leaves out stage 3). ONE_RUN=1, for an allocation too short for two GRPO runs
# of this model (~10 min each with start-up): only the control runs, keeps its checkpoint (its actor
# trains as usual; only vLLM's copy stays stale), and the export and report of stage 4 take that one.
# Each stage's output lands in RECORD_DIR as it finishes; stages.txt lists each stage with its exit status.
# ~20 min on one H200: start it detached (setsid) where a session's commands are time-limited.
set -uo pipefail
record=${1:?usage: ci/gpu_moe.sh RECORD_DIR [--set KEY=VALUE ...]}
shift
py=${PYTHON:-python3}
site=${SITE:-/tmp/site}
export RECIPE=qwen35_35b_h200 MODEL=Qwen3.5-35B-A3B-6L
model=results/gpu/qwen35-35b-a3b-6l-random
# batch/mbs/seq: 1 x 2048 first (it absorbs the fla autotuning as its warm-up), then more tokens per
# micro-batch and longer sequences: the settings the MoE memory estimate is calibrated on
SHAPES=${SHAPES:-2/1/2048,4/2/2048,4/4/2048,2/1/4096,2/2/4096}
mkdir -p "$record"
record=$(cd "$record" && pwd)
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache} NCCL_NVLS_ENABLE=0
done_stage() { echo "$1 exit $2 $(date -u +%H:%M:%S)" | tee -a "$record/stages.txt"; }
df -h . /tmp >"$record/disk.txt" 2>&1
free -g >>"$record/disk.txt" 2>&1

STAGES="install imports" bash ci/gpu_smoke.sh "$record/smoke"
code=$?
done_stage install+imports $code
[ $code -eq 0 ] || exit $code
[ -n "${WHEELHOUSE:-}" ] && export PYTHONPATH=$site:$PWD

[ -f $model/config.json ] || $py -m benchmarks.gpu_bench make-model --model $MODEL --out $model \
    >"$record/make-model.log" 2>&1
done_stage make-model $?
du -sh $model >>"$record/disk.txt" 2>&1

if [ "${BENCH:-1}" != 0 ]; then
    nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader -lms 500 \
        >"$record/bench-nvidia-smi.csv" 2>/dev/null &
    smi=$!
    $py -m benchmarks.gpu_bench run --model $model --modes verl-packed --kernels fla --shapes "$SHAPES" \
        --steps 3 --warmup 1 --profile "$record/profile" --timeout 1200 --out "$record/bench/moe.jsonl" \
        >"$record/bench.log" 2>&1
    done_stage bench $?
    kill $smi 2>/dev/null
fi

if [ "${ONE_RUN:-0}" = 1 ]; then
    NO_SYNC_CHECKPOINT=1 STAGES=no_sync bash ci/gpu_smoke.sh "$record/no_sync" "$@" >"$record/no_sync-run.log" 2>&1
    done_stage "no_sync with checkpoint (0 = gates failed, as they must)" $?
    df -h . >>"$record/disk.txt" 2>&1
    NO_SYNC_CHECKPOINT=1 STAGES=post bash ci/gpu_smoke.sh "$record/no_sync" "$@" >"$record/no_sync-post.log" 2>&1
    done_stage "export+report of the control's checkpoint (1 = its gates failed, as they must)" $?
    done_stage all 0
    exit 0
fi

STAGES=run bash ci/gpu_smoke.sh "$record/smoke" "$@" >"$record/smoke-run.log" 2>&1
done_stage smoke-run $?
df -h . >>"$record/disk.txt" 2>&1
# the export needs ~13 GB beside the 25 GB checkpoint: on a small disk the initial model goes (it is
# only needed for the drift figure)
if [ "$(df --output=avail -BG . | tail -1 | tr -dc 0-9)" -lt 16 ]; then
    rm -rf $model && export DRIFT=0 && echo "initial model removed for disk space" >>"$record/disk.txt"
fi
STAGES=post bash ci/gpu_smoke.sh "$record/smoke" "$@" >"$record/smoke-post.log" 2>&1
done_stage smoke-post $?
df -h . >>"$record/disk.txt" 2>&1
# the control needs no checkpoint; the healthy run's (25 GB) goes first on a small disk
if [ "$(df --output=avail -BG . | tail -1 | tr -dc 0-9)" -lt 16 ]; then
    rm -rf results/$RECIPE/checkpoints && echo "checkpoint removed for disk space" >>"$record/disk.txt"
fi
STAGES=no_sync bash ci/gpu_smoke.sh "$record/no_sync" "$@" >"$record/no_sync-run.log" 2>&1
done_stage "no_sync (0 = gates failed, as they must)" $?
done_stage all 0
