"""Regression baselines: the seeded ones are `record` over the kept H200 records; comparisons replay them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import compare
from engine.errors import UserError
from tests.conftest import ROOT

DENSE_TAG, MOE_TAG = "qwen3_5_text 24L h1024", "qwen3_5_moe_text 6L h2048 256e"
SEEDS = {  # baseline file -> (records it was made from, model tag of their rows)
    "h200-2026-12-01-dense-0p8b.json": (
        [f"docs/records/h200-vllm-2026-12-01/bench/rep{i}.jsonl" for i in (1, 2, 3)],
        DENSE_TAG,
    ),
    "h200-2026-12-01-moe-35b-a3b-6l.json": (["docs/records/h200-moe-2026-12-01/bench/moe.jsonl"], MOE_TAG),
    "h200-2026-12-04-moe-levers.json": (["docs/records/h200-levers-2026-12-04/bench/moe.jsonl"], None),
    "h200-2026-12-04-dense-levers.json": (["docs/records/h200-levers-2026-12-04b/bench/dense.jsonl"], None),
    "h100-2026-12-05-moe-bf16.json": (
        [f"docs/records/h100-levers-2026-12-05/bench/moe-{step}.jsonl" for step in ("torchao", "compiled")],
        None,
    ),
    "h200-2026-12-05-dense-fast.json": (["docs/records/h200-dense-2026-12-05/bench/dense-fast.jsonl"], None),
    "h100-2026-12-06-compiled-logprobs.json": (
        [
            f"docs/records/h100-compiled-logprobs-2026-12-06/bench/{stage}.jsonl"
            for stage in ("dense-varlen", "moe-bf16")
        ],
        None,
    ),
    "h100-2026-12-06-dense-text-only.json": (
        ["docs/records/h100-dense-text-only-2026-12-06/bench/dense-varlen.jsonl"],
        None,
    ),
    "h100-2026-12-06-moe-lean.json": (
        [f"docs/records/h100-moe-lean-2026-12-06/bench/{stage}.jsonl" for stage in ("moe-lean", "moe-base")],
        None,
    ),
    "h100-2026-12-07-lean-phases.json": (
        [
            f"docs/records/h100-lean-phases-2026-12-07/bench/{stage}.jsonl"
            for stage in ("moe-lean", "dense-varlen")
        ],
        None,
    ),
    "h100-2026-12-07-deferred.json": (
        [
            f"docs/records/h100-deferred-2026-12-07/bench/{stage}.jsonl"
            for stage in ("moe-lean", "moe-deferred", "dense-lean", "dense-deferred", "dense-ratio-deferred")
        ],
        None,
    ),
    "h100-2026-12-07-packing.json": (["docs/records/h100-packing-2026-12-07/bench/moe-packing.jsonl"], None),
    "h100-2026-12-07-ragged.json": (
        [
            f"docs/records/h100-ragged-2026-12-07/bench/{stage}.jsonl"
            for stage in (
                "moe-ragged-profile",
                "moe-full-profile",
                "moe-packing-full",
                "moe-ragged-sdpa",
                "moe-full-sdpa",
            )
        ],
        None,
    ),
    "h100-2026-12-08-sdpa.json": (
        ["docs/records/h100-sdpa-2026-12-08/bench/moe-ragged-sdpa-kernels.jsonl"],
        None,
    ),
}
OLD_MOE = compare.BASELINES / "h200-2026-12-01-moe-35b-a3b-6l.json"
OLD_DENSE = compare.BASELINES / "h200-2026-12-01-dense-0p8b.json"


@pytest.mark.parametrize("name", sorted(SEEDS))
def test_seeded_baselines_are_the_records_summarised(name: str) -> None:
    committed = json.loads((compare.BASELINES / name).read_text())
    records, tag = SEEDS[name]
    rows = [row for path in records for row in compare.read_rows(ROOT / path, tag)]
    meta = {k: committed[k] for k in ("date", "commit", "machine", "command", "source")}
    assert compare.make_baseline(rows, meta) == committed
    assert committed["source"].split() == records


def test_the_model_tags_are_the_registry_shapes() -> None:
    import transformers

    from benchmarks.gpu_bench import model_tag
    from engine.recipes import models

    dense = transformers.AutoConfig.for_model(
        "qwen3_5", text_config=models.lookup("Qwen3.5-0.8B").text_config()
    )
    cut = models.lookup("Qwen3.5-35B-A3B-6L").text_config()
    assert model_tag(dense) == DENSE_TAG
    assert model_tag(transformers.AutoConfig.for_model("qwen3_5_moe", text_config=cut)) == MOE_TAG


def _run(rows: Path, *extra: str) -> tuple[int, str]:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "benchmarks.compare", str(rows), *extra]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


def test_one_repeat_against_the_median_of_three_names_what_moved() -> None:
    """rep 1 of the dense record against the median of its three repeats: verl's rows 6.4% and 5.1% slower."""
    rep1 = ROOT / "docs/records/h200-vllm-2026-12-01/bench/rep1.jsonl"
    code, out = _run(rep1, "--model", DENSE_TAG, "--baseline", str(OLD_DENSE))
    regressed = [line for line in out.splitlines() if line.startswith("regressed")]
    assert code == 1 and len(regressed) == 2
    assert all("tokens_per_s" in line for line in regressed)
    assert "mode=verl-padded" in regressed[0] and "(-6.4%, tolerance 5%" in regressed[0]
    assert "mode=verl-packed" in regressed[1] and "(-5.1%, tolerance 5%" in regressed[1]


