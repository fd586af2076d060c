# Shared helpers: config checks, recipe resolution and the launch commands of the rules.
# Bad input stops the workflow here, before any job, with one line naming the key and the fix.

import functools
import re
import shlex
import sys
from pathlib import Path

import jsonschema
import yaml

from engine import preflight as engine_preflight
from engine.data.random_model import RANDOM_MODELS
from engine.errors import UserError
from engine.recipes import loader as engine_recipe
from engine.recipes import plan as engine_plan
from engine.records.chain import ASSETS, MODELS, RESULTS, ChainDir
from engine.run import rundir as engine_rundir

# every path of a recipe's chain, as the rules' patterns (engine.records.chain names them once)
CHAIN = ChainDir.of("{recipe}")
BENCH = RESULTS / "bench"  # the trainer benchmarks (workflow/rules/bench.smk)

try:
    RECIPES = dict(engine_recipe.list_recipes())
except UserError as err:
    sys.exit(f"error: {err}")
# target -> the recipe it runs; `--config recipes=...` points a target at another recipe (e.g. a
# rehearsal of the flagship on one GPU, profiles/h200); `run` takes its recipe from --config recipe=NAME
TARGETS = {
    "run_qwen35_35b": "qwen35_35b",
    "run_qwen35_27b": "qwen35_27b",
    "smoke_cpu": "tiny_cpu",
    "learn_cpu": "tiny_cpu_learn",
    "ci_smoke_gpu": "smoke_qwen35_0p8b",
    "ci_smoke_npu": "smoke_qwen35_2b",
}


def fail(message):
    """End the workflow before any job with a single line."""
    sys.exit(f"error: {message}")


def validate_config(schema_path):
    """JSON-schema check with one readable line per problem (Snakemake's own message is a page)."""
    schema = yaml.safe_load(Path(schema_path).read_text())
    for key, spec in schema["properties"].items():
        # --config takes `True`/`False` as booleans but leaves `true`/`false` strings: accept both
        if spec.get("type") == "boolean" and str(config.get(key)).lower() in (
            "true",
            "false",
        ):
            config[key] = str(config[key]).lower() == "true"
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(config))
    if errors:
        err = jsonschema.exceptions.best_match(errors)
        key = ".".join(str(part) for part in err.absolute_path) or "config"
        fail(f"--config {key}: {err.message} (allowed values: {schema_path})")
    for target, name in config.get("recipes", {}).items():
        if target not in TARGETS:
            fail(
                f"--config recipes: {target!r} is not a target; known: {', '.join(TARGETS)}"
            )
        if name not in RECIPES:
            fail(
                f"--config recipes: {target}={name}: no such recipe; known: {', '.join(RECIPES)}"
            )
    if config.get("recipe") is not None and config["recipe"] not in RECIPES:
        fail(
            f"--config recipe={config['recipe']}: no such recipe; known: {', '.join(RECIPES)}"
        )
    if config.get("recipe") is not None:
        resolved(
            config["recipe"]
        )  # preflight now; target rules' recipes when the DAG is built


def recipe_of(target):
    """The recipe a target runs: the configured one, else its default."""
    return config.get("recipes", {}).get(target, TARGETS[target])


def python():
    """Interpreter of `python -m engine`: the configured one, `python` in containers, else ours."""
    if config.get("python"):
        return config["python"]
    return (
        "python" if workflow.deployment_settings.deployment_method else sys.executable
    )


@functools.cache
def resolved(name):
    """(Recipe, device) for one recipe under this invocation's device, nodes and --set values."""
    if name not in RECIPES:
        fail(f"recipe {name!r} does not exist; known: {', '.join(RECIPES)}")
    try:
        devices = list(engine_recipe.load(name).devices)
        device = devices[0] if len(devices) == 1 else config["device"]
        if device not in devices:
            fail(
                f"recipe {name} runs on {'/'.join(devices)}, not {device}; pass --config device={devices[0]}"
            )
        loaded = engine_recipe.load(name, device=device, sets=base_sets(name, device))
        # the plan checks of `preflight`, before any job: a bad plan must not fail on the cluster
        engine_preflight.require_ok(engine_plan.compile_recipe(loaded))
        return loaded, device
    except UserError as err:
        fail(f"recipe {name}: {err}")


@functools.cache
def checked_smoke(name):
    """The smoke's own plan (fewer steps, a smaller batch) passes preflight too."""
    recipe, device = resolved(name)
    try:
        sets = base_sets(name, device) + smoke_sets(name)
        smoke = engine_recipe.load(name, device=device, sets=sets)
        engine_preflight.require_ok(engine_plan.compile_recipe(smoke))
    except UserError as err:
        fail(f"recipe {name} (smoke): {err}")
    return sets


def nodes(device):
    return 1 if device == "cpu" else int(config["nodes"])


def run_dir(name, kind):
    return str(ChainDir.of(name).run(kind).path)


