"""Loading recipes: one YAML file describes one full run; device profiles layer the device defaults under it.

Layering, lowest first: `recipes/profiles/<device>.yaml`, then the `extends:` chain (base first), then
`--set` paths. Every field is typed; an unknown key anywhere is an error with a "did you mean".
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from engine import paths
from engine.errors import UserError
from engine.fsutil import UniqueKeyLoader, read_text, yaml_problem
from engine.recipes.schema import FLAT_MAPPINGS, MAPPING_FIELDS, Recipe, section_type


class _Loader(UniqueKeyLoader):
    """YAML 1.1 reads `1e-6` as a string; recipes mean the number (YAML 1.2 float syntax)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def recipe_dir() -> Path:
    """The recipes shipped with the engine: package data in a wheel, `recipes/` in a checkout."""
    packaged = paths.PACKAGE_DIR / "_recipes"
    return packaged if packaged.is_dir() else paths.SOURCE_ROOT / "recipes"


def recipe_dirs() -> list[Path]:
    """Where recipe names are looked up, first match wins: ENGINE_RECIPE_DIR (user recipes, one or
    more directories separated by os.pathsep, each holding recipes), then the shipped recipes."""
    dirs = []
    for entry in filter(None, os.environ.get("ENGINE_RECIPE_DIR", "").split(os.pathsep)):
        if not Path(entry).is_dir():
            raise UserError(f"ENGINE_RECIPE_DIR: '{entry}' is not a directory; fix or unset it")
        if not any(Path(entry).glob("*.yaml")):
            raise UserError(f"ENGINE_RECIPE_DIR: '{entry}' holds no *.yaml recipe; fix or unset it")
        dirs.append(Path(entry))
    return [*dirs, recipe_dir()]


def _recipe_files() -> dict[str, Path]:
    """name -> file of every known recipe; a user recipe hides a shipped one of the same name."""
    found: dict[str, Path] = {}
    for folder in recipe_dirs():
        for path in sorted(folder.glob("*.yaml")):
            found.setdefault(path.stem, path)
    if not found:
        where = ", ".join(str(d) for d in recipe_dirs())
        raise UserError(f"no recipes found in {where}; reinstall the engine or set ENGINE_RECIPE_DIR")
    return found


def list_recipes() -> list[tuple[str, str]]:
    rows = []
    for name, path in sorted(_recipe_files().items()):
        description = str(_read_yaml(path).get("description", "")).strip().splitlines()
        rows.append((name, description[0] if description else ""))
    return rows


def _read_yaml(path: Path) -> dict[str, Any]:
    text = read_text(path, "recipe", "pass a recipe name (see `list`) or a readable YAML file")
    try:
        data = _yaml(text)
    except yaml.YAMLError as err:
        raise UserError(f"{path}: {yaml_problem(err)}; fix the YAML") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: a recipe must be a mapping of keys, got {type(data).__name__}")
    return data


