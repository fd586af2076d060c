#!/usr/bin/env bash
# The trainer benchmarks on one H200, unattended: stages in order of their worth to issue 31.
set -u
src=$PWD
rm -rf /tmp/work && mkdir -p /tmp/work && cd "$src" && tar --exclude=./.dev -cf - . | tar -xf - -C /tmp/work
cd /tmp/work && mkdir -p results/bench
log=/tmp/work/go.log
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu,clocks.sm,power.draw --format=csv -l 5 > results/bench/nvidia-smi.csv 2>&1 &
{
  echo "start $(date -u +%FT%TZ) commit $(cat "$src/.dev/c6/commit" 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  CHECK_IMPORTS=bench ci/gpu_chain.sh /tmp/wh/wh-train /tmp/wh/wh-workflow /tmp/wh/wh-levers -- \
    --profile profiles/h200 --keep-going bench_levers --config 'bench_stages=[moe]'
  echo "moe exit $? $(date -u +%FT%TZ)"
  for stage in dense numerics moe-padded; do
    CHECK_IMPORTS=none ci/gpu_chain.sh -- --profile profiles/h200 --keep-going bench_levers --config "bench_stages=[$stage]"
    echo "$stage exit $? $(date -u +%FT%TZ)"
  done
  echo "all done $(date -u +%FT%TZ)"
} > "$log" 2>&1
