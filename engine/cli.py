"""`python -m engine`: compile, check, run, export and record GRPO recipes.

The recipe commands (list/show/render/preflight) live here because they are the fast path; every
other command is delegated to the module that owns it and imported only when asked for, so that
`render` and `preflight` never pay for torch, Ray or verl.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from engine.errors import ArgumentParser, boundary

# command -> (module:function taking argv and returning an exit code, one-line help)
DELEGATED: dict[str, tuple[str, str]] = {
    "run": (
        "engine.run.launcher:run_main",
        "launch a recipe through verl's main_ppo (progress, log, metrics)",
    ),
    "assets": ("engine.data.assets:cli_main", "build the tiny offline model, tokenizer and data"),
    "make-model": (
        "engine.data.random_model:cli_main",
        "write a random-init Qwen3.5 in a registry shape (GPU rehearsals, benchmarks)",
    ),
    "prepare-data": (
        "engine.data.prepare:cli_main",
        "write verl RL parquet (geo3k, gsm8k, synthetic) + manifest",
    ),
    "export": (
        "engine.records.publish:export_main",
        "export a checkpoint to verified Hugging Face safetensors",
    ),
    "provenance": ("engine.records.provenance:cli_main", "write or verify a run record"),
    "rerun": ("engine.records.rerun:rerun_main", "re-launch a run from its provenance record"),
    "matrix": (
        "engine.records.matrix:cli_main",
        "the known-good matrix: what ran where, from the kept records (and what never ran)",
    ),
    "verify-env": ("engine.env.pins:cli_main", "compare installed versions with the container pins"),
    "cluster": ("engine.run.cluster:cli_main", "bring up a multi-node Ray cluster in a Slurm job"),
    "wheelhouse": ("engine.env.wheelhouse:cli_main", "build or install an offline wheel bundle"),
    "check-imports": (
        "engine.env.imports:cli_main",
        "import what a vLLM-rollout run and the workflow import (missing wheels found in seconds)",
    ),
    "smoke-report": (
        "engine.run.smoke_report:cli_main",
        "gates and step-time split of an accelerator smoke run",
    ),
}


def _parser() -> argparse.ArgumentParser:
    # here, not at the top: delegated commands (wheelhouse install on a bare machine) need no pydantic
    from engine.recipes.args import add_recipe_args

    parser = ArgumentParser(prog="python -m engine", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("list", help="recipes with one-line descriptions")
    show = sub.add_parser("show", help="print the fully resolved recipe")
    add_recipe_args(show)
    render = sub.add_parser("render", help="compile a recipe into verl's launch")
    add_recipe_args(render)
    render.add_argument("--format", choices=["overrides", "script", "json"], default="overrides")
    pre = sub.add_parser("preflight", help="check a plan before any allocation (exit 2 on problems)")
    add_recipe_args(pre)
    pre.add_argument("--check-env", action="store_true", help="also check paths, imports and pins")
    schema = sub.add_parser("schema", help="the recipe schema (JSON Schema, or the markdown reference)")
    schema.add_argument("--format", choices=["json", "markdown"], default="json")
    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _delegate(target: str) -> Callable[[list[str]], int]:
    module_name, func_name = target.split(":")
    return getattr(importlib.import_module(module_name), func_name)


def _recipe_command(args: argparse.Namespace) -> int:
    from engine import preflight
    from engine.recipes import loader, plan

    if args.command == "schema":
        from engine.recipes import reference

        print(reference.schema_markdown() if args.format == "markdown" else reference.schema_json())
        return 0
    if args.command == "list":
        for name, description in loader.list_recipes():
            print(f"{name:<22} {description}")
        return 0
    resolved = loader.load(args.recipe, device=args.device, sets=args.sets)
    if args.command == "show":
        print(loader.to_yaml(resolved), end="")
        return 0
    compiled = plan.compile_recipe(resolved)
    if args.command == "render":
        print(plan.render(compiled, args.format), end="")
        return 0
    problems = preflight.check(compiled, check_env=args.check_env)
    for problem in problems:
        print(f"preflight: {problem}", file=sys.stderr)
    if problems:
        return 2
    print(f"preflight: ok ({resolved.name} on {resolved.cluster.device}, world size {compiled.world_size})")
    return 0


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] in DELEGATED:
        return _delegate(DELEGATED[argv[0]][0])(argv[1:])
    return _recipe_command(_parser().parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """Every `python -m engine` command, behind the one error boundary (docs/reference/errors.md)."""
    return boundary(_dispatch, sys.argv[1:] if argv is None else argv)
