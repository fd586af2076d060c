"""Synthetic sharded checkpoints in verl's layout, written the way a trainer writes them: one process per
rank, gloo, DTensors on the meshes verl's FSDP and fsdp_turbo use (`fsdp2`, `hsdp`, `fsdp`, `turbo` with
`dp_fsdp` + expert meshes, `nested2d`). Used by the export benchmark and the export tests;
`python -m benchmarks.synthetic_checkpoints MODEL_DIR --out CKPT` writes one of a real model's weights.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import zlib
from typing import Any

from engine.checkpoint import experts
from engine.checkpoint import layout as ckpt_layout
from engine.checkpoint.merge import local_region
from engine.errors import UserError

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


def cli_main(argv: list[str]) -> int:
    from pathlib import Path

    from engine import fsutil
    from engine.errors import ArgumentParser

    prog = "python -m benchmarks.synthetic_checkpoints"
    parser = ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, help="Hugging Face model directory whose weights are sharded")
    parser.add_argument("--out", type=Path, required=True, help="new checkpoint root (verl's layout)")
    parser.add_argument("--layout", choices=("fsdp2", "hsdp"), default="fsdp2")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--step", type=int, default=1)
    args = parser.parse_args(argv)
    if not (args.model_dir / "config.json").is_file():
        raise UserError(f"{args.model_dir}: no config.json; pass a Hugging Face model directory")
    if args.world_size < 1 or (args.layout == "hsdp" and args.world_size % 2):
        raise UserError(f"--world-size {args.world_size}: positive, and even for hsdp")
    out = fsutil.check_out_dir(args.out)
    job = {"layout": args.layout, "out": str(out), "step": args.step, "model_dir": str(args.model_dir)}
    write_synthetic_checkpoints([job], args.world_size)
    print(f"checkpoint {ckpt_layout.actor_dir(out, args.step)}")
    return 0


if __name__ == "__main__":
    from engine.errors import entry

    entry(cli_main)