def base_sets(name, device):
    """Every launch of a recipe reads the data prepare_data wrote, on the configured nodes."""
    chain = ChainDir.of(name)
    sets = [
        f"data.train_files={chain.split('train').resolve()}",
        f"data.val_files={chain.split('test').resolve()}",
    ]
    sets.append(f"cluster.nodes={nodes(device)}")
    built = built_model(name, device)
    if built:
        # the model a rule of this workflow builds, by absolute path (verl runs from the repo root)
        sets.append(f"model.path={Path(built).resolve()}")
    return sets + list(config["sets"])


def models_dir():
    """Where random_model writes: tiny-width rehearsal models (small_models) apart from full-size ones,
    so neither is ever taken for the other."""
    return MODELS / "small" if config["small_models"] else MODELS


@functools.cache
def built_model(name, device):
    """The model directory this workflow builds for a recipe (as the recipe file names it, before this
    workflow's --set values), None for released weights."""
    recipe = engine_recipe.load(name, device=device)
    if recipe.model.init == "random":
        return str(models_dir() / recipe.model.name)
    if Path(recipe.model.path).is_relative_to(ASSETS):
        return recipe.model.path  # tiny recipes: inside the tiny_assets directory
    return None


def smoke_sets(name):
    """Same plan, `steps` steps, one small batch: a broken environment fails in minutes."""
    recipe, _ = resolved(name)
    batch = config["smoke_batch"] or recipe.actor.ppo_mini_batch_size
    return [
        f"trainer.total_training_steps={config['smoke_steps']}",
        f"data.train_batch_size={batch}",
        f"actor.ppo_mini_batch_size={min(batch, recipe.actor.ppo_mini_batch_size)}",
    ]


def launch_command(name, kind):
    """The argv of one run of the chain. The control is the smoke's run with the loop broken on purpose
    (`--control`), no checkpoint."""
    _, device = resolved(name)
    sets = checked_smoke(name) if kind == "smoke" else base_sets(name, device)
    if kind == "control":
        sets = [*base_sets(name, device), "trainer.save_freq=-1"]
    flags = ["--control", config["control"]] if kind == "control" else []
    return engine_launch(name, device, flags, sets, run_dir(name, kind))


def engine_launch(name, device, flags, sets, out):
    """`engine run` on one node, a Ray cluster bring-up on several, of recipe `name` with these flags
    and --set items into `out`."""
    tail = [name, "--device", device, *flags]
    for item in sets:
        tail += ["--set", item]
    tail += ["--out", str(out)]
    if nodes(device) == 1:
        return shlex.join([python(), "-m", "engine", "run", *tail])
    head = [
        python(),
        "-m",
        "engine",
        "cluster",
        "launch",
        "--nodes",
        str(nodes(device)),
    ]
    head += ["--cpus-per-node", str(config["cpus_per_node"])]
    if config["ray_port"]:
        head += ["--port", str(config["ray_port"])]
    return shlex.join([*head, *tail])


def keep_failed_record(wildcards, output):
    """Shell that copies a failed launch's run.json (its gates, exit code) aside before Snakemake removes
    the failed job's declared output: the record of a failure is the one most worth reading.
    """
    return copied_aside(
        output[0], Path(output[0]).with_name(engine_rundir.FAILED_RECORD)
    )


def copied_aside(output, kept):
    """Shell, after `||`: copy a failed job's output to `kept` and keep the job's exit status."""
    return f"{{ status=$?; cp {output} {kept} 2>/dev/null; exit $status; }}"


def failed_rows(wildcards, output):
    """Where a failed benchmark's rows are kept, beside its log: Snakemake removes a failed job's
    declared output, and a benchmark fails exactly when its rows are worth reading (a lever out of
    tolerance; a group that crashed, beside the groups that measured).
    """
    out = Path(output[0])
    return out.parent / "logs" / f"{out.stem}.failed.jsonl"


def keep_failed_rows(wildcards, output):
    """Shell that copies a failed benchmark's rows to `failed_rows` and keeps its exit status."""
    return copied_aside(output[0], failed_rows(wildcards, output))


def run_resources(name):
    """Slurm resources of a training job: one task per node owning all of its devices."""
    recipe, device = resolved(name)
    if device == "cpu":
        return {}
    count = nodes(device)
    res = {
        "nodes": count,
        "cpus_per_task": config["cpus_per_node"],
        "gres": config["gres"][device].format(n=recipe.cluster.devices_per_node),
        # no --ntasks-per-gpu (slurm plugin #316: Ray launched once per GPU)
        "tasks_per_gpu": 0,
    }
    if count > 1:
        # the job's shell runs on the first node and starts one Ray node per host with srun
        res |= {"tasks": count, "mpi": "srun"}
    return res


def resource(key, default=None):
    """A resource of the train/smoke rules, computed from the recipe of the job."""
    return lambda wildcards: run_resources(wildcards.recipe).get(key, default)


