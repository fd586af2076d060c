"""Export: synthetic sharded checkpoints written by 4 gloo ranks merge back to the exact model.

Layouts: real `fully_shard` on `("fsdp",)` and `("ddp","fsdp")`; fsdp_turbo-like `("dp_fsdp",)` with
experts on an `("ep","efsdp")` mesh and replicated plain tensors; nested 2-D `("dp","fsdp")` sharding
(two mesh dims splitting one tensor dim, uneven chunks).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from benchmarks.synthetic_checkpoints import write_synthetic_checkpoints  # noqa: E402
from engine import cli, errors  # noqa: E402
from engine.checkpoint import experts, export, merge, verify  # noqa: E402
from engine.errors import UserError  # noqa: E402

TEXT = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
            linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"])  # fmt: skip
VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2)  # fmt: skip
LAYOUTS = [
    ("dense", "fsdp2"),
    ("dense", "hsdp"),
    ("dense", "nested2d"),
    ("moe", "turbo"),
    ("moe", "nested2d"),
]


def _tiny(kind: str, root: Path) -> tuple[Path, Path]:
    torch.manual_seed(0)
    if kind == "moe":
        text = TEXT | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                           shared_expert_intermediate_size=16)  # fmt: skip
        config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=VISION)
        model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    else:
        config = transformers.Qwen3_5Config(
            text_config=TEXT | {"intermediate_size": 32}, vision_config=VISION
        )
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    model.save_pretrained(root / kind)
    torch.save(model.state_dict(), root / f"{kind}.pt")
    return root / kind, root / f"{kind}.pt"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("ckpt")
    models = {kind: _tiny(kind, root) for kind in ("dense", "moe")}
    jobs, out = [], {}
    for kind, layout in LAYOUTS:
        out[(kind, layout)] = root / f"{kind}_{layout}"
        model_dir, source = models[kind]
        job = {"layout": layout, "out": str(out[(kind, layout)]), "step": 3, "model_dir": str(model_dir)}
        jobs.append(job | {"source": str(source)})
    write_synthetic_checkpoints(jobs, world=4)
    out.update({("source", kind): models[kind][1] for kind in models})
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "layout"), LAYOUTS)
def test_mesh_agnostic_merge_is_exact(checkpoints: dict, kind: str, layout: str) -> None:
    files = merge.rank_files(merge.resolve_actor_dir(checkpoints[(kind, layout)]))
    assert len(files) == 4
    with merge.quiet_mesh_warnings():
        plans = merge.plan_merge(files)
        merged = dict(merge.iter_merged(files, plans.values()))
    original = torch.load(checkpoints[("source", kind)])
    assert merged.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(merged[key], tensor), key
    expected_meshes = {"fsdp2": {("fsdp",)}, "hsdp": {("ddp", "fsdp")}, "nested2d": {("dp", "fsdp")}}
    expected_meshes["turbo"] = {("dp_fsdp",), ("ep", "efsdp")}
    assert merge.mesh_names(plans) == expected_meshes[layout]


@pytest.mark.slow
def test_verl_merger_rejects_turbo_meshes_and_auto_falls_back(checkpoints: dict, tmp_path: Path) -> None:
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    with pytest.raises(AssertionError, match="Unsupported mesh_dim_names"):
        FSDPModelMerger._calculate_shard_configuration(None, None, ("dp_fsdp",))
    from engine.records import publish

    card = publish.card_for(merge.resolve_actor_dir(checkpoints[("moe", "turbo")]), None)
    report = export.export(
        checkpoints[("moe", "turbo")], tmp_path / "out", logits=True, shard_size=64 << 10, card=card
    )
    assert report["method"] == "dtensor"
    out = tmp_path / "out"
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in names and "model.safetensors" not in names
    assert {"README.md", "SHA256SUMS", "export.json", "config.json"} <= set(names)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "model.language_model.layers.0.mlp.experts.3.up_proj.weight" in index["weight_map"]
    assert not [k for k in index["weight_map"] if k.endswith("experts.gate_up_proj")]
    assert report["verification"]["structure"]["expert_keys"] == 2 * 4 * 3
    assert report["verification"]["logits"]["max_abs_diff_same_weights"] <= verify.LOGITS_ATOL_SAME_WEIGHTS
    subprocess.run(["sha256sum", "--check", "--quiet", "SHA256SUMS"], cwd=out, check=True)
    assert "Qwen3_5MoeForConditionalGeneration" in (out / "README.md").read_text()
    assert not list(tmp_path.glob(".out.partial-*"))


@pytest.mark.slow
def test_dtensor_export_in_fp32_reloads_bitwise(checkpoints: dict, tmp_path: Path) -> None:
    export.export(checkpoints[("dense", "nested2d")], tmp_path / "fp32", dtype="fp32")
    reloaded = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "fp32")
    original = torch.load(checkpoints[("source", "dense")])
    for key, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, original[key]), key


@pytest.mark.slow
def test_verl_merger_path_is_verified(checkpoints: dict, tmp_path: Path) -> None:
    report = export.export(checkpoints[("dense", "fsdp2")], tmp_path / "verl", logits=True)
    assert report["method"] == "verl"
    assert report["verification"]["structure"]["dtype"] == "BF16"
    assert report["verification"]["logits"]["max_abs_diff_same_weights"] <= verify.LOGITS_ATOL_SAME_WEIGHTS


@pytest.mark.slow
def test_moe_logit_check_counts_router_choices_and_gates_on_the_same_weights(
    checkpoints: dict, tmp_path: Path
) -> None:
    """MoE: the export must equal the checkpoint rounded to bf16 (the gate); how far rounding moves the
    logits of the fp32 weights depends on routing decisions crossing the top-k boundary, so it is reported
    with the share of router choices that changed."""
    report = export.export(checkpoints[("moe", "nested2d")], tmp_path / "moe", logits=True)
    logits = report["verification"]["logits"]
    assert logits["full_precision_gated"] is False
    assert 0.0 <= logits["routing_changed_share"] <= 1.0
    assert logits["max_abs_diff_same_weights"] <= verify.LOGITS_ATOL_SAME_WEIGHTS
    dense = export.export(checkpoints[("dense", "hsdp")], tmp_path / "dense", logits=True)
    assert dense["verification"]["logits"]["full_precision_gated"] is True
    assert "routing_changed_share" not in dense["verification"]["logits"]


@pytest.mark.slow
def test_broken_checkpoints_fail_cleanly_and_leave_nothing(checkpoints: dict, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(checkpoints[("moe", "turbo")], broken)
    actor = broken / "global_step_3" / "actor"
    (actor / "model_world_size_4_rank_2.pt").unlink()
    with pytest.raises(UserError, match="rank files missing for ranks \\[2\\]"):
        export.export(broken, tmp_path / "a")
    shutil.copy(actor / "model_world_size_4_rank_1.pt", actor / "model_world_size_4_rank_2.pt")
    with pytest.raises(UserError, match=r"local shape|cover"):
        export.export(broken, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert not list(tmp_path.glob(".*partial*"))


def _damaged(source: Path, dest: Path, change: Any) -> Path:
    """A copy of a checkpoint whose lm_head is changed in every rank file."""
    shutil.copytree(source, dest)
    for rank_file in dest.glob("global_step_*/actor/model_world_size_*_rank_*.pt"):
        state = torch.load(rank_file, weights_only=False)
        state["lm_head.weight"]._local_tensor = change(state["lm_head.weight"]._local_tensor)
        torch.save(state, rank_file)
    return dest


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """`engine export ARGV` exits 2 with one `error:` line (transformers' loading bar may precede it) and
    leaves nothing beside --out; returns the line."""
    out = Path(argv[argv.index("--out") + 1])
    assert errors.boundary(cli.main, argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], lines
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))
    return lines[-1]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["auto", "verl", "dtensor"])
def test_a_float_stored_as_int16_is_refused_by_every_method(
    checkpoints: dict, method: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A changed pickled storage type: verl's merger cast it to bf16 zeros, the DTensor merge wrote I16,
    and both exported with exit 0 as "BF16"."""
    int16 = _damaged(checkpoints[("dense", "fsdp2")], tmp_path / "int16", lambda t: t.to(torch.int16))
    line = _refused(["export", str(int16), "--out", str(tmp_path / "out"), "--method", method], capsys)
    assert "lm_head.weight is stored as torch.int16 where the model has a floating tensor" in line


@pytest.mark.slow
@pytest.mark.parametrize(
    ("value", "message"),
    [
        (math.nan, "tensor(s) hold NaN or infinity (lm_head.weight)"),
        (math.inf, "tensor(s) hold NaN or infinity (lm_head.weight)"),
        # finite weights (bf16 holds 3e38) whose logits overflow: every comparison with them is NaN
        (3e38, "logits differ from the checkpoint's: {'max_abs_diff_same_weights': nan"),
    ],
    ids=["nan", "inf", "overflow"],
)
def test_verify_logits_fails_on_weights_or_logits_that_are_not_finite(
    checkpoints: dict, value: float, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _damaged(checkpoints[("dense", "fsdp2")], tmp_path / "bad", lambda t: t.fill_(value))
    line = _refused(["export", str(bad), "--out", str(tmp_path / "out"), "--verify-logits"], capsys)
    assert message in line


@pytest.mark.slow
def test_the_card_quotes_only_a_record_that_verifies_and_names_the_checkpoint(
    checkpoints: dict, tmp_path: Path
) -> None:
    from engine.records import provenance, publish
    from tests.support.runs import fake_run

    run = fake_run(tmp_path)
    shutil.rmtree(run / "checkpoints")
    shutil.copytree(checkpoints[("dense", "fsdp2")], run / "checkpoints")
    record = provenance.write(run)
    assert (
        publish.export_main(
            [str(run / "checkpoints"), "--out", str(tmp_path / "out"), "--record", str(record)]
        )
        == 0
    )
    assert json.loads((tmp_path / "out" / "export.json").read_text())["method"] == "verl"
    card = (tmp_path / "out" / "README.md").read_text()
    assert "- earlier record: overrides sha256" in card
    (run / "recipe.yaml").write_text("name: edited\n")  # after the record was written
    with pytest.raises(UserError, match=r"--record .*changed: recipe.yaml \(run\)"):
        publish.export_main(
            [str(run / "checkpoints"), "--out", str(tmp_path / "again"), "--record", str(record)]
        )
    assert not (tmp_path / "again").exists()


def test_checkpoint_tensors_are_held_to_the_skeleton_before_merging() -> None:
    config = transformers.Qwen3_5Config(
        text_config=TEXT | {"intermediate_size": 32},
        vision_config=VISION,
        architectures=["Qwen3_5ForConditionalGeneration"],
    )
    tensors, _ = verify.skeleton(config, torch.bfloat16)
    plans = {k: merge.KeyPlan(k, shape, torch.float32, ("fsdp",)) for k, (shape, _) in tensors.items()}
    verify.check_checkpoint(plans, config, torch.bfloat16)  # fp32 weights: exported in bf16
    plans["lm_head.weight"].dtype = torch.int16
    plans["model.language_model.norm.weight"].shape = (31,)
    with pytest.raises(UserError, match=r"\(2 tensor\(s\)\): lm_head.weight is stored as torch.int16.*norm"):
        verify.check_checkpoint(plans, config, torch.bfloat16)


def test_verification_rejects_fused_experts_and_wrong_keys(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    config = transformers.Qwen3_5MoeConfig(
        text_config=TEXT | dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8),
        vision_config=VISION,
        architectures=["Qwen3_5MoeForConditionalGeneration"],
    )
    with torch.device("meta"):
        state = transformers.Qwen3_5MoeForConditionalGeneration(config).state_dict()
    fused = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in state.items()}
    save_file(fused, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match=r"fused expert tensors"):
        verify.verify_structure(tmp_path, config, torch.bfloat16)
    split = {k: t.contiguous() for key, v in fused.items() for k, t in experts.split_experts(key, v)}
    save_file(split, str(tmp_path / "model.safetensors"))
    assert verify.verify_structure(tmp_path, config, torch.bfloat16)["expert_keys"] == 2 * 2 * 3
    split.pop("lm_head.weight")
    split["model.extra.weight"] = torch.zeros(1, dtype=torch.bfloat16)
    save_file(split, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match=re.escape("missing lm_head.weight; unexpected model.extra.weight")):
        verify.verify_structure(tmp_path, config, torch.bfloat16)
    with pytest.raises(UserError, match=r"dtype BF16 != F32"):
        verify.verify_structure(tmp_path, config, torch.float32)
    # every dtype, not only the floating ones: an int16 lm_head in an export said to be bf16
    split = {k: t.contiguous() for key, v in fused.items() for k, t in experts.split_experts(key, v)}
    split["lm_head.weight"] = split["lm_head.weight"].to(torch.int16)
    save_file(split, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match=r"1 problems\): lm_head.weight dtype I16 != BF16"):
        verify.verify_structure(tmp_path, config, torch.bfloat16)


def test_local_region_follows_dtensor_chunking() -> None:
    from torch.distributed.tensor import Replicate, Shard

    mesh = torch.arange(4).reshape(2, 2)
    regions = [merge.local_region((5, 7), mesh, [Shard(0), Shard(0)], r) for r in range(4)]
    assert [r[0] for r in regions] == [(0, 2), (2, 1), (3, 1), (4, 1)]
    assert merge.local_region((5, 7), mesh, [Replicate(), Shard(1)], 3) == ((0, 5), (4, 3))
    assert merge.local_region((3,), torch.arange(4), [Shard(0)], 3) == ((3, 0),)


def test_cli_bad_checkpoint_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli import main

    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a directory" in err[0]
    (tmp_path / "o").mkdir()
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "o")]) == 3  # output refused
    assert "already exists" in capsys.readouterr().err
