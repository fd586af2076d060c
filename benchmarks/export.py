"""Synthetic sharded checkpoints (2-4 gloo ranks) and the export benchmark against verl's merger.

The checkpoints are written the way a trainer writes them: one process per rank, DTensors on real
device meshes (`fully_shard` for the fsdp2/hsdp layouts; `DTensor.from_local` for fsdp_turbo-like
`dp_fsdp` + expert meshes and nested 2-D sharding), saved in verl's layout.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

from engine import fsutil
from engine.checkpoint import experts
from engine.checkpoint import layout as ckpt_layout
from engine.checkpoint.merge import local_region
from engine.errors import ArgumentParser, UserError, entry

# --- synthetic sharded checkpoints (tests and the export benchmark) -------------------------------
LAYOUTS = ("fsdp2", "hsdp", "fsdp", "turbo", "nested2d")


def _layout_for(
    layout: str, key: str, ndim: int, world: int
) -> tuple[tuple[int, ...], tuple[str, ...], list[Any]]:
    """Mesh shape, names and placements a layout gives one tensor (fsdp2/hsdp use real fully_shard)."""
    from torch.distributed.tensor import Replicate, Shard

    half = (2, world // 2) if world % 2 == 0 and world > 2 else (world, 1)
    if layout == "fsdp":
        return (world,), ("fsdp",), [Shard(0)]
    if layout == "turbo":
        if experts.is_expert_key(key) and ndim == 3:
            return half, ("ep", "efsdp"), [Shard(0), Shard(1)]
        return (world,), ("dp_fsdp",), [Shard(0)]
    if layout == "nested2d":
        if ndim >= 2 and experts.is_expert_key(key):
            return half, ("dp", "fsdp"), [Shard(0), Replicate()]
        if ndim >= 2:
            return half, ("dp", "fsdp"), [Shard(0), Shard(1)]
        return half, ("dp", "fsdp"), [Shard(0), Shard(0)]
    raise UserError(f"unknown synthetic layout {layout!r}: choose one of {', '.join(LAYOUTS)}")


def _synthetic_rank(rank: int, world: int, port: int, jobs: list[dict[str, Any]]) -> None:
    import os
    import shutil

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for job in jobs:
        layout, actor = job["layout"], ckpt_layout.actor_dir(job["out"], job["step"])
        actor.mkdir(parents=True, exist_ok=True)
        if layout in ("fsdp2", "hsdp"):
            import transformers
            from torch.distributed.fsdp import fully_shard

            config = transformers.AutoConfig.from_pretrained(job["model_dir"])
            model = getattr(transformers, config.architectures[0]).from_pretrained(
                job["model_dir"], dtype=torch.float32
            )
            shape, names = ((world,), ("fsdp",)) if layout == "fsdp2" else ((2, world // 2), ("ddp", "fsdp"))
            fully_shard(model, mesh=init_device_mesh("cpu", shape, mesh_dim_names=names))
            state = model.state_dict()
        else:
            source = torch.load(job["source"], mmap=True) if job.get("source") else None
            specs = (
                source
                if source is not None
                else {k: torch.empty(s, device="meta") for k, s in job["specs"].items()}
            )
            state, meshes = {}, {}
            for key, full in specs.items():
                shape, names, placements = _layout_for(layout, key, full.dim(), world)
                if layout == "turbo" and full.dim() == 1:
                    state[key] = full.clone()  # replicated plain tensor, as unwrapped params are saved
                    continue
                mesh = meshes.get((shape, names)) or init_device_mesh("cpu", shape, mesh_dim_names=names)
                meshes[(shape, names)] = mesh
                region = local_region(tuple(full.shape), mesh.mesh, placements, rank)
                index = tuple(slice(s, s + n) for s, n in region)
                if source is not None:
                    local = full[index].clone()
                else:
                    gen = torch.Generator().manual_seed(zlib.crc32(f"{key}{region}".encode()))
                    local = torch.randn([n for _, n in region], generator=gen).mul_(0.02)
                state[key] = DTensor.from_local(
                    local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
                )
        torch.save(state, actor / f"model_world_size_{world}_rank_{rank}.pt")
        torch.save(
            {"rng": {"cpu": torch.get_rng_state()}}, actor / f"extra_state_world_size_{world}_rank_{rank}.pt"
        )
        del state
        if rank == 0:
            (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
            shutil.copytree(
                job["model_dir"],
                actor / ckpt_layout.HF_DIR,
                dirs_exist_ok=True,
                ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.index.json"),
            )
            ckpt_layout.write_tracker(job["out"], job["step"])
        dist.barrier()
    dist.destroy_process_group()


def write_synthetic_checkpoints(jobs: list[dict[str, Any]], world: int) -> None:
    """Write verl-layout checkpoints with `world` gloo ranks.

    Each job: {layout, out, step, model_dir (HF config dir), source (full state dict .pt) or specs
    ({key: shape}, random values per local region)}. One process group serves every job.
    """
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_synthetic_rank, args=(world, port, jobs), nprocs=world, join=True)


def bench_config(params: float) -> Any:
    """A Qwen3.5 text config (hybrid linear/full attention) with about `params` parameters."""
    import torch
    import transformers

    def build(layers: int) -> Any:
        return transformers.Qwen3_5TextConfig(
            vocab_size=65536,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=layers,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
            tie_word_embeddings=False,
            architectures=["Qwen3_5ForCausalLM"],
        )

    layers = 4
    while True:
        with torch.device("meta"):
            n = sum(p.numel() for p in transformers.Qwen3_5ForCausalLM(build(layers)).parameters())
        if n >= params:
            return build(layers), n
        layers += 4


def _measure(cmd: list[str]) -> tuple[float, float, int]:
    """Wall seconds and peak RSS (GiB) of one child process, from its own rusage."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        err = proc.stderr.read().decode(errors="replace").strip().splitlines()[-1:] if proc.stderr else []
        raise UserError(f"benchmark command failed ({proc.returncode}): {' '.join(cmd[:4])}: {err}")
    return wall, usage.ru_maxrss / (1 << 20), proc.returncode