def test_slower_or_larger_runs_regress_faster_or_smaller_do_not(tmp_path: Path) -> None:
    record = compare.read_rows(ROOT / "docs/records/h200-moe-2026-12-01/bench/moe.jsonl", MOE_TAG)
    baselines = compare.load_baselines([OLD_MOE])

    def verdicts(speed: float, memory: float) -> set[tuple[str, str]]:
        rows = [
            r | {"tokens_per_s": r["tokens_per_s"] * speed, "peak_alloc_gib": r["peak_alloc_gib"] * memory}
            for r in record
        ]
        return {(line["figure"], line["verdict"]) for line in compare.compare(rows, baselines, 0.05, 0.01)}

    assert verdicts(1.0, 1.0) == {("tokens_per_s", "within"), ("peak_alloc_gib", "within")}
    assert verdicts(0.94, 1.0) == {("tokens_per_s", "regressed"), ("peak_alloc_gib", "within")}
    assert verdicts(1.0, 1.02) == {("tokens_per_s", "within"), ("peak_alloc_gib", "regressed")}
    assert verdicts(1.2, 0.5) == {("tokens_per_s", "improved"), ("peak_alloc_gib", "improved")}
    assert verdicts(float("nan"), 1.0) == {("tokens_per_s", "regressed"), ("peak_alloc_gib", "within")}
    for r in record:
        r["model"] = "another model"
    assert {line["verdict"] for line in compare.compare(record, baselines, 0.05, 0.01)} == {"no baseline"}
    out = tmp_path / "run.jsonl"
    out.write_text("".join(json.dumps(r | {"tokens_per_s": 1.0}) + "\n" for r in record))
    assert _run(out)[0] == 0  # nothing to compare with is no regression


def test_a_newer_baseline_wins_and_a_foreign_file_is_refused(tmp_path: Path) -> None:
    older = json.loads((compare.BASELINES / "h200-2026-12-01-moe-35b-a3b-6l.json").read_text())
    newer = older | {
        "date": "2026-12-09",
        "rows": [r | {"tokens_per_s": 2 * r["tokens_per_s"]} for r in older["rows"]],
    }
    (tmp_path / "old.json").write_text(json.dumps(older))
    (tmp_path / "new.json").write_text(json.dumps(newer))
    baselines = compare.load_baselines([tmp_path / "new.json", tmp_path / "old.json"])
    rows = compare.read_rows(ROOT / "docs/records/h200-moe-2026-12-01/bench/moe.jsonl", MOE_TAG)
    lines = [
        line for line in compare.compare(rows, baselines, 0.05, 0.01) if line["figure"] == "tokens_per_s"
    ]
    assert {line["baseline_file"] for line in lines} == {"new.json"}
    assert {line["verdict"] for line in lines} == {"regressed"}
    (tmp_path / "bad.json").write_text(json.dumps({"schema": "other"}))
    with pytest.raises(UserError, match="schema"):
        compare.load_baselines([tmp_path / "bad.json"])


