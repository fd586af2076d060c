"""The trainer levers: opt-in, rendered to the verl keys verl 0.9.1 reads, and built by verl as intended."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.errors import UserError
from engine.recipes import levers, loader, plan
from tests.conftest import ROOT

# what each lever adds to (or changes in) the rendered overrides, key -> value as Hydra parses it
EXPECTED = {
    "baseline": {},
    "foreach": {"actor_rollout_ref.actor.optim.override_optimizer_config": {"foreach": True}},
    "fused": {"actor_rollout_ref.actor.optim.override_optimizer_config": {"fused": True}},
    "no-reshard": {"actor_rollout_ref.actor.fsdp_config.reshard_after_forward": False},
    "no-sync": {"actor_rollout_ref.actor.fsdp_config.use_no_sync_for_gradient_accumulation": True},
    "bf16-reduce": {
        "actor_rollout_ref.actor.fsdp_config.mixed_precision": {
            "param_dtype": "bf16",
            "reduce_dtype": "bf16",
            "buffer_dtype": "fp32",
        }
    },
    "bf16-sr": {
        "actor_rollout_ref.actor.fsdp_config.model_dtype": "bf16",
        "actor_rollout_ref.actor.optim.optimizer_impl": "torchao.optim",
        "actor_rollout_ref.actor.optim.optimizer": "_AdamW",
        "actor_rollout_ref.actor.optim.override_optimizer_config": {"bf16_stochastic_round": True},
    },
    "bf16-sr-compiled": {
        "actor_rollout_ref.actor.fsdp_config.model_dtype": "bf16",
        "actor_rollout_ref.actor.optim.optimizer_impl": "engine.runtime.optim",
        "actor_rollout_ref.actor.optim.optimizer": "BF16AdamW",
        "actor_rollout_ref.actor.optim.override_optimizer_config": {"bf16_stochastic_round": True},
    },
    "varlen-attn": {"actor_rollout_ref.model.override_config.attn_implementation": "torch_varlen"},
    "sdpa-no-cudnn": {"actor_rollout_ref.model.override_config.attn_implementation": "sdpa_no_cudnn"},
    "text-only": {},  # no verl key: the launch's environment (EXPECTED_ENV)
    "compiled-logprobs": {},
}
EXPECTED_ENV = {"text-only": {"ENGINE_TEXT_ONLY": "1"}, "compiled-logprobs": {"ENGINE_LOGPROBS": "compiled"}}


def parsed(compiled: plan.Plan) -> dict[str, object]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(compiled.overrides)}


@pytest.mark.parametrize(
    "recipe,device", [("qwen35_35b", "gpu"), ("qwen35_35b_h200", "gpu"), ("tiny_cpu", "cpu")]
)
@pytest.mark.parametrize("lever", sorted(EXPECTED))
def test_a_lever_renders_exactly_its_keys(recipe: str, device: str, lever: str) -> None:
    """Nothing else moves: the diff against the recipe as shipped is the lever's keys and environment."""
    shipped = plan.compile_recipe(loader.load(recipe, device))
    opted = plan.compile_recipe(loader.load(recipe, device, levers.lever_sets([lever])))
    before, after = parsed(shipped), parsed(opted)
    changed = {k: v for k, v in after.items() if before.get(k, "<absent>") != v}
    assert changed == EXPECTED[lever]
    assert set(before) <= set(after)
    assert {k: v for k, v in opted.env.items() if shipped.env.get(k) != v} == EXPECTED_ENV.get(lever, {})
    assert set(shipped.env) <= set(opted.env)


