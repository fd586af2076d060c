"""The compiled plans against the upstream scripts, Hydra's own grammar and verl's own config schema."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.recipes import hydra, loader, plan
from tests.conftest import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "upstream"

# fixture (argv of the upstream script, captured by running it) -> (recipe, device, --set)
UPSTREAM = {
    "qwen35_27b_gpu": ("qwen35_27b", "gpu", []),
    "qwen35_27b_npu": ("qwen35_27b", "npu", []),
    "qwen35_27b_gpu_cp2": ("qwen35_27b", "gpu", ["parallel.cp=2"]),
    "qwen35_27b_npu_cp2": ("qwen35_27b", "npu", ["parallel.cp=2"]),
    "qwen35_35b_gpu": ("qwen35_35b", "gpu", []),
    "qwen35_35b_npu": ("qwen35_35b", "npu", []),
    "qwen35_35b_gpu_cp2": ("qwen35_35b", "gpu", ["parallel.cp=2"]),
    "qwen35_35b_npu_cp2": ("qwen35_35b", "npu", ["parallel.cp=2"]),
    "smoke_qwen35_0p8b_gpu": ("smoke_qwen35_0p8b", "gpu", []),
    "smoke_qwen35_2b_npu": ("smoke_qwen35_2b", "npu", []),
}
# Deliberate deviations (docs/reference/deviations.md): paths, names, and the checkpointing fixes.
ALLOWED = {
    "data.train_files",
    "data.val_files",
    "actor_rollout_ref.model.path",
    "trainer.project_name",
    "trainer.experiment_name",
    "trainer.save_freq",
    "trainer.default_local_dir",
    "trainer.resume_mode",
    "trainer.resume_from_path",
    "trainer.max_actor_ckpt_to_keep",
    "actor_rollout_ref.actor.checkpoint.save_contents",
}
NPU_ENV = {
    "HCCL_CONNECT_TIMEOUT": "1500",
    "HCCL_HOST_SOCKET_PORT_RANGE": "60000-60050",
    "HCCL_NPU_SOCKET_PORT_RANGE": "61000-61050",
    "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1",
}

PARSER = OverridesParser.create()


def parsed(lines: list[str]) -> dict[str, object]:
    result = {}
    for override in PARSER.parse_overrides(lines):
        assert override.key_or_group not in result, f"{override.key_or_group} given twice"
        result[override.key_or_group] = override.value()
    return result


def every_plan():
    for path in sorted(loader.recipe_dir().glob("*.yaml")):
        for device in loader.load(path.stem).devices:
            for sets in ([], ["parallel.cp=2"]) if device != "cpu" else ([],):
                yield plan.compile_recipe(loader.load(path.stem, device, sets))


@pytest.mark.parametrize("fixture", sorted(UPSTREAM))
def test_overrides_match_upstream_script(fixture: str) -> None:
    name, device, sets = UPSTREAM[fixture]
    compiled = plan.compile_recipe(loader.load(name, device, sets))
    ours = parsed(compiled.overrides)
    theirs = parsed((FIXTURES / f"{fixture}.argv").read_text().splitlines())
    keys = (ours.keys() | theirs.keys()) - ALLOWED
    missing, extra = sorted(keys - ours.keys()), sorted(keys - theirs.keys())
    assert not missing and not extra, f"missing {missing}, extra {extra}"
    differing = {k: (ours[k], theirs[k]) for k in keys if ours[k] != theirs[k]}
    assert not differing
    # the checkpointing fixes are in place: something is saved, explicitly, and resumable
    assert ours["trainer.save_freq"] > 0 and theirs["trainer.save_freq"] == -1
    assert "trainer.resume_from_path" not in ours and ours["trainer.resume_mode"] == "auto"
    for key, value in (NPU_ENV if device == "npu" else {}).items():
        assert compiled.env[key] == value


def test_cp_block_follows_the_model_family() -> None:
    dense = plan.compile_recipe(loader.load("qwen35_27b", "gpu", ["parallel.cp=2"]))
    moe = plan.compile_recipe(loader.load("qwen35_35b", "gpu", ["parallel.cp=2"]))
    key = "actor_rollout_ref.ref.fsdp_config.turbo_config.module_patches"
    assert dense.value(key)[0]["target"].endswith("qwen3_5.modeling_qwen3_5.Qwen3_5Model.forward")
    assert moe.value(key)[0]["target"].endswith("qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeModel.forward")
    no_cp = plan.compile_recipe(loader.load("qwen35_35b", "gpu"))
    assert not [o for o in no_cp.overrides if "cp_plan" in o or "module_patches" in o]


def test_every_override_round_trips_through_hydra_grammar() -> None:
    kinds = {"": OverrideType.CHANGE, "+": OverrideType.ADD, "++": OverrideType.FORCE_ADD}
    checked = 0
    for compiled in every_plan():
        for entry in compiled.entries:
            (override,) = PARSER.parse_overrides([entry.text])
            assert override.key_or_group == entry.key
            assert override.type == kinds[entry.prefix], entry.text
            assert override.value() == entry.value, entry.text
            checked += 1
    assert checked > 500


@pytest.mark.parametrize(
    "value",
    [
        "plain",
        "True",
        "null",
        "1e-6",
        "42",
        "has space",
        "quote'in",
        "back\\slash",
        "glob.{*}",
        "a:b",
        "$HOME/x",
        "-lead",
        ["x.{*}", "y"],
        {"model.layers.{*}": {}, "k,=:": [1, 2.5, None, True]},
        [{"target_functions": ["a.b"], "type": "t"}],
    ],
)
def test_hydra_value_round_trips_awkward_values(value: object) -> None:
    text = hydra.Override("k", value).text
    (override,) = PARSER.parse_overrides([text])
    assert override.value() == value, text


def test_overrides_are_accepted_by_verl_config_schema() -> None:
    """Hydra composes verl's own ppo_trainer config with our overrides: '+' only where keys are new."""
    verl = pytest.importorskip("verl")
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    cases = [("qwen35_35b", "npu", ["parallel.cp=2"]), ("qwen35_27b", "gpu", []), ("tiny_cpu", "cpu", [])]
    for name, device, sets in cases:
        compiled = plan.compile_recipe(loader.load(name, device, sets))
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            cfg = compose(config_name="ppo_trainer", overrides=compiled.overrides)
        assert cfg.trainer.n_gpus_per_node == compiled.recipe.cluster.devices_per_node
        assert cfg.actor_rollout_ref.actor.strategy == compiled.recipe.actor.strategy
        if compiled.recipe.actor.strategy == "fsdp_turbo":
            turbo = cfg.actor_rollout_ref.ref.fsdp_config.turbo_config
            assert turbo.distributed.fully_shard_parallel_size == compiled.recipe.parallel.fsdp
            assert "model.language_model.layers.{*}" in turbo.distributed.fsdp_plan.apply_modules


