"""`python -m engine export CHECKPOINT --out DIR`: a checkpoint becomes verified Hugging Face safetensors.

Meshes verl's merger understands (`fsdp`, `ddp,fsdp`) go through `verl.model_merger`; any other mesh
(fsdp_turbo's `dp_fsdp`, expert meshes, 2-D sharding) goes through the mesh-agnostic streaming merge of
`engine.checkpoint.merge`. Either way the checkpoint and the result are held to a meta-device model of
the config (engine.checkpoint.verify: key set, shape and dtype of every tensor, the per-expert MoE
layout transformers saves and loads, optionally logits), given a model card and a sha256 manifest, and
only then renamed from a temporary directory to DIR.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from engine import fsutil, procs
from engine.checkpoint import experts, layout, merge, verify
from engine.errors import ArgumentParser, OutputError, UserError
from engine.hashing import sha256_file
from engine.records.model_card import model_card

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".index.json", ".pt")


def _progress() -> Any:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        transient=False,
    )


def _dtensor_export(
    tmp: Path, files: list[Path], plans: dict[str, merge.KeyPlan], tied: set[str], dtype: Any, shard_size: int
) -> dict[str, str]:
    """Stream the merge into safetensors shards; returns file -> sha256 (hashed while writing)."""
    keys = [k for k in sorted(plans) if k not in tied]
    written = {k: merge.written_dtype(plans[k].dtype, dtype) for k in keys}
    out_bytes = {k: plans[k].nbytes // plans[k].dtype.itemsize * written[k].itemsize for k in keys}
    groups: list[list[str]] = [[]]
    size = 0
    for key in keys:
        if groups[-1] and size + out_bytes[key] > shard_size:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += out_bytes[key]
    names = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    hashes: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    with _progress() as progress:
        task = progress.add_task("merge+write", total=sum(out_bytes.values()))
        for name, group in zip(names, groups, strict=True):
            specs = [
                (k, s, written[key])
                for key in group
                for k, s in experts.split_expert_specs(key, plans[key].shape)
            ]
            merged = merge.iter_merged(files, [plans[k] for k in group], dtype=dtype)
            pieces = (piece for key, full in merged for piece in experts.split_experts(key, full))
            hashes[name] = merge.write_safetensors(
                tmp / name, specs, pieces, on_bytes=lambda n: progress.advance(task, n)
            )
            weight_map.update({k: name for k, _, _ in specs})
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(out_bytes.values())}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    return hashes


def _verl_export(tmp: Path, actor: Path) -> None:
    """verl's own merger, for the meshes it supports (writes bf16 through save_pretrained)."""
    cmd = [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp"]
    cmd += ["--local_dir", str(actor), "--target_dir", str(tmp)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, check=False, preexec_fn=procs.dies_with_this_process()
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise UserError(
            f"verl.model_merger failed (exit {proc.returncode}): {tail[0]}; --method dtensor merges without "
            "it (the checkpoint and the export are verified the same way)"
        )


def _quoted_record(path: Path, files: list[Path]) -> dict[str, Any]:
    """The record the model card quotes (git commit, image, run times) must be about this checkpoint and
    still true: it verifies (every file it names unchanged; an earlier export it names may be gone) and
    names the checkpoint's rank files among its outputs."""
    from engine.records import provenance

    if not path.is_file():
        raise UserError(
            f"--record {path}: no such file; pass the provenance.json of the run, or leave it out"
        )
    rec = provenance.read_record(path)
    changed = provenance.verify(path, skip_roles=("export",))
    if changed:
        raise UserError(
            f"--record {path}: {len(changed)} file(s) it names changed since it was written "
            f"({'; '.join(changed[:3])}): the card would quote a record of other files; "
            "pass one `python -m engine provenance verify` accepts, or leave --record out"
        )
    named = {provenance.entry_path(path, e).resolve() for e in rec["outputs"] if e["role"] == "checkpoint"}
    if not all(f.resolve() in named for f in files):
        raise UserError(
            f"--record {path}: it does not name {files[0].parent} among its checkpoints: pass the record of "
            "the run this checkpoint belongs to, or leave --record out"
        )
    return rec


def _copy_hf_side_files(hf_dir: Path, tmp: Path, dtype_name: str) -> None:
    for f in sorted(hf_dir.iterdir()):
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and not (tmp / f.name).exists():
            shutil.copy2(f, tmp / f.name)
    config = json.loads((tmp / "config.json").read_text())
    config["dtype"] = dtype_name
    if isinstance(config.get("text_config"), dict):
        config["text_config"]["dtype"] = dtype_name
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def export(
    checkpoint: str | Path,
    out: str | Path,
    method: str = "auto",
    dtype: str = "auto",
    shard_size: int = 2 << 30,
    logits: bool = False,
    record: str | None = None,
) -> dict[str, Any]:
    """Merge, verify, describe and hash a checkpoint; DIR appears only once all of that passed."""
    import torch
    import transformers

    out = fsutil.check_out_dir(out).resolve()
    if out.exists():
        raise OutputError(f"--out {out} already exists: pick a new directory (exports are never overwritten)")
    actor = merge.resolve_actor_dir(checkpoint)
    hf_dir = actor / "huggingface"
    if not (hf_dir / "config.json").is_file():
        raise UserError(f"{hf_dir}/config.json missing: the trainer saves it with the checkpoint")
    fsutil.read_json(hf_dir / "config.json", "model config", "the trainer saves it with the checkpoint")
    files = merge.rank_files(actor)
    rec = _quoted_record(Path(record), files) if record else None
    with merge.quiet_mesh_warnings():
        plans = merge.plan_merge(files)
    meshes = sorted(merge.mesh_names(plans))
    if method == "auto":
        method = "verl" if set(meshes) <= merge.MERGER_MESHES else "dtensor"
    if method == "verl" and not set(meshes) <= merge.MERGER_MESHES:
        raise UserError(f"verl.model_merger cannot merge meshes {meshes}: use --method dtensor")
    if method == "verl" and dtype not in ("auto", "bf16"):
        raise UserError(
            f"--dtype {dtype}: verl.model_merger writes bf16 only; use --method dtensor for {dtype}"
        )
    try:
        config = transformers.AutoConfig.from_pretrained(hf_dir)
    except (OSError, ValueError, KeyError) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise UserError(f"{hf_dir}/config.json: transformers cannot read it ({first}); re-copy it") from None
    dtype_name = "bfloat16" if dtype == "auto" else DTYPES[dtype]
    torch_dtype = getattr(torch, dtype_name)
    verify.check_checkpoint(plans, config, torch_dtype)  # before either method reads a tensor
    with fsutil.publish_dir(out) as tmp:
        started = time.time()
        _, tied = verify.skeleton(config, torch_dtype)
        if method == "verl":
            _verl_export(tmp, actor)
            hashes: dict[str, str] = {}
        else:
            hashes = _dtensor_export(tmp, files, plans, tied, torch_dtype, shard_size)
        _copy_hf_side_files(hf_dir, tmp, dtype_name)
        verification: dict[str, Any] = {"structure": verify.verify_structure(tmp, config, torch_dtype)}
        if logits:
            with merge.quiet_mesh_warnings():
                verification["logits"] = verify.verify_logits(tmp, files, plans, config, torch_dtype)
        step = layout.step_name(actor.parent)
        report = {
            "checkpoint": str(actor),
            "step": step,
            "world_size": len(files),
            "meshes": meshes,
            "method": method,
            "architecture": verify.model_class(config).__name__,
            "verification": verification,
            "seconds": round(time.time() - started, 2),
        }
        (tmp / "README.md").write_text(model_card(report, actor, rec))
        (tmp / "export.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        with _progress() as progress:
            for f in sorted(tmp.iterdir()):
                if f.name not in hashes:
                    hashes[f.name] = sha256_file(f, progress if f.stat().st_size > 64 << 20 else None)
        manifest = "".join(f"{hashes[n]}  {n}\n" for n in sorted(hashes))
        (tmp / "SHA256SUMS").write_text(manifest)
    report["files"] = dict(sorted(hashes.items()))
    return report


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        size = int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)
    except (ValueError, IndexError, OverflowError):
        size = 0
    if size < 1:
        raise UserError(f"--shard-size {text!r}: give a positive number of bytes or a size like 2GiB")
    return size


def cli_main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m engine export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="checkpoint root, global_step_N or its actor/ dir")
    parser.add_argument("--out", required=True, help="new directory for the export")
    parser.add_argument(
        "--method",
        choices=["auto", "verl", "dtensor"],
        default="auto",
        help="auto: verl.model_merger for fsdp / ddp,fsdp meshes, the DTensor merge otherwise",
    )
    parser.add_argument(
        "--dtype", choices=["auto", *DTYPES], default="auto", help="export dtype (auto: bf16)"
    )
    parser.add_argument(
        "--shard-size", default="2GiB", help="split safetensors above this size (with an index)"
    )
    parser.add_argument("--verify-logits", action="store_true", help="also compare logits (small models)")
    parser.add_argument("--record", help="provenance record whose summary goes into the model card")
    args = parser.parse_args(argv)
    report = export(
        args.checkpoint,
        args.out,
        args.method,
        args.dtype,
        _size(args.shard_size),
        args.verify_logits,
        args.record,
    )
    structure = report["verification"]["structure"]
    print(
        f"export: {args.out} ({report['method']}, {structure['keys']} keys, {structure['dtype']}, "
        f"{len(report['files'])} files hashed, {report['seconds']} s)"
    )
    logits = report["verification"].get("logits")
    if logits:
        line = f"export: logits max |diff| {logits['max_abs_diff_same_weights']:.2e} against the checkpoint"
        line += f" rounded, {logits['max_rel_diff_full_precision']:.2%} relative against its fp32 weights"
        if "routing_changed_share" in logits:
            line += f" (not gated: MoE, {logits['routing_changed_share']:.1%} of router choices differ)"
        print(line)
    return 0
