"""The arguments that pick a recipe, defined once for every command that loads one."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from engine.recipes.levers import LEVERS, lever_names, lever_sets

DEVICES = ("gpu", "npu", "cpu")


def add_recipe_args(
    parser: argparse.ArgumentParser, devices: Sequence[str] = DEVICES, device_required: bool = False
) -> None:
    """`RECIPE [--device D] [--set KEY=VALUE ...]` (args.recipe, args.device, args.sets)."""
    parser.add_argument("recipe", help="recipe name (see `list`) or path to a YAML file")
    parser.add_argument(
        "--device",
        choices=list(devices),
        required=device_required,
        help="device profile" + ("" if device_required else " (default: recipe's)"),
    )
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe field by dotted path, e.g. parallel.ep=4 (repeatable)",
    )
    parser.add_argument(
        "--levers",
        dest="sets",
        action=_LeverSets,
        metavar="NAME[,NAME]",
        help="opt-in trainer-speed settings, as the --set items they stand for, in command-line order with "
        f"--set (later wins): {', '.join(LEVERS)} (docs/reference/trainer-levers.md)",
    )


class _LeverSets(argparse.Action):
    """`--levers fast` appends the lever's --set items where it stands: what run.json records is the sets."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values, option=None):
        sets = list(getattr(namespace, self.dest, None) or [])
        setattr(namespace, self.dest, sets + lever_sets(lever_names(str(values))))