def test_script_format_is_runnable_bash_that_passes_the_same_argv(tmp_path: Path) -> None:
    import subprocess

    compiled = plan.compile_recipe(loader.load("qwen35_35b", "npu"))
    script = tmp_path / "launch.sh"
    script.write_text(plan.render(compiled, "script"))
    fake = tmp_path / "python3"
    fake.write_text(
        '#!/bin/sh\nshift 2\nfor a in "$@"; do printf "%s\\n" "$a"; done\nenv | grep ^HCCL_ | sort\n'
    )
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "PYTHON": str(fake)}
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, check=True).stdout
    lines = out.splitlines()
    assert lines[: len(compiled.overrides)] == compiled.overrides
    assert "HCCL_CONNECT_TIMEOUT=1500" in lines


def test_json_format_carries_digest() -> None:
    import json

    compiled = plan.compile_recipe(loader.load("tiny_cpu"))
    doc = json.loads(plan.render(compiled, "json"))
    assert doc["overrides"] == compiled.overrides
    assert doc["overrides_sha256"] == compiled.digest()
    assert "engine.verl_ext" in doc["env"]["VERL_USE_EXTERNAL_MODULES"]


_texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)


_keys = st.text(alphabet="abcXYZ019_-/+.$%*@?|\\()[]{}:=, ", min_size=1, max_size=12).filter(
    lambda k: not hydra._NON_STRING.fullmatch(k)
)


@settings(max_examples=300, deadline=None)
@given(value=st.one_of(_texts, st.lists(_texts, max_size=3), st.dictionaries(_keys, _texts, max_size=3)))
def test_any_string_round_trips_through_hydra(value: object) -> None:
    text = hydra.Override("k", value).text
    try:
        (override,) = PARSER.parse_overrides([text])
    except Exception as err:  # pragma: no cover - the assertion message is the point
        raise AssertionError(f"Hydra cannot parse {text!r}: {err}") from None
    assert override.value() == value, text


def test_recipe_schema_doc_is_generated_from_the_code() -> None:
    from engine.recipes.reference import schema_markdown

    doc = ROOT / "docs" / "reference" / "recipe-schema.md"
    assert doc.read_text() == schema_markdown() + "\n", (
        "run: python -m engine schema --format markdown > docs/reference/recipe-schema.md"
    )


@pytest.mark.parametrize("key", ["0", "true", "it's", "ключ", "#x"])
def test_unwritable_dict_keys_are_refused_with_the_verl_key_named(key: str) -> None:
    with pytest.raises(ValueError):
        hydra.Override("k", {key: 1}).text  # noqa: B018
    from engine.errors import UserError

    with pytest.raises(UserError, match=r"verl key 'x\.y'"):
        plan.compile_recipe(loader.load("tiny_cpu", "cpu", [f"verl_overrides.x.y={json.dumps({key: 1})}"]))


def test_every_recipe_field_is_described() -> None:
    """The reference has no empty rows: each key says what it means (as torchtitan and nf-core do)."""
    from engine.recipes.schema import MAPPING_FIELDS, Recipe, section_type

    missing = []

    def walk(model: type, prefix: str) -> None:
        for name, info in model.model_fields.items():
            sub = section_type(model, name)
            if not info.description and (sub is None or name in MAPPING_FIELDS):
                missing.append(prefix + name)
            if sub is not None and name not in MAPPING_FIELDS:
                walk(sub, f"{prefix}{name}.")

    walk(Recipe, "")
    assert missing == []


@pytest.mark.parametrize(
    ("recipe", "device"), [("tiny_cpu", "cpu"), ("smoke_qwen35_0p8b_h200", "gpu"), ("qwen35_35b_h200", "gpu")]
)
def test_ray_init_sizes_only_the_local_ray_of_one_node(recipe: str, device: str) -> None:
    """On one node verl starts Ray itself, sized by ray_init; on N nodes it joins the cluster of `engine
    cluster`, and Ray refuses num_cpus/num_gpus there ("When connecting to an existing cluster")."""
    one = parsed(plan.compile_recipe(loader.load(recipe, device)).overrides)
    assert "ray_kwargs.ray_init.num_cpus" in one
    assert ("ray_kwargs.ray_init.num_gpus" in one) == (device == "cpu")  # CPU ranks: logical GPU slots
    two = parsed(plan.compile_recipe(loader.load(recipe, device, ["cluster.nodes=2"])).overrides)
    assert not [key for key in two if key.startswith(plan.LOCAL_RAY_INIT)], two
    assert two["ray_kwargs.ray_init.include_dashboard"] is False  # the rest of ray_init stays
    assert two["trainer.nnodes"] == 2
