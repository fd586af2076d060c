"""Checks on a plan before any allocation: what verl, FSDPTurbo or the hardware would reject hours later.

Each check is a small function of the plan returning problems (one line each, naming the key and the
fix). `check_env` adds what needs the machine: paths, imports, patch targets, versions.
"""

from __future__ import annotations

from engine.errors import UserError
from engine.preflight.env_checks import ENV_CHECKS, check_paths
from engine.preflight.plan_checks import PLAN_CHECKS, check_rollout_env
from engine.recipes.plan import Plan

__all__ = ["check", "check_paths", "check_rollout_env", "require_ok"]


def check(plan: Plan, check_env: bool = False) -> list[str]:
    checks = PLAN_CHECKS + (ENV_CHECKS if check_env else [])
    return [problem for run in checks for problem in run(plan)]


def require_ok(plan: Plan, paths: bool = False, rollout_env: bool = False) -> None:
    """For commands that launch or orchestrate: the plan checks (and the paths, and whether this
    environment can run the rollout engine) as one UserError."""
    problems = check(plan) + (check_paths(plan) if paths else [])
    problems += check_rollout_env(plan) if rollout_env else []
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise UserError(
            "preflight: " + "; ".join(problems[:3]) + more + "; fix the recipe or --set (see `preflight`)"
        )
