"""The name recipes give as `reward.custom_function` (`engine.rewards:compute_score`); verl loads this
file by path in its reward workers. The reward itself is `engine.runtime.rewards`."""

from engine.runtime.rewards import compute_score, extract_answer

__all__ = ["compute_score", "extract_answer"]