def test_the_lever_run_replays_its_comparison_with_the_first_baseline() -> None:
    """The 2026-12-04 lever run (medians of three) against the 2026-12-01 single repeat, as the GPU job
    printed it (compare-moe.json): baseline 4/2/2048 improved by 10.8%, 4/4/2048 within at +2.3%, peaks
    within, every lever row new."""
    record = ROOT / "docs/records/h200-levers-2026-12-04/bench"
    rows = compare.read_rows(record / "moe.jsonl")
    lines = compare.compare(rows, compare.load_baselines([OLD_MOE]), 0.05, 0.01)
    assert lines == json.loads((record / "compare-moe.json").read_text())
    speed = {line["config"]: line["verdict"] for line in lines if line["figure"] == "tokens_per_s"}
    assert sorted(speed.values()) == ["improved", "within"]
    assert not any(line["regression"] for line in lines)


def test_the_dense_run_says_which_figure_moved_since_the_first_dense_baseline() -> None:
    """The 2026-12-04 dense repeat against the 2026-12-01 medians (compare-dense.json): plain FSDP2 +44.5%,
    verl's engine -14.3% (a regression beyond 5%, exit 1), both peaks unchanged, the lever rows new."""
    record = ROOT / "docs/records/h200-levers-2026-12-04b/bench"
    lines = compare.compare(
        compare.read_rows(record / "dense.jsonl"), compare.load_baselines([OLD_DENSE]), 0.05, 0.01
    )
    assert lines == json.loads((record / "compare-dense.json").read_text())
    moved = {(line["config"].split("mode=")[1].split()[0], line["figure"]): line["verdict"] for line in lines}
    assert moved[("plain", "tokens_per_s")] == "improved"
    assert moved[("verl-packed", "tokens_per_s")] == "regressed"
    assert moved[("plain", "peak_alloc_gib")] == moved[("verl-packed", "peak_alloc_gib")] == "within"
    assert [line["regression"] for line in lines].count(True) == 1


def test_rows_of_engine_runs_host_syncs_match_the_older_baselines() -> None:
    """Rows recorded before `--host-syncs` existed key as the default (`lean`, what `engine run` does):
    a row at the default meets the baseline, one of verl's own code paths is a configuration of its own."""
    record = compare.read_rows(ROOT / "docs/records/h200-moe-2026-12-01/bench/moe.jsonl", MOE_TAG)
    baselines = compare.load_baselines([OLD_MOE])
    for host_syncs, verdicts in (("lean", {"within"}), ("verl", {"no baseline"})):
        rows = [r | {"host_syncs": None if r["mode"] == "plain" else host_syncs} for r in record]
        lines = compare.compare(rows, baselines, 0.05, 0.01)
        verl_rows = [line for line in lines if "mode=plain" not in line["config"]]
        assert verl_rows and {line["verdict"] for line in verl_rows} == verdicts
        assert all(("host_syncs=verl" in line["config"]) == (host_syncs == "verl") for line in verl_rows)


def test_a_bundles_row_meets_the_baseline_of_its_parts() -> None:
    """`fast-text-bf16` is the lean MoE set under one name: its row compares with the baseline recorded
    under the parts' names (levers compare by what they set); a name no lever has stays its own."""
    record = ROOT / "docs/records/h100-lean-phases-2026-12-07/bench/moe-lean.jsonl"
    rows = [r for r in compare.read_rows(record) if "error" not in r]
    baselines = compare.load_baselines([compare.BASELINES / "h100-2026-12-07-lean-phases.json"])
    renamed = [r | {"levers": "fast-text-bf16"} for r in rows]
    lines = compare.compare(renamed, baselines, 0.05, 0.01)
    assert {line["verdict"] for line in lines} == {"within"}
    assert all("levers=fast-text-bf16" in line["config"] for line in lines)
    retired = compare.compare([r | {"levers": "turbo"} for r in rows], baselines, 0.05, 0.01)
    assert {line["verdict"] for line in retired} == {"no baseline"}