def image(wildcards):
    """The pinned image of the recipe's device (None: run on the host); the tiny assets are CPU work."""
    name = getattr(wildcards, "recipe", None)
    return config["containers"][resolved(name)[1] if name else "cpu"]


def gpu_image(wildcards):
    """The pinned GPU image: the trainer benchmarks measure the GPU stack."""
    return config["containers"]["gpu"]


def dataset_args(wildcards):
    recipe, _ = resolved(wildcards.recipe)
    dataset = recipe.data.dataset
    if dataset == "synthetic":
        return f"--dataset synthetic --seed {config['synthetic_seed']}"
    raw = config.get(f"{dataset}_raw")
    if raw:
        return f"--dataset {dataset} --raw {shlex.quote(raw)}"
    if config["hub"]:
        return f"--dataset {dataset} --hub"
    fail(
        f"recipe {wildcards.recipe} needs raw {dataset}: set --config {dataset}_raw=PATH "
        "(offline copy) or hub=true (online)"
    )


def model_inputs(wildcards):
    """The model a rule of this workflow builds (tiny_assets, random_model); none for released weights."""
    built = built_model(wildcards.recipe, resolved(wildcards.recipe)[1])
    if built is None:
        return []
    return [str(ASSETS) if Path(built).is_relative_to(ASSETS) else built]


def export_flags(wildcards):
    return "--verify-logits" if config["verify_logits"] else ""


def drift_flags(wildcards):
    """How far training moved the policy (smoke-report --drift): needs the initial model at hand."""
    built = built_model(wildcards.recipe, resolved(wildcards.recipe)[1])
    if not config["drift"] or built is None:
        return ""
    return f"--drift {shlex.quote(built)} {ChainDir.of(wildcards.recipe).export.path}"


def bench_args(stage):
    """`benchmarks.gpu_bench run` options of one configured stage (its rows, the shared repeat settings)."""
    bench, spec = config["bench"], config["bench"]["stages"][stage]
    options = {k: spec[k] for k in ("modes", "shapes", "levers")}
    options |= {k: bench[k] for k in ("kernels", "steps", "repeats")}
    if spec.get("profile"):
        options["profile"] = BENCH / "profile" / stage
    if spec.get("host_syncs"):
        options["host-syncs"] = spec["host_syncs"]
    if "fill" in spec:
        options["fill"] = spec["fill"]
    return shlex.join(str(a) for k, v in options.items() for a in (f"--{k}", v))


def numerics_levers(wildcards):
    """`--levers LIST ` where bench.numerics names some, else nothing: trainer_numerics' own list."""
    levers = config["bench"]["numerics"].get("levers")
    return f"--levers {shlex.quote(levers)} " if levers else ""


BENCH_OUTPUTS = {
    "numerics": BENCH / "numerics.jsonl",
    "attention": BENCH / "attention-check.jsonl",
    "rollout": BENCH / "rollout-ratio.json",
}


def bench_targets():
    stages = config["bench_stages"] or [*config["bench"]["stages"], *BENCH_OUTPUTS]
    unknown = [
        s
        for s in stages
        if s not in BENCH_OUTPUTS and s not in config["bench"]["stages"]
    ]
    if unknown:
        fail(
            f"--config bench_stages: {unknown} not in bench.stages "
            f"({', '.join([*config['bench']['stages'], *BENCH_OUTPUTS])})"
        )
    return [BENCH_OUTPUTS.get(s, BENCH / f"compare-{s}.json") for s in stages]


def rollout_recipe(side):
    spec = config["bench"].get("rollout") or fail(
        "the rollout stage needs bench.rollout in the config (workflow/config.yaml)"
    )
    return spec[side]


def rollout_inputs(wildcards):
    """The data and model of the hf recipe: both runs train on them, so their batches are the same."""
    recipe = rollout_recipe("hf")
    built = built_model(recipe, resolved(recipe)[1])
    return [ChainDir.of(recipe).manifest, *([built] if built else [])]


def rollout_command(side):
    """The launch of one side: the hf recipe's data and model, the levers, no checkpoint save."""
    spec, recipe, hf = (
        config["bench"]["rollout"],
        rollout_recipe(side),
        rollout_recipe("hf"),
    )
    sets = [
        *base_sets(hf, resolved(hf)[1]),
        f"trainer.total_training_steps={spec['steps']}",
        "trainer.save_freq=-1",
    ]
    flags = ["--levers", spec["levers"]]
    return engine_launch(
        recipe, resolved(recipe)[1], flags, sets, BENCH / "rollout" / side
    )


def targets(name):
    """Everything one recipe's run ends in: the provenance record and the report curves; on accelerators
    the run report (gates, step split, memory) and, when configured, the broken-loop control.
    """
    _, device = resolved(name)
    chain = ChainDir.of(name)
    wanted = [chain.train.provenance, chain.curves]
    if device != "cpu":
        wanted.append(chain.train.run_report)
    if config["control"]:
        wanted.append(chain.control.record)
    return wanted
