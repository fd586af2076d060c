#!/usr/bin/env bash
# Creates the project environment in .venv/ at the repo root when it is missing or stale, from the
# pinned CPU stack (ci/constraints-cpu.txt). Sourced by ci/main.sh and ci/test.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

stamp=.venv/.constraints
if [ -x .venv/bin/python ] && cmp -s ci/constraints-cpu.txt "$stamp" && cmp -s pyproject.toml .venv/.pyproject; then
    return 0 2>/dev/null || exit 0
fi

echo "bootstrap: creating .venv (pinned CPU stack: torch 2.13.0+cpu, verl 0.9.1, ray, snakemake)" >&2
python3 -m venv .venv
pip_args=(--disable-pip-version-check --progress-bar off)
# A local wheel directory (this machine keeps the CPU torch wheel there) is used when present.
[ -d /opt/wheels ] && pip_args+=(--find-links /opt/wheels)
.venv/bin/pip install "${pip_args[@]}" -q --upgrade pip
.venv/bin/pip install "${pip_args[@]}" -q -c ci/constraints-cpu.txt torch
.venv/bin/pip install "${pip_args[@]}" -q -c ci/constraints-cpu.txt -e '.[verl,workflow,dev]'
cp ci/constraints-cpu.txt "$stamp"
cp pyproject.toml .venv/.pyproject
echo "bootstrap: .venv ready" >&2