def test_bundles_are_their_parts_and_later_wins() -> None:
    fast = levers.lever_sets(["fast"])
    assert fast == levers.lever_sets(["fused", "no-reshard"])
    assert levers.lever_sets(["fused", "bf16-sr"])[-1] == "actor.optim.precision=bf16_sr"
    assert levers.lever_sets(["fast+no-sync"]) == levers.lever_sets(["fast", "no-sync"])
    assert levers.lever_fields(["fast-bf16-reduce"]) == levers.lever_fields(["fast-bf16", "bf16-reduce"])
    # the dense step's measured set, under the name the docs give it
    text = ["fast", "varlen-attn", "text-only", "compiled-logprobs"]
    assert levers.lever_fields(["fast-text"]) == levers.lever_fields(text)
    assert levers.lever_fields(["fast-text"]) == levers.lever_fields(["+".join(text)])
    # the MoE step's measured set (15.3% MFU on one H100), likewise
    lean = "fast-bf16-reduce+bf16-sr-compiled+varlen-attn+text-only+compiled-logprobs"
    assert levers.lever_fields(["fast-text-bf16"]) == levers.lever_fields([lean])
    assert levers.canonical("fast-text-bf16") == levers.canonical(lean) != levers.canonical("fast-text")
    assert levers.canonical("fast") == levers.canonical("no-reshard+fused")
    assert (levers.canonical("baseline"), levers.canonical("retired-name")) == ("baseline", "retired-name")
    assert levers.lever_names("fast+no-sync,fused") == ["fast+no-sync", "fused"]
    for bad in ("fused,turbo", "fast+turbo"):
        with pytest.raises(UserError, match="unknown lever"):
            levers.lever_names(bad)


def test_bf16_states_refuse_a_kernel_choice_they_cannot_honour() -> None:
    recipe = loader.load(
        "tiny_cpu", "cpu", ["actor.optim.precision=bf16_sr", "actor.optim.implementation=fused"]
    )
    with pytest.raises(UserError, match="implementation=default"):
        plan.compile_recipe(recipe)
    fp32 = loader.load("tiny_cpu", "cpu", ["actor.optim.implementation=compiled"])
    with pytest.raises(UserError, match="precision=bf16_sr"):
        plan.compile_recipe(fp32)


def test_engine_kwargs_are_the_rendered_keys() -> None:
    """The benchmarks drive verl's engine with engine_config_kwargs: the same values a recipe renders."""
    for name in levers.LEVERS:
        engine, optimizer = levers.engine_config_kwargs([name])
        rendered = parsed(plan.compile_recipe(loader.load("tiny_cpu", "cpu", levers.lever_sets([name]))))
        actor = "actor_rollout_ref.actor"
        for key, value in engine.items():
            assert rendered[f"{actor}.fsdp_config.{key}"] == value
        for key, value in optimizer.items():
            assert rendered[f"{actor}.optim.{key}"] == value
        assert rendered["actor_rollout_ref.model.override_config.attn_implementation"] == (
            levers.attn_implementation([name])
        )


@pytest.mark.parametrize("lever", ["fused", "foreach", "bf16-sr", "bf16-sr-compiled"])
def test_verl_builds_the_optimizer_each_lever_names(lever: str) -> None:
    """verl's own config composition and build_optimizer, from the rendered overrides."""
    torch = pytest.importorskip("torch")
    verl = pytest.importorskip("verl")
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config.optimizer import build_optimizer

    compiled = plan.compile_recipe(loader.load("tiny_cpu", "cpu", levers.lever_sets([lever])))
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=compiled.overrides)
    actor = cfg.actor_rollout_ref.actor
    dtype = torch.bfloat16 if actor.fsdp_config.model_dtype == "bf16" else torch.float32
    params = [torch.nn.Parameter(torch.zeros(64, 64, dtype=dtype))]
    optimizer = build_optimizer(params, omega_conf_to_dataclass(actor.optim))
    if lever.startswith("bf16-sr"):
        module = "engine.runtime.optim" if lever == "bf16-sr-compiled" else "torchao.optim"
        assert type(optimizer).__module__.startswith(module) and optimizer.bf16_stochastic_round
        assert dtype == torch.bfloat16
    else:
        assert type(optimizer) is torch.optim.AdamW and optimizer.defaults[lever] is True


