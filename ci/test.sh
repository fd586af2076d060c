#!/usr/bin/env bash
# The test command: sets up .venv when missing, installs the container tools the image test needs
# (root on Debian), then runs the whole test suite, slow end-to-end runs included.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source ci/bootstrap.sh
if ! command -v buildah >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test: installing buildah/podman for the image build test" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        buildah podman skopeo umoci runc debootstrap >/dev/null
fi
exec .venv/bin/python -m pytest "$@"