def test_a_figure_of_another_gpu_is_no_baseline(tmp_path: Path) -> None:
    """The H200 baselines never judge an H100 run (the same configuration on slower memory would
    'regress'); the line says where the configuration was measured. A baseline is one device's rows."""
    record = compare.read_rows(ROOT / "docs/records/h200-moe-2026-12-01/bench/moe.jsonl", MOE_TAG)
    baselines = compare.load_baselines([OLD_MOE])
    h100 = [r | {"device": "NVIDIA H100 80GB HBM3", "tokens_per_s": 0.5 * r["tokens_per_s"]} for r in record]
    lines = compare.compare(h100, baselines, 0.05, 0.01)
    assert {line["verdict"] for line in lines} == {"no baseline"}
    assert {line["note"] for line in lines} == {"on NVIDIA H100 80GB HBM3; measured on NVIDIA H200 only"}
    assert not any(line["regression"] for line in lines)
    meta = {"date": "2026-12-05", "commit": "c", "machine": "m", "command": "x", "source": "s"}
    with pytest.raises(UserError, match="NVIDIA H100 80GB HBM3, NVIDIA H200: record each device"):
        compare.make_baseline(record + h100, meta)
    assert compare.make_baseline(h100, meta)["stack"]["device"] == "NVIDIA H100 80GB HBM3"


def test_the_compiled_bf16_step_against_torchaos_on_the_h100() -> None:
    """The 2026-12-05 H100 rows (docs/reference/trainer-levers.md): at 4/4/2048 the compiled bf16 step is
    1.45x torchao's per-tensor one, same peak, neither compared with an H200 figure."""
    record = ROOT / "docs/records/h100-levers-2026-12-05/bench"
    rows = [r for step in ("torchao", "compiled") for r in compare.read_rows(record / f"moe-{step}.jsonl")]
    speed = {row["levers"]: row["tokens_per_s"] for row in rows}
    assert round(speed["fast-bf16-reduce+bf16-sr-compiled"] / speed["fast-bf16-reduce"], 2) == 1.45
    optimizers = {"torchao.optim.adam._AdamW", "engine.runtime.optim.BF16AdamW"}
    assert {row["optimizer"] for row in rows} == optimizers
    assert {row["peak_alloc_gib"] for row in rows} == {67.77}
    h200 = compare.load_baselines(sorted(compare.BASELINES.glob("h200-*.json")))
    assert {line["verdict"] for line in compare.compare(rows, h200, 0.05, 0.01)} == {"no baseline"}


def test_the_2026_12_05_dense_run_against_its_predecessor() -> None:
    """The replayed H200 run of 2026-12-05 (3 repeats) against the 2026-12-04 baseline (one repeat, another
    host): both rows slower beyond 5%, memory within 1%, which is what the run's compare reported."""
    rows = compare.read_rows(ROOT / "docs/records/h200-dense-2026-12-05/bench/dense-fast.jsonl")
    old = compare.load_baselines([compare.BASELINES / "h200-2026-12-04-dense-levers.json"])
    found = {
        (line["config"].split()[3], line["figure"]): line for line in compare.compare(rows, old, 0.05, 0.01)
    }
    assert {key: line["verdict"] for key, line in found.items()} == {
        ("mode=plain", "tokens_per_s"): "regressed",
        ("mode=plain", "peak_alloc_gib"): "within",
        ("mode=verl-packed", "tokens_per_s"): "regressed",
        ("mode=verl-packed", "peak_alloc_gib"): "within",
    }
    assert found[("mode=plain", "tokens_per_s")]["change"] == pytest.approx(-0.354, abs=1e-3)