def _foreign(directory: Path, own: tuple[str, ...]) -> str | None:
    others = sorted(p.name for p in directory.iterdir() if p.name not in own)
    return f"it holds {', '.join(others[:3])}, which the export bench did not write" if others else None


def bench_main(argv: list[str]) -> int:
    """`python -m benchmarks.export`: our export+verify vs `verl.model_merger merge` alone."""
    from rich.console import Console
    from rich.table import Table

    parser = ArgumentParser(prog="python -m benchmarks.export")
    parser.add_argument("--params", type=float, default=1.0e9, help="minimum parameter count")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--workdir", help="where the checkpoint and outputs go (default: a temp dir)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--keep", action="store_true", help="keep the workdir")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    own = ("model", "ckpt", "merger", "export")  # it clears merger/ and export/ between runs
    if args.workdir:
        fsutil.check_out_dir(args.workdir, "--workdir", reuse=lambda d: _foreign(d, own))
    if args.json:
        fsutil.check_out_file(args.json, "--json", reuse=lambda _: None)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="export-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        config, n_params = bench_config(args.params)
        model_dir = work / "model"
        config.save_pretrained(model_dir)
        import torch
        import transformers
        from tokenizers import Tokenizer, models

        vocab = {"<unk>": 0, "<|endoftext|>": 1}
        fast = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))  # the merger saves a tokenizer too
        transformers.PreTrainedTokenizerFast(tokenizer_object=fast, unk_token="<unk>").save_pretrained(
            model_dir
        )

        with torch.device("meta"):
            specs = {
                k: tuple(v.shape) for k, v in transformers.Qwen3_5ForCausalLM(config).state_dict().items()
            }
        ckpt = work / "ckpt"
        with console.status(
            f"writing a {n_params / 1e9:.2f}B-parameter fp32 checkpoint, {args.world_size} ranks"
        ):
            t0 = time.perf_counter()
            if not ckpt_layout.tracker(ckpt).exists():
                job = {
                    "layout": "fsdp",
                    "out": str(ckpt),
                    "step": 1,
                    "model_dir": str(model_dir),
                    "specs": specs,
                }
                write_synthetic_checkpoints([job], args.world_size)
            written = time.perf_counter() - t0
        actor = ckpt_layout.actor_dir(ckpt, 1)
        rows = {}
        for name, cmd in (
            (
                "verl.model_merger merge",
                [
                    sys.executable,
                    "-m",
                    "verl.model_merger",
                    "merge",
                    "--backend",
                    "fsdp",
                    "--local_dir",
                    str(actor),
                    "--target_dir",
                    str(work / "merger"),
                ],
            ),
            (
                "engine export (+verify, hashes)",
                [
                    sys.executable,
                    "-m",
                    "engine",
                    "export",
                    str(actor),
                    "--out",
                    str(work / "export"),
                    "--method",
                    "dtensor",
                ],
            ),
        ):
            for out in ("merger", "export"):
                shutil.rmtree(work / out, ignore_errors=True)
            with console.status(f"running {name}"):
                rows[name] = _measure(cmd)
        merger, ours = rows["verl.model_merger merge"], rows["engine export (+verify, hashes)"]
        table = Table(title=f"export of {n_params / 1e9:.2f}B params, fp32 shards x{args.world_size} -> bf16")
        for col in ("command", "wall s", "peak RSS GiB"):
            table.add_column(col)
        for name, (wall, rss, _) in rows.items():
            table.add_row(name, f"{wall:.1f}", f"{rss:.2f}")
        table.add_row("ratio ours/merger", f"{ours[0] / merger[0]:.2f}", f"{ours[1] / merger[1]:.2f}")
        Console().print(table)
        figures = {
            "params": n_params,
            "world_size": args.world_size,
            "checkpoint_write_s": round(written, 1),
            "merger": {"wall_s": round(merger[0], 2), "peak_rss_gib": round(merger[1], 3)},
            "export": {"wall_s": round(ours[0], 2), "peak_rss_gib": round(ours[1], 3)},
            "time_ratio": round(ours[0] / merger[0], 3),
            "rss_ratio": round(ours[1] / merger[1], 3),
        }
        if args.json:
            fsutil.atomic_write(args.json, json.dumps(figures, indent=2) + "\n")
        return 0 if figures["time_ratio"] <= 1.0 and figures["rss_ratio"] <= 0.6 else 1
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    entry(bench_main)
