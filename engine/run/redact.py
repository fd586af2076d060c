"""Credentials never reach a file the project writes: the allowlist of recorded variables and the scrubber.

Used by provenance (records), launch (train.log, run.json, launch.sh) and anything else that writes
what a user's environment or a tool's output may contain.
"""

from __future__ import annotations

import os
import re
from typing import Any

REDACTED = "***"
ENV_ALLOW = re.compile(
    r"^(HCCL_|NCCL_|VLLM_|RAY_|VERL_|TORCH_|PYTORCH_|GLOO_|HF_HUB_OFFLINE$|TRANSFORMERS_OFFLINE$|PYTHONPATH$|"
    r"CUDA_VISIBLE_DEVICES$|ASCEND_RT_VISIBLE_DEVICES$|ASCEND_VISIBLE_DEVICES$|HIP_VISIBLE_DEVICES$|"
    r"NVIDIA_VISIBLE_DEVICES$|OMP_NUM_THREADS$|TOKENIZERS_PARALLELISM$|WANDB_MODE$|ENGINE_)"
)
# A secret word as a whole part of a variable name: HF_TOKEN, WANDB_API_KEY, DB_PASSWORD — but not
# TOKENIZERS_PARALLELISM or MAX_TOKENS, whose values are settings that must stay readable.
SECRET_NAME = re.compile(
    r"(?i)(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIALS?|AUTH|COOKIE|KEY)(_|$)"
)
_PATTERNS = [
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s:@'\"]+(?::[^/\s@'\"]*)?@"), r"\1" + REDACTED + "@"),
    (
        re.compile(r"\b(hf_[A-Za-z0-9]{16,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})"),
        REDACTED,
    ),
    (re.compile(r"\b(sk-[A-Za-z0-9_-]{16,}|AKIA[0-9A-Z]{16}|xox[abprs]-[A-Za-z0-9-]{10,})"), REDACTED),
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}"), r"\1 " + REDACTED),
    (
        re.compile(
            # name=value where the name ENDS in a secret word (`max_num_batched_tokens: 8192` is a setting)
            r"(?i)\b([A-Z0-9_.-]*(?:TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|ACCESS_?KEY))(['\"]?\s*[=:]\s*['\"]?)"
            r"(?![-+]?\d[\d.eE+-]*(?:[\s'\",}]|$))([^\s'\",}]+)"  # a number is a metric, not a secret
        ),
        r"\1\2" + REDACTED,
    ),
]


def secret_values(env: dict[str, str] | os._Environ | None = None) -> list[str]:
    """Values of credential-named variables, longest first (so a value inside another is not half-masked)."""
    env = os.environ if env is None else env
    return sorted({v for k, v in env.items() if SECRET_NAME.search(k) and len(v) >= 6}, key=len, reverse=True)


def scrub(text: str, env: dict[str, str] | None = None, secrets: list[str] | None = None) -> str:
    """Remove credentials from text: secret env values anywhere, URL userinfo, token shapes, KEY=value."""
    for value in secret_values(env) if secrets is None else secrets:
        text = text.replace(value, REDACTED)
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    return text


def scrub_obj(value: Any, env: dict[str, str] | None = None) -> Any:
    """`scrub` applied to every string of a JSON-like structure; values under secret-looking keys masked."""
    if isinstance(value, str):
        return scrub(value, env)
    if isinstance(value, list):
        return [scrub_obj(v, env) for v in value]
    if isinstance(value, dict):
        return {
            k: REDACTED if SECRET_NAME.search(str(k)) and isinstance(v, str) else scrub_obj(v, env)
            for k, v in value.items()
        }
    return value


def redact_env(env: dict[str, str] | os._Environ) -> dict[str, str]:
    """The allowlisted part of an environment, with credential-like names masked and values scrubbed."""
    env = dict(env)
    kept = {}
    for key in sorted(env):
        if ENV_ALLOW.match(key):
            kept[key] = REDACTED if SECRET_NAME.search(key) else scrub(env[key], env)
    return kept
