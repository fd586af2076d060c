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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine import fsutil, procs
from engine.checkpoint import experts, layout, merge, verify
from engine.errors import OutputError, UserError
from engine.hashing import sha256_file

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


def _copy_hf_side_files(hf_dir: Path, tmp: Path, dtype_name: str) -> None:
    for f in sorted(hf_dir.iterdir()):
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and not (tmp / f.name).exists():
            shutil.copy2(f, tmp / f.name)
    config = json.loads((tmp / "config.json").read_text())
    config["dtype"] = dtype_name
    if isinstance(config.get("text_config"), dict):
        config["text_config"]["dtype"] = dtype_name
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def check_out(out: str | Path) -> Path:
    """An export goes into a new directory: it is never merged into or overwritten."""
    out = fsutil.check_out_dir(out).resolve()
    if out.exists():
        raise OutputError(f"--out {out} already exists: pick a new directory (exports are never overwritten)")
    return out


def export(
    checkpoint: str | Path,
    out: str | Path,
    method: str = "auto",
    dtype: str = "auto",
    shard_size: int = 2 << 30,
    logits: bool = False,
    card: Callable[[dict[str, Any]], str] | None = None,
) -> dict[str, Any]:
    """Merge, verify, describe and hash a checkpoint; DIR appears only once all of that passed.

    `card` renders the model card (README.md) from the export's report; the caller builds it from what it
    knows about the run (`python -m engine export`: engine.records.publish).
    """
    import torch
    import transformers

    out = check_out(out)
    actor = merge.resolve_actor_dir(checkpoint)
    hf_dir = actor / layout.HF_DIR
    if not (hf_dir / "config.json").is_file():
        raise UserError(f"{hf_dir}/config.json missing: the trainer saves it with the checkpoint")
    fsutil.read_json(hf_dir / "config.json", "model config", "the trainer saves it with the checkpoint")
    files = merge.rank_files(actor)
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
        written = layout.ExportDir(tmp)
        if card:
            written.card.write_text(card(report))
        written.report.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        with _progress() as progress:
            for f in sorted(tmp.iterdir()):
                if f.name not in hashes:
                    hashes[f.name] = sha256_file(f, progress if f.stat().st_size > 64 << 20 else None)
        manifest = "".join(f"{hashes[n]}  {n}\n" for n in sorted(hashes))
        written.sums.write_text(manifest)
    report["files"] = dict(sorted(hashes.items()))
    return report


def parse_size(text: str) -> int:
    """`--shard-size`: bytes, or a size like 2GiB / 512MiB."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        size = int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)
    except (ValueError, IndexError, OverflowError):
        size = 0
    if size < 1:
        raise UserError(f"--shard-size {text!r}: give a positive number of bytes or a size like 2GiB")
    return size
