"""A shaped reward so that GRPO learns something from a random-init model.

Exact-match scorers (verl's gsm8k one) give every sample of a random model 0, so every GRPO group has
equal rewards, zero advantages and zero gradient: the run "trains" without moving a weight. This score
keeps an exact answer clearly on top (1.0) and gives strictly smaller, continuous partial credit
(at most 0.5) for the answer's format and digits, which differs between samples of one group.
"""

from __future__ import annotations

import re
from typing import Any

EXACT = 1.0
MARKER_CREDIT = 0.2  # "####" present
ANSWER_CREDIT = 0.2  # the right number appears somewhere
DIGIT_CREDIT = 0.1  # times the fraction of digit characters in the response
_NUMBER = re.compile(r"-?\d+")


def extract_answer(text: str) -> str | None:
    """The number after the last '####', or None when there is none."""
    if "####" not in text:
        return None
    match = _NUMBER.search(text.rsplit("####", 1)[1])
    return match.group(0) if match else None


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None
) -> float:
    """verl custom_reward_function signature; exact answer 1.0, otherwise partial credit below 0.51."""
    del data_source, extra_info
    truth = str(ground_truth).strip()
    if extract_answer(solution_str) == truth:
        return EXACT
    score = 0.0
    if "####" in solution_str:
        score += MARKER_CREDIT
    if truth in _NUMBER.findall(solution_str):
        score += ANSWER_CREDIT
    if solution_str:
        digits = sum(ch.isdigit() for ch in solution_str)
        score += DIGIT_CREDIT * digits / len(solution_str)
    return round(score, 6)