def test_verl_reads_the_bf16_reduce_into_its_engine_config() -> None:
    """The added key composes with verl's trainer config and reaches FSDPEngineConfig.mixed_precision,
    which verl's FSDP2 engine turns into MixedPrecisionPolicy(reduce_dtype=bf16)."""
    verl = pytest.importorskip("verl")
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    compiled = plan.compile_recipe(loader.load("tiny_cpu", "cpu", levers.lever_sets(["bf16-reduce"])))
    assert "+actor_rollout_ref.actor.fsdp_config.mixed_precision=" in " ".join(compiled.overrides)
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=compiled.overrides)
    engine_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.fsdp_config)
    assert engine_config.mixed_precision == levers.BF16_REDUCE


def test_bf16_reduce_is_refused_with_fsdp_turbo() -> None:
    from engine.preflight import plan_checks

    compiled = plan.compile_recipe(loader.load("qwen35_35b", "gpu", ["actor.reduce_dtype=bf16"]))
    problems = plan_checks._levers(compiled)
    assert any("actor.reduce_dtype=bf16" in p and "fsdp_turbo" in p for p in problems)
    assert not plan_checks._levers(plan.compile_recipe(loader.load("qwen35_35b", "gpu")))


def test_cli_levers_expand_to_sets_in_order() -> None:
    def render(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "engine", "render", "tiny_cpu", "--format", "overrides", *args]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)

    fast = render("--levers", "fast").stdout
    assert "actor_rollout_ref.actor.optim.override_optimizer_config={fused:True}" in fast.splitlines()
    assert "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=False" in fast.splitlines()
    overruled = render("--levers", "fast", "--set", "actor.reshard_after_forward=true").stdout
    assert "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=True" in overruled.splitlines()
    bad = render("--levers", "warp")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --levers 'warp'")


@pytest.mark.parametrize("value", ["verl", "deferred"])
def test_host_syncs_is_a_field_the_environment_cannot_contradict(value: str) -> None:
    """`actor.host_syncs` reaches verl's processes as ENGINE_HOST_SYNCS and moves no verl key; a recipe's
    `env` setting that variable (or another the plan writes from a field) is refused, since the record
    keeps the field and the run would do what the environment says."""
    from engine.runtime import syncs

    shipped = plan.compile_recipe(loader.load("qwen35_35b", "gpu"))
    opted = plan.compile_recipe(loader.load("qwen35_35b", "gpu", [f"actor.host_syncs={value}"]))
    assert opted.overrides == shipped.overrides and syncs.ENV not in shipped.env
    assert {k: v for k, v in opted.env.items() if shipped.env.get(k) != v} == {syncs.ENV: value}
    assert value in syncs.CHOICES and syncs.CHOICES[0] == "lean"
    for name, owner in levers.FIELD_ENV.items():
        with pytest.raises(UserError, match=f"env.{name}: written from the recipe field {owner}"):
            plan.compile_recipe(loader.load("tiny_cpu", "cpu", [f"env.{name}={value}"]))


def test_a_lever_and_a_recipe_override_of_one_key_are_refused_naming_both() -> None:
    """tiny_cpu_learn computes in fp32 through its own verl_overrides entry; bf16-reduce renders the same
    key. Either would silently win in Hydra, so the plan refuses, pointing at the override and the field;
    an override given twice in verl_overrides (two prefixes) is told apart."""
    learn = loader.load("tiny_cpu_learn", "cpu", levers.lever_sets(["bf16-reduce"]))
    with pytest.raises(UserError, match=r"^verl_overrides\.actor_rollout_ref\.actor\.fsdp_config\.mixed_pre"):
        plan.compile_recipe(learn)
    twice = loader.load("tiny_cpu", "cpu", ["verl_overrides={+trainer.foo: 1, ++trainer.foo: 2}"])
    with pytest.raises(UserError, match=r"^verl_overrides\.trainer\.foo: named twice, under different"):
        plan.compile_recipe(twice)
