"""Bad input over every entry point: one `error:` line naming the input, the documented exit code, and
every earlier artefact byte-identical afterwards (docs/reference/errors.md). Run in-process: one table, no
subprocess per case. Checkpoint corruption and the entry-point wiring live in test_bad_checkpoints.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import compare, gpu_bench, overhead
from benchmarks import export as export_bench
from benchmarks import trainer_numerics as numerics
from containers import build as image_build
from containers import localtest, lock, resolve
from engine import cli
from engine.run import cluster
from tests.support.bad_input_world import Case, build, build_inputs, check, read_only_dir

W = "{W}"
FILE, FOREIGN, RUN, RO = f"{W}/a_file", f"{W}/foreign", f"{W}/run", "{RO}"
GPU = ["--device", "gpu"]
TINY = ["tiny_cpu", "--set", f"model.path={W}/model"]  # a model is there: no asset build starts
SCRIPT = ["script", "qwen35_35b", "--device", "gpu", "--nodes", "2", "--cpus-per-node", "8", "--out", "x"]
LAUNCH = ["launch", "qwen35_35b", "--device", "gpu", "--nodes", "2", "--cpus-per-node", "8"]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_inputs(build(tmp_path_factory.mktemp("world") / "w"))


RECIPE_CASES = [
    Case("show-unknown", ["show", "nope"], 2, "unknown recipe 'nope'"),
    Case("show-typo", ["show", "qwen35_53b"], 2, "did you mean 'qwen35_35b'"),
    Case("render-device", ["render", "qwen35_27b", "--device", "tpu"], 2, "invalid choice: 'tpu'"),
    Case(
        "render-key", ["render", "qwen35_27b", "--set", "parallel.fspd=2"], 2, "did you mean 'parallel.fsdp'"
    ),
    Case("set-empty-path", ["render", "qwen35_27b", "--set", "model.path="], 2, "empty value"),
    Case("set-empty-quoted", ["render", "qwen35_27b", "--set", "model.path=''"], 2, "'model.path'"),
    Case(
        "set-device", ["render", "qwen35_27b", *GPU, "--set", "cluster.device=npu"], 2, "contradicts --device"
    ),
    Case("set-env-dash", ["render", "qwen35_27b", "--set", "env.MY-VAR=x"], 2, "not a shell variable name"),
    Case("set-env-digit", ["render", "qwen35_27b", "--set", "env.1X=y"], 2, "not a shell variable name"),
    Case("set-no-equals", ["render", "qwen35_27b", "--set", "parallel.ep"], 2, "expected KEY=VALUE"),
    Case("set-no-key", ["render", "qwen35_27b", "--set", "=3"], 2, "expected KEY=VALUE"),
    Case("set-section", ["render", "qwen35_27b", "--set", "parallel=2"], 2, "is a section"),
    Case("set-type", ["show", "qwen35_27b", "--set", "parallel.ep=abc"], 2, "'parallel.ep'"),
    Case("set-negative", ["show", "qwen35_27b", "--set", "data.train_batch_size=-1"], 2, "train_batch_size"),
    Case("set-inf", ["show", "qwen35_27b", "--set", "actor.optim.lr=.inf"], 2, "finite number (got inf)"),
    Case("set-nan", ["show", "qwen35_27b", "--set", "cluster.device_memory_gib=.nan"], 2, "finite number"),
    Case("set-name", ["show", "qwen35_27b", "--set", "name=x"], 2, "unknown recipe path 'name'"),
    Case("render-format", ["render", "qwen35_27b", "--format", "yaml"], 2, "invalid choice: 'yaml'"),
    Case("recipe-device", ["render", "smoke_qwen35_2b", *GPU], 2, "pass --device npu"),
    Case(
        "reward-spec", ["render", "qwen35_27b", "--set", "reward.custom_function=nomod"], 2, "module:function"
    ),
    Case(
        "reward-module",
        ["render", "qwen35_27b", "--set", "reward.custom_function=no.such:f"],
        2,
        "importable",
    ),
    Case("dup-keys", ["show", f"{W}/recipes/dup.yaml"], 2, "duplicate key 'parallel'"),
    Case("not-utf8", ["show", f"{W}/recipes/latin1.yaml"], 2, "not UTF-8"),
    Case("recipe-dir", ["show", f"{W}/recipes/dir.yaml"], 2, "is a directory"),
    Case("recipe-list", ["show", f"{W}/recipes/list.yaml"], 2, "must be a mapping"),
    Case("recipe-yaml", ["show", f"{W}/recipes/broken.yaml"], 2, "line"),
    Case("recipe-cycle", ["show", f"{W}/recipes/cycle.yaml"], 2, "cycle"),
    Case("recipe-intkey", ["show", f"{W}/recipes/intkey.yaml"], 2, "must be a string"),
    Case("recipe-missing", ["show", f"{W}/recipes/none.yaml"], 2, "no such file"),
    Case("list-empty", ["list"], 2, "holds no *.yaml", env={"ENGINE_RECIPE_DIR": f"{W}/empty_recipes"}),
    Case("list-missing", ["list"], 2, "is not a directory", env={"ENGINE_RECIPE_DIR": f"{W}/nowhere"}),
    Case("list-broken", ["list"], 2, "broken.yaml", env={"ENGINE_RECIPE_DIR": f"{W}/recipes"}),
    Case("schema-format", ["schema", "--format", "txt"], 2, "invalid choice"),
    Case("no-command", [], 2, "required"),
    Case("unknown-command", ["frobnicate"], 2, "invalid choice: 'frobnicate'"),
    Case(
        "preflight-plan",
        ["preflight", "qwen35_27b", "--set", "parallel.fsdp=3"],
        2,
        "fsdp=3",
        prefix="preflight: ",
    ),
]
RUN_CASES = [
    Case("run-out-file", ["run", "qwen35_27b", *GPU, "--out", FILE], 3, "not a directory"),
    Case("run-out-under-file", ["run", "qwen35_27b", *GPU, "--out", f"{FILE}/run"], 3, "is a file"),
    Case("run-out-readonly", ["run", "qwen35_27b", *GPU, "--out", f"{RO}/run"], 3, "read-only"),
    Case("run-out-foreign", ["run", "qwen35_27b", *GPU, "--out", FOREIGN], 3, "holds no run"),
    Case("run-other-recipe", ["run", "qwen35_27b", *GPU, "--out", RUN], 3, "run of recipe 'tiny_cpu'"),
    Case("run-damaged", ["run", *TINY, "--out", f"{W}/damaged_run"], 3, "run.json is unreadable"),
    Case("run-keeps-bad-set", ["run", "tiny_cpu", "--out", RUN, "--set", "model.path="], 2, "empty value"),
    Case("run-keeps-preflight", ["run", *TINY, "--out", RUN, "--set", "parallel.ep=2"], 2, "parallel.ep=2"),
    Case(
        "run-keeps-data",
        ["run", *TINY, "--out", RUN, "--set", f"data.train_files={W}/x"],
        2,
        "file not found",
    ),
    Case("run-no-model", ["run", "qwen35_27b", *GPU, "--out", f"{W}/new_run"], 2, "model.path"),
    Case("run-device", ["run", "tiny_cpu", *GPU, "--out", RUN], 2, "pass --device cpu"),
    Case("run-unknown", ["run", "nope", "--out", f"{W}/new_run"], 2, "unknown recipe"),
    Case("run-no-recipe", ["run"], 2, "required: recipe"),
    Case("run-ckpt-dir", ["run", *TINY, "--out", RUN, "--set", "trainer.checkpoint_dir=/x"], 2, "pass --out"),
    Case("assets-out-file", ["assets", "--out", FILE], 3, "not a directory"),
    Case("assets-under-file", ["assets", "--out", f"{FILE}/x"], 3, "is a file"),
    Case("assets-foreign", ["assets", "--out", f"{W}/foreign_assets"], 3, "no assets.json"),
    Case("assets-size", ["assets", "--out", f"{W}/new", "--train-size", "0"], 2, "positive"),
    Case("assets-no-out", ["assets"], 2, "--out"),
    Case("make-model-foreign", ["make-model", "--out", FOREIGN], 3, "not empty"),
    Case("make-model-layers", ["make-model", "--out", f"{W}/new", "--layers", "0"], 2, "positive"),
    Case(
        "make-model-shape", ["make-model", "--out", f"{W}/new", "--model", "Qwen3.5-9B"], 2, "invalid choice"
    ),
    Case("data-out-file", ["prepare-data", "--dataset", "synthetic", "--out", FILE], 3, "not a directory"),
    Case("data-under-file", ["prepare-data", "--dataset", "synthetic", "--out", f"{FILE}/d"], 3, "is a file"),
    Case("data-readonly", ["prepare-data", "--dataset", "synthetic", "--out", f"{RO}/d"], 3, "read-only"),
    Case("data-half", ["prepare-data", "--dataset", "synthetic", "--out", f"{W}/half_data"], 3, "partially"),
    Case("data-no-source", ["prepare-data", "--dataset", "gsm8k", "--out", f"{W}/d"], 2, "--raw PATH"),
    Case(
        "data-raw-missing",
        ["prepare-data", "--dataset", "gsm8k", "--raw", f"{W}/nope", "--out", f"{W}/d"],
        2,
        "no such file",
    ),
    Case(
        "data-jsonl-as-parquet",
        ["prepare-data", "--dataset", "gsm8k", "--raw", f"{W}/raw/jsonl_as_parquet", "--out", f"{W}/d"],
        2,
        "not a readable parquet",
    ),
    Case(
        "data-parquet-as-jsonl",
        ["prepare-data", "--dataset", "gsm8k", "--raw", f"{W}/raw/parquet_as_jsonl", "--out", f"{W}/d"],
        2,
        "not UTF-8",
    ),
    Case(
        "data-lists",
        ["prepare-data", "--dataset", "gsm8k", "--raw", f"{W}/raw/lists", "--out", f"{W}/d"],
        2,
        "not a JSON object",
    ),
    Case(
        "data-columns",
        ["prepare-data", "--dataset", "gsm8k", "--raw", f"{W}/raw/columns", "--out", f"{W}/d"],
        2,
        "lacks column",
    ),
    Case(
        "data-split",
        ["prepare-data", "--dataset", "gsm8k", "--raw", f"{W}/raw/only_train", "--out", f"{W}/d"],
        2,
        "no rows for split",
    ),
    Case(
        "data-existing-keeps",
        ["prepare-data", "--dataset", "gsm8k", "--raw", f"{W}/raw/lists", "--out", f"{W}/data"],
        2,
        "not a JSON object",
    ),
    Case(
        "data-synthetic-raw",
        ["prepare-data", "--dataset", "synthetic", "--raw", W, "--out", f"{W}/d"],
        2,
        "drop",
    ),
    Case(
        "data-size",
        ["prepare-data", "--dataset", "synthetic", "--train-size", "0", "--out", f"{W}/d"],
        2,
        "positive",
    ),
    Case("data-dataset", ["prepare-data", "--dataset", "mnist", "--out", f"{W}/d"], 2, "invalid choice"),
]
RECORD_CASES = [
    Case("prov-missing", ["provenance", "write", f"{W}/nope"], 2, "does not exist"),
    Case("prov-not-run", ["provenance", "write", FOREIGN], 2, "not a run directory"),
    Case("prov-export", ["provenance", "write", RUN, "--export", f"{W}/nope"], 2, "--export"),
    Case("prov-data", ["provenance", "write", RUN, "--data", f"{W}/nope"], 2, "--data"),
    Case("prov-poorer", ["provenance", "write", RUN], 3, "inputs, the new record"),
    Case("prov-out-dir", ["provenance", "write", f"{W}/pdir_run"], 3, "is a directory"),
    Case("prov-damaged", ["provenance", "write", f"{W}/damaged_run"], 2, "not valid JSON"),
    Case("prov-no-action", ["provenance"], 2, "required"),
    Case("verify-missing", ["provenance", "verify", f"{W}/nope.json"], 2, "not found"),
    Case("verify-list", ["provenance", "verify", f"{W}/records/list.json"], 2, "got list"),
    Case("verify-empty", ["provenance", "verify", f"{W}/records/empty.json"], 2, "not a run record"),
    Case("verify-broken", ["provenance", "verify", f"{W}/records/broken.json"], 2, "not valid JSON"),
    Case("verify-latin1", ["provenance", "verify", f"{W}/records/latin1.json"], 2, "not UTF-8"),
    Case("verify-inputs", ["provenance", "verify", f"{W}/records/inputs.json"], 2, "'inputs' is not a list"),
    Case(
        "verify-entries", ["provenance", "verify", f"{W}/records/entries.json"], 2, "'outputs' is not a list"
    ),
    Case("rerun-missing", ["rerun", f"{W}/nope.json", "--out", f"{W}/r"], 2, "not found"),
    Case("rerun-list", ["rerun", f"{W}/records/list.json", "--out", f"{W}/r"], 2, "got list"),
    Case("rerun-norecipe", ["rerun", f"{W}/records/norecipe.json", "--out", f"{W}/r"], 2, "no recipe.file"),
    Case("rerun-no-yaml", ["rerun", f"{W}/records", "--out", f"{W}/r"], 2, "recipe.yaml is missing"),
    Case("rerun-out-full", ["rerun", RUN, "--out", FOREIGN], 3, "not empty"),
    Case("rerun-out-file", ["rerun", RUN, "--out", FILE], 3, "not a directory"),
    Case("rerun-rtol", ["rerun", RUN, "--out", f"{W}/r", "--rtol", "tight"], 2, "invalid float"),
    Case("rerun-rtol-nan", ["rerun", RUN, "--out", f"{W}/r", "--rtol", "nan"], 2, "must be finite"),
    Case(
        "rerun-tampered",
        ["rerun", f"{W}/tampered_run", "--out", f"{W}/r"],
        2,
        "1 file(s) it names changed since it was written (changed: recipe.yaml (run)",
    ),
    Case("rerun-tampered-dry", ["rerun", f"{W}/tampered_run", "--out", f"{W}/r", "--dry-run"], 2, "--allow"),
    Case("env-empty", ["verify-env", "--stack", ""], 2, "--stack is empty"),
    Case("env-unknown", ["verify-env", "--stack", "tpu"], 2, "unknown stack 'tpu'"),
    Case("env-output", ["verify-env", "--output", f"{W}/run/run.json"], 3, "not a verify-env record"),
    Case("env-output-dir", ["verify-env", "--output", FOREIGN], 3, "is a directory"),
    Case("env-output-under", ["verify-env", "--output", f"{FILE}/x.json"], 3, "is a file"),
    Case("env-pins-yaml", ["verify-env"], 2, "not valid YAML", env={"ENGINE_PINS": f"{W}/pins/broken.yaml"}),
    Case(
        "env-pins-dup", ["verify-env"], 2, "duplicate key 'engine'", env={"ENGINE_PINS": f"{W}/pins/dup.yaml"}
    ),
    Case("env-pins-list", ["verify-env"], 2, "needs top-level", env={"ENGINE_PINS": f"{W}/pins/list.yaml"}),
    Case("env-pins-latin1", ["verify-env"], 2, "not UTF-8", env={"ENGINE_PINS": f"{W}/pins/latin1.yaml"}),
    Case("env-pins-missing", ["verify-env"], 2, "not found", env={"ENGINE_PINS": f"{W}/pins/none.yaml"}),
    Case(
        "env-pins-packages",
        ["verify-env"],
        2,
        "stacks.cpu has no 'packages' mapping of package: version",
        env={"ENGINE_PINS": f"{W}/pins/no_packages.yaml"},
    ),
    Case(
        "env-pins-holes",
        ["verify-env", "--stack", "gpu"],
        2,
        "no engine.version value; no fsdp_turbo.commit value; stacks.cpu has no 'packages'",
        env={"ENGINE_PINS": f"{W}/pins/holes.yaml"},
    ),
    Case("wh-nothing", ["wheelhouse", "build", "--out", f"{W}/wh"], 2, "nothing to put"),
    Case(
        "wh-req-missing",
        ["wheelhouse", "build", "-r", f"{W}/nope.lock", "--out", f"{W}/wh"],
        2,
        "no such file",
    ),
    Case(
        "wh-latin1",
        ["wheelhouse", "build", "-r", f"{W}/locks/latin1.lock", "--out", f"{W}/wh"],
        2,
        "not UTF-8",
    ),
    Case("wh-range", ["wheelhouse", "build", "-r", f"{W}/locks/range.lock", "--out", f"{W}/wh"], 2, "exact"),
    Case("wh-twice", ["wheelhouse", "build", "-r", f"{W}/locks/twice.lock", "--out", f"{W}/wh"], 2, "twice"),
    Case(
        "wh-part", ["wheelhouse", "build", "a==1", "--max-part-mib", "0", "--out", f"{W}/wh"], 2, "positive"
    ),
    Case(
        "wh-python", ["wheelhouse", "build", "a==1", "--python-version", "3", "--out", f"{W}/wh"], 2, "MAJOR"
    ),
    Case("wh-out-file", ["wheelhouse", "build", "a==1", "--out", FILE], 3, "not a directory"),
    Case("wh-out-full", ["wheelhouse", "build", "a==1", "--out", FOREIGN], 3, "not empty"),
    Case("wh-out-tar", ["wheelhouse", "build", "a==1", "--out", f"{W}/wheelhouse/out.tar"], 3, "exists"),
    Case(
        "wh-skip-from",
        ["wheelhouse", "build", "a==1", "--skip-from", f"{W}/x", "--out", f"{W}/wh"],
        2,
        "no such",
    ),
    Case("wh-install", ["wheelhouse", "install", f"{W}/nope"], 2, "no such wheelhouse"),
    Case("wh-no-manifest", ["wheelhouse", "verify", FOREIGN], 2, "no manifest.json"),
    Case("wh-not-json", ["wheelhouse", "verify", f"{W}/wheelhouse/not_json"], 2, "not valid JSON"),
    Case("wh-keyless", ["wheelhouse", "verify", f"{W}/wheelhouse/keyless"], 2, "'wheels' is not a list"),
    Case("wh-bad-parts", ["wheelhouse", "verify", f"{W}/wheelhouse/bad_parts"], 2, "'wheels' is not a list"),
    Case("wh-missing-file", ["wheelhouse", "verify", f"{W}/wheelhouse/missing_file"], 2, "missing"),
    Case(
        "wh-mismatch",
        ["wheelhouse", "install", f"{W}/wheelhouse/mismatch", "--dry-run"],
        2,
        "sha256 mismatch",
    ),
    Case("wh-broken-tar", ["wheelhouse", "verify", f"{W}/wheelhouse/broken.tar"], 2, "no manifest.json"),
    Case("smoke-missing", ["smoke-report", f"{W}/nope"], 2, "no such run directory"),
    Case("smoke-no-steps", ["smoke-report", FOREIGN], 2, "metrics.jsonl has no steps"),
    Case("smoke-damaged", ["smoke-report", RUN, "--max-probs-diff", "low"], 2, "invalid float value"),
]
CLUSTER_CASES = [
    Case("script-preflight", [*SCRIPT[:4], "--nodes", "3", *SCRIPT[6:]], 2, "not divisible"),
    Case("script-one-node", [*SCRIPT[:4], "--nodes", "1", *SCRIPT[6:]], 2, "2 or more nodes"),
    Case(
        "script-device",
        ["script", "qwen35_35b", "--device", "cpu", *SCRIPT[4:]],
        2,
        "supports devices gpu, npu",
    ),
    Case("script-port", [*SCRIPT, "--port", "70000"], 2, "--port 70000"),
    Case("script-cpus", [*SCRIPT[:6], "--cpus-per-node", "0", *SCRIPT[8:]], 2, "must be positive"),
    Case("script-contradiction", [*SCRIPT, "--set", "cluster.device=npu"], 2, "contradicts --device"),
    Case("script-nodes", [*SCRIPT, "--set", "cluster.nodes=4"], 2, "contradicts --nodes 2"),
    Case("launch-out-file", [*LAUNCH, "--out", FILE], 3, "not a directory"),
    Case("launch-out-foreign", [*LAUNCH, "--out", FOREIGN], 3, "holds no run"),
    Case("wait-no-address", ["wait", "--nodes", "2"], 2, "RAY_ADDRESS is not set", env={"RAY_ADDRESS": None}),
    Case(
        "wait-timeout",
        ["wait", "--nodes", "2", "--timeout", "1"],
        4,
        "0 of 2 Ray node(s) alive",
        env={"RAY_ADDRESS": "127.0.0.1:1"},
    ),
    Case("wait-nodes", ["wait", "--nodes", "0"], 2, "positive", env={"RAY_ADDRESS": "127.0.0.1:1"}),
]
BENCH_CASES = [
    (overhead.bench_main, Case("bench-out-file", ["qwen35_27b", *GPU, "--out", FILE], 3, "not a directory")),
    (
        overhead.bench_main,
        Case("bench-foreign", ["qwen35_27b", *GPU, "--out", FOREIGN], 3, "bench did not write"),
    ),
    (
        overhead.bench_main,
        Case("bench-keeps-set", ["tiny_cpu", "--out", f"{W}/bench", "--set", "model.path="], 2, "empty"),
    ),
    (
        overhead.bench_main,
        Case("bench-keeps-device", ["tiny_cpu", "--device", "npu", "--out", f"{W}/bench"], 2, "--device"),
    ),
    (
        overhead.bench_main,
        Case("bench-keeps-plan", [*TINY, "--out", f"{W}/bench", "--set", "parallel.ep=2"], 2, "ep=2"),
    ),
    (overhead.bench_main, Case("bench-arg", ["tiny_cpu", "--max-wall", "soon"], 2, "invalid float value")),
    (overhead.bench_main, Case("bench-inf", ["tiny_cpu", "--max-wall", "inf"], 2, "must be finite")),
    (gpu_bench.cli_main, Case("gb-model", ["run", "--model", f"{W}/nope"], 2, "no config.json")),
    (
        gpu_bench.cli_main,
        Case("gb-batch", ["run", "--model", f"{W}/model", "--batch", "3", "--mbs", "2"], 2, "multiple"),
    ),
    (
        gpu_bench.cli_main,
        Case("gb-modes", ["run", "--model", f"{W}/model", "--modes", "warp"], 2, "unknown --modes"),
    ),
    (
        gpu_bench.cli_main,
        Case("gb-out", ["run", "--model", f"{W}/model", "--out", FILE], 3, "bench-gpu rows"),
    ),
    (gpu_bench.cli_main, Case("gb-action", [], 2, "required")),
    (
        gpu_bench.cli_main,
        Case("gb-levers", ["run", "--model", f"{W}/model", "--levers", "warp"], 2, "unknown lever"),
    ),
    (compare.cli_main, Case("cmp-rows", [f"{W}/nope.jsonl"], 2, "not bench-gpu rows")),
    (compare.cli_main, Case("cmp-base", [FILE, "--baseline", FILE], 2, "unreadable")),
    (numerics.main, Case("num-model", ["--model", f"{W}/nope"], 2, "no config.json")),
    (export_bench.bench_main, Case("xb-workdir", ["--workdir", FOREIGN], 3, "export bench did not write")),
    (export_bench.bench_main, Case("xb-json", ["--json", FOREIGN], 3, "is a directory")),
]
CONTAINER_CASES = [
    (lock.main, Case("lock-cpu", ["--stack", "cpu"], 2, "--stack cpu has no locks")),
    (lock.main, Case("lock-unknown", ["--stack", "tpu"], 2, "unknown stack 'tpu'")),
    (lock.main, Case("lock-flag", ["--bogus"], 2, "unrecognized arguments")),
    (
        lock.main,
        Case(
            "lock-latin1",
            ["--check", "--stack", "gpu"],
            2,
            "not UTF-8",
            env={"ENGINE_PINS": f"{W}/pins/latin1_lock.yaml"},
        ),
    ),
    (
        lock.main,
        Case("lock-pins", ["--check"], 2, "not valid YAML", env={"ENGINE_PINS": f"{W}/pins/broken.yaml"}),
    ),
    (
        image_build.main,
        Case("build-arg", ["gpu", "--dry-run", "--build-arg", "KEY"], 2, "expected KEY=VALUE"),
    ),
    (
        image_build.main,
        Case("build-arg-name", ["gpu", "--dry-run", "--build-arg", "PIP_CRT=1"], 2, "PIP_CERT"),
    ),
    (image_build.main, Case("build-cpu", ["cpu", "--dry-run"], 2, "not an image")),
    (image_build.main, Case("build-unresolved", ["gpu", "--dry-run"], 2, "containers.resolve")),
    (image_build.main, Case("build-no-stack", [], 2, "required: stack")),
    (resolve.main, Case("resolve-flag", ["--bogus"], 2, "unrecognized arguments")),
    (localtest.main, Case("localtest-arg", ["now"], 2, "unrecognized arguments")),
]


def _run(main, case: Case, world: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    case.argv = [a.replace(RO, str(read_only_dir(world))) for a in case.argv]
    check(main, case, world, capsys, monkeypatch)


@pytest.mark.parametrize("case", RECIPE_CASES + RUN_CASES + RECORD_CASES, ids=lambda c: c.id)
def test_engine_command_refuses_cleanly(case: Case, world: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _run(cli.main, case, world, capsys, monkeypatch)


@pytest.mark.parametrize("case", CLUSTER_CASES, ids=lambda c: c.id)
def test_cluster_refuses_cleanly(case: Case, world: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _run(cluster.cli_main, case, world, capsys, monkeypatch)


@pytest.mark.parametrize(("main", "case"), BENCH_CASES, ids=lambda c: getattr(c, "id", ""))
def test_benchmark_refuses_cleanly(main, case: Case, world: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _run(main, case, world, capsys, monkeypatch)


@pytest.mark.parametrize(("main", "case"), CONTAINER_CASES, ids=lambda c: getattr(c, "id", ""))
def test_container_tool_refuses_cleanly(main, case: Case, world: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    _run(main, case, world, capsys, monkeypatch)
