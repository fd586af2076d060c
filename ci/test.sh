#!/usr/bin/env bash
# The test command: sets up .venv and .venv-vllm when missing (.venv-vllm in the background, while the
# main suite runs), installs the container tools the image test needs and Slurm for the Slurm tests
# (root on Debian), then runs the whole test suite, slow end-to-end runs included: the main suite in
# .venv, then the vLLM CPU tests (tests/runtime/test_vllm_cpu.py) in .venv-vllm. The main suite runs on
# TEST_WORKERS pytest-xdist workers (default 2: its verl runs leave a core idle while they start; a
# file stays on one worker, see tests/conftest.py) and lists its 25 slowest tests. With arguments, only
# `pytest ARGS` in .venv, on one process.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source ci/bootstrap.sh
if [ $# -eq 0 ]; then
    # the vLLM stack (~3.5 GB of wheels on a cold cache) downloads and unpacks while the main suite runs:
    # it is needed only by the vLLM CPU suite, after it
    vllm_log=$(mktemp "${TMPDIR:-/tmp}/bootstrap-vllm.XXXXXX.log")
    bash ci/bootstrap.sh vllm >"$vllm_log" 2>&1 &
    vllm_env=$!
fi
if ! command -v buildah >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test: installing buildah/podman for the image build test" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        buildah podman skopeo umoci runc debootstrap >/dev/null
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    # slurmctld, slurmd and munge: tests/test_slurm.py starts them on this host (ci/slurm.sh up/down)
    bash ci/slurm.sh install
fi
if [ $# -gt 0 ]; then
    exec .venv/bin/python -m pytest "$@"
fi
main=0
.venv/bin/python -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile --durations=25 || main=$?
vllm=0
if wait "$vllm_env"; then
    .venv-vllm/bin/python -m pytest tests/runtime/test_vllm_cpu.py || vllm=$?
else
    vllm=$?
    echo "test: setting up .venv-vllm failed (exit $vllm):" >&2
    tail -20 "$vllm_log" >&2
fi
echo "test: main suite exit $main, vLLM CPU suite exit $vllm" >&2
[ "$main" = 0 ] && [ "$vllm" = 0 ]
