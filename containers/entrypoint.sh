#!/bin/sh
# Image entrypoint: load the CANN environment where there is one, check the installed versions against
# the pins baked into the image, then run the command. ENGINE_VERIFY_ENV=warn reports drift without
# failing; ENGINE_VERIFY_ENV=off skips the check.
set -e
for env_file in /usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/nnal/atb/set_env.sh; do
    if [ -f "$env_file" ]; then
        # shellcheck disable=SC1090
        . "$env_file"
    fi
done
case "${ENGINE_VERIFY_ENV:-strict}" in
    off | 0) ;;
    warn) python -m engine verify-env --allow-drift --output "${ENGINE_VERIFY_ENV_RECORD:-/tmp/verify-env.json}" >&2 ;;
    *) python -m engine verify-env --output "${ENGINE_VERIFY_ENV_RECORD:-/tmp/verify-env.json}" >&2 ;;
esac
exec "$@"