def _resolve_path(ref: str, relative_to: Path | None) -> Path:
    if ref.endswith((".yaml", ".yml")) or "/" in ref:
        path = Path(ref)
        if not path.is_absolute() and relative_to is not None and not path.exists():
            path = relative_to / path
        return path
    known = _recipe_files()
    if ref not in known:
        close = difflib.get_close_matches(ref, list(known), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f"; known: {', '.join(sorted(known))}"
        raise UserError(f"unknown recipe '{ref}'{hint}")
    return known[ref]


def _check_keys(data: dict[str, Any], model: type[BaseModel], source: str, prefix: str = "") -> None:
    """Unknown keys fail here, per layer, so the error names the file that has the typo."""
    for key, value in data.items():
        if not isinstance(key, str):
            raise UserError(f"{source}: key {key!r} under '{prefix or '<top>'}' must be a string")
        fields = model.model_fields
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise UserError(f"{source}: unknown key '{prefix}{key}'{hint}")
        sub = section_type(model, key)
        if sub is not None and key not in MAPPING_FIELDS:
            if not isinstance(value, dict):
                raise UserError(f"{source}: '{prefix}{key}' must be a mapping, got {type(value).__name__}")
            _check_keys(value, sub, source, f"{prefix}{key}.")


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _load_layers(ref: str, relative_to: Path | None, seen: tuple[Path, ...]) -> tuple[dict[str, Any], Path]:
    path = _resolve_path(ref, relative_to).resolve()
    if path in seen:
        chain = " -> ".join(p.stem for p in (*seen, path))
        raise UserError(f"{path}: 'extends' cycle ({chain}); remove one link")
    raw = _read_yaml(path)
    parent = raw.pop("extends", None)
    _check_keys(raw, Recipe, str(path))
    if parent is None:
        return raw, path
    if not isinstance(parent, str):
        raise UserError(f"{path}: 'extends' must be a recipe name or path, got {type(parent).__name__}")
    base, _ = _load_layers(parent, path.parent, (*seen, path))
    base.pop("description", None)  # a description belongs to one file only
    return _merge(base, raw), path


def parse_set(item: str) -> tuple[list[str], Any]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise UserError(f"--set '{item}': expected KEY=VALUE, e.g. --set parallel.ep=4")
    if not value.strip():  # an empty path would silently become the working directory
        raise UserError(f"--set '{item}': empty value; give one (write {key.strip()}='' for an empty string)")
    try:
        parsed = _yaml(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    return key.strip().split("."), parsed


def _apply_set(data: dict[str, Any], item: str) -> None:
    parts, value = parse_set(item)
    model: type[BaseModel] | None = Recipe
    node = data
    for depth, part in enumerate(parts):
        dotted = ".".join(parts[: depth + 1])
        last = depth == len(parts) - 1
        if model is not None:
            fixed = ("name", "devices") if model is Recipe else ()
            if part not in model.model_fields or part in fixed:
                choices = [f for f in model.model_fields if f not in fixed]
                close = difflib.get_close_matches(part, choices, n=1)
                stem = ".".join(parts[:depth])
                hint = f" (did you mean '{stem + '.' if stem else ''}{close[0]}'?)" if close else ""
                raise UserError(f"--set {item}: unknown recipe path '{dotted}'{hint}")
            section = section_type(model, part)
            if section is not None and last and part not in MAPPING_FIELDS:
                raise UserError(f"--set {item}: '{dotted}' is a section; set one of its fields")
            model = None if part in MAPPING_FIELDS else section
            if part in FLAT_MAPPINGS and not last:  # verl keys and env names are single keys
                node.setdefault(part, {})[".".join(parts[depth + 1 :])] = value
                return
        if last:
            node[part] = value
        else:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"--set {item}: '{dotted}' is not a mapping")


def _format_validation(err: ValidationError, source: str) -> str:
    problems = []
    for item in err.errors():
        loc = ".".join(str(p) for p in item["loc"])
        if item["type"] == "missing":
            problems.append(f"missing required key '{loc}'")
        else:
            given = item.get("input")
            shown = repr(given) if not isinstance(given, dict) else "a mapping"
            problems.append(f"'{loc}': {item['msg'][:1].lower() + item['msg'][1:]} (got {shown[:60]})")
    more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
    return f"{source}: " + "; ".join(problems[:3]) + more


def device_profile(device: str) -> dict[str, Any]:
    """The device's defaults layer (the first recipe directory that has one), its keys checked."""
    path = next(
        (p for d in recipe_dirs() if (p := d / "profiles" / f"{device}.yaml").exists()),
        recipe_dir() / "profiles" / f"{device}.yaml",
    )
    profile = _read_yaml(path) if path.exists() else {}
    _check_keys(profile, Recipe, str(path))
    return profile


def load(ref: str, device: str | None = None, sets: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Resolve a recipe name or YAML path for one device into a validated Recipe."""
    data, path = _load_layers(ref, Path.cwd(), ())
    devices = data.get("devices") or []
    if not isinstance(devices, list) or not devices:
        raise UserError(f"{path}: 'devices' must list at least one of gpu, npu, cpu")
    device = device or devices[0]
    if device not in devices:
        raise UserError(
            f"recipe '{path.stem}' supports devices {', '.join(map(str, devices))}; "
            f"pass --device {devices[0]}"
        )
    data = _merge(_merge(device_profile(device), data), {"name": path.stem, "cluster": {"device": device}})
    for item in sets:
        _apply_set(data, item)
    chosen = data["cluster"].get("device") if isinstance(data.get("cluster"), dict) else device
    if chosen != device:
        raise UserError(
            f"--set cluster.device={chosen} contradicts --device {device}: the device comes from "
            f"--device alone; pass --device {chosen}"
        )
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise UserError(_format_validation(err, str(path))) from None


def to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, width=110)
