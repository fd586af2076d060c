"""Loading, layering and validation of recipes; the CLI's behaviour on bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import UserError
from engine.recipes import loader, plan

SHIPPED = {
    "qwen35_27b",
    "qwen35_35b",
    "smoke_qwen35_0p8b",
    "smoke_qwen35_2b",
    "tiny_cpu",
    "tiny_moe_cpu",
    "tiny_cpu_learn",
    "tiny_cpu_vllm",
    "tiny_moe_cpu_vllm",
}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True)


def write(tmp_path: Path, text: str, name: str = "r.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_list_shows_every_shipped_recipe_with_a_description() -> None:
    rows = dict(loader.list_recipes())
    assert rows.keys() >= SHIPPED
    assert all(rows[name] for name in SHIPPED)
    out = cli("list").stdout
    assert all(name in out for name in SHIPPED)


def test_profiles_layer_under_recipes() -> None:
    gpu, npu = loader.load("qwen35_35b", "gpu"), loader.load("qwen35_35b", "npu")
    assert (gpu.cluster.devices_per_node, gpu.parallel.fsdp, gpu.parallel.ep_dispatcher) == (8, 8, "eager")
    assert (npu.cluster.devices_per_node, npu.parallel.fsdp, npu.parallel.ep_dispatcher) == (16, 16, "fused")
    assert npu.rollout.vllm_engine_kwargs["mm_processor_cache_gb"] == 0
    assert "mm_processor_cache_gb" not in gpu.rollout.vllm_engine_kwargs
    # the NPU smoke recipe overrides the NPU profile (8 devices, FSDP 4, CP 2)
    smoke = loader.load("smoke_qwen35_2b")
    assert (smoke.cluster.devices_per_node, smoke.parallel.fsdp, smoke.parallel.cp) == (8, 4, 2)
    # extends keeps the base and changes only what the child says
    assert gpu.data == loader.load("qwen35_27b", "gpu").data
    assert gpu.parallel.ep == 8 and loader.load("qwen35_27b", "gpu").parallel.ep == 1


@pytest.mark.parametrize(
    "item,field,value",
    [
        ("parallel.fsdp=4", ("parallel", "fsdp"), 4),
        ("parallel.ep=4", ("parallel", "ep"), 4),
        ("parallel.cp=2", ("parallel", "cp"), 2),
        ("parallel.rollout_tp=2", ("parallel", "rollout_tp"), 2),
        ("cluster.nodes=2", ("cluster", "nodes"), 2),
        ("cluster.devices_per_node=4", ("cluster", "devices_per_node"), 4),
        ("actor.optim.lr=3e-6", ("actor", "optim", "lr"), 3e-6),
        ("env.NCCL_DEBUG=INFO", ("env", "NCCL_DEBUG"), "INFO"),
    ],
)
def test_set_paths(item: str, field: tuple[str, ...], value: object) -> None:
    resolved = loader.load("qwen35_35b", "gpu", [item])
    node = resolved
    for part in field:
        node = getattr(node, part) if not isinstance(node, dict) else node[part]
    assert node == value
    default = plan.compile_recipe(loader.load("qwen35_35b", "gpu"))
    changed = plan.compile_recipe(resolved)
    assert (changed.overrides, changed.env) != (default.overrides, default.env)


@pytest.mark.parametrize(
    "sets,fragment",
    [
        (["parallel.fspd=4"], "did you mean 'parallel.fsdp'"),
        (["paralel.fsdp=4"], "did you mean 'parallel'"),
        (["parallel=4"], "is a section"),
        (["parallel.fsdp"], "expected KEY=VALUE"),
        (["parallel.fsdp=four"], "'parallel.fsdp'"),
        (["parallel.fsdp=0"], "'parallel.fsdp'"),
        (["name=x"], "unknown recipe path 'name'"),
    ],
)
def test_bad_set_values_are_one_line_errors(sets: list[str], fragment: str) -> None:
    with pytest.raises(UserError) as err:
        loader.load("qwen35_27b", "gpu", sets)
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "text,fragment",
    [
        (
            "extends: qwen35_27b\nparallel: {fspd: 4}\n",
            "unknown key 'parallel.fspd' (did you mean 'parallel.fsdp'?)",
        ),
        ("extends: qwen35_27b\nrolout: {n: 2}\n", "did you mean 'rollout'"),
        ("extends: qwen35_27b\nactor: {ppo_mini_batch_size: many}\n", "'actor.ppo_mini_batch_size'"),
        ("extends: qwen35_27b\ndata: {train_batch_size: '16'}\n", "'data.train_batch_size'"),
        ("extends: qwen35_27b\nparallel: [1, 2]\n", "'parallel' must be a mapping"),
        ("extends: qwen35_27b\nparallel: {fsdp: 8\n", "line"),
        ("- just\n- a list\n", "must be a mapping"),
        ("extends: no_such_recipe\n", "unknown recipe 'no_such_recipe'"),
        ("extends: qwen35_27b\ndevices: [tpu]\n", "devices"),
        ("description: partial\ndevices: [gpu]\n", "missing required key"),
    ],
)
def test_bad_recipe_files_are_one_line_errors(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(UserError) as err:
        loader.load(write(tmp_path, text))
    assert fragment in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_extends_cycle_is_reported(tmp_path: Path) -> None:
    write(tmp_path, "extends: b.yaml\n", "a.yaml")
    write(tmp_path, "extends: a.yaml\n", "b.yaml")
    with pytest.raises(UserError, match="cycle"):
        loader.load(str(tmp_path / "a.yaml"))


def test_unknown_recipe_suggests_the_closest_name() -> None:
    with pytest.raises(UserError, match="did you mean 'qwen35_35b'"):
        loader.load("qwen35_53b")


def test_device_outside_the_recipe_is_refused() -> None:
    with pytest.raises(UserError, match="pass --device npu"):
        loader.load("smoke_qwen35_2b", "gpu")


def test_show_round_trips_through_yaml(tmp_path: Path) -> None:
    shown = loader.to_yaml(loader.load("qwen35_35b", "npu"))
    data = yaml.safe_load(shown)
    data.pop("name")
    reloaded = loader.load(write(tmp_path, yaml.safe_dump(data)), "npu")
    assert reloaded.model_dump(exclude={"name"}) == loader.load("qwen35_35b", "npu").model_dump(
        exclude={"name"}
    )


@pytest.mark.parametrize(
    "args",
    [
        ["render", "nope"],
        ["render", "qwen35_27b", "--device", "gpu", "--set", "parallel.fspd=2"],
        ["show", "/nonexistent/recipe.yaml"],
        ["preflight", "qwen35_27b", "--device", "gpu", "--set", "parallel.ep=8"],
    ],
)
def test_cli_errors_exit_2_with_short_stderr_and_no_traceback(args: list[str]) -> None:
    result = cli(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() and result.stdout == ""


def test_render_path_never_imports_torch_or_verl() -> None:
    code = (
        "import sys; from engine.cli import main; main(['render','qwen35_35b','--device','gpu']); "
        "main(['preflight','qwen35_35b','--device','npu']); "
        "print(sorted(m for m in ('torch','verl','ray','transformers','hydra') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


# ---------------------------------------------------------------- property-based: no input crashes the loader
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True), st.text(max_size=8)
)
_keys = st.sampled_from(
    [
        "extends",
        "description",
        "devices",
        "model",
        "data",
        "actor",
        "parallel",
        "fsdp",
        "ep",
        "cp",
        "name",
        "path",
        "n",
        "rollout",
        "cluster",
        "env",
        "verl_overrides",
        "trainer",
        "optim",
        "lr",
        "x",
        "1",
    ]
)
_trees = st.recursive(
    _scalars | st.lists(_scalars, max_size=3), lambda c: st.dictionaries(_keys, c, max_size=5), max_leaves=20
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tree=st.dictionaries(_keys, _trees, max_size=8), base=st.sampled_from([None, "qwen35_27b", "tiny_cpu"])
)
def test_loader_never_crashes_on_arbitrary_documents(tmp_path: Path, tree: dict, base: str | None) -> None:
    if base:
        tree = {**tree, "extends": base}
    path = write(tmp_path, yaml.safe_dump(tree))
    try:
        resolved = loader.load(path)
        plan.compile_recipe(resolved)
    except UserError as err:
        assert str(err) and "\n" not in str(err)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200))
def test_loader_never_crashes_on_arbitrary_text(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    try:
        loader.load(path)
    except UserError as err:
        assert "\n" not in str(err)


@settings(max_examples=200, deadline=None)
@given(items=st.lists(st.text(max_size=30), max_size=3), key=st.text(min_size=1, max_size=20))
def test_set_parsing_never_crashes(items: list[str], key: str) -> None:
    try:
        loader.load("tiny_cpu", "cpu", [f"{key}={v}" for v in items])
    except UserError as err:
        assert "\n" not in str(err)
