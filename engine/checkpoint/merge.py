"""Mesh-agnostic merge of verl's sharded FSDP checkpoints into one streamed safetensors set.

verl's merger only understands the meshes `("fsdp",)` and `("ddp", "fsdp")`, loads every shard into
memory at once and concatenates along a single dimension. fsdp_turbo writes DTensors on other meshes
(`dp_fsdp`, expert meshes, several dims sharding one tensor dim), so this module reads the placements
of every local shard, computes the region of the global tensor it holds, checks the regions tile the
tensor, and writes each tensor as soon as it is assembled. Rank files are memory-mapped and re-opened
every few hundred MiB so that resident memory stays near one tensor plus that window.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import fsutil
from engine.checkpoint import layout
from engine.errors import UserError

SAFETENSORS_DTYPES = {
    "torch.bfloat16": "BF16",
    "torch.float16": "F16",
    "torch.float32": "F32",
    "torch.float64": "F64",
    "torch.int64": "I64",
    "torch.int32": "I32",
    "torch.int16": "I16",
    "torch.int8": "I8",
    "torch.uint8": "U8",
    "torch.bool": "BOOL",
}
MERGER_MESHES = {("fsdp",), ("ddp", "fsdp")}
_RANK_FILE = re.compile(r"model_world_size_(\d+)_rank_(\d+)\.pt$")


def resolve_actor_dir(path: str | Path) -> Path:
    """Accept a checkpoint root (follow the tracker), a global_step_N dir or its actor/ dir."""
    p = Path(path).expanduser().resolve()
    if not p.is_dir():
        raise UserError(f"checkpoint {p} is not a directory: pass a checkpoint root, global_step_N or actor/")
    tracker = layout.tracker(p)
    if tracker.is_file():
        step = fsutil.read_text(tracker, "tracker", "it names the step verl saved last").strip()
        p = layout.step_dir(p, step)
        if not p.is_dir():
            raise UserError(
                f"{tracker} names step {step} but {p} is missing: fix the tracker or pass a step dir"
            )
    if (p / layout.ACTOR).is_dir():
        p = p / layout.ACTOR
    if not (p / "fsdp_config.json").is_file():
        raise UserError(f"{p} has no fsdp_config.json: not a verl FSDP actor checkpoint")
    return p


def rank_files(actor_dir: Path) -> list[Path]:
    """The model shard of every rank, in rank order, checked against fsdp_config.json."""
    config = fsutil.read_json(actor_dir / "fsdp_config.json", "checkpoint", "re-copy it from the trainer")
    world_size = config.get("world_size", 0)
    if not isinstance(world_size, int) or isinstance(world_size, bool):
        raise UserError(
            f"{actor_dir}/fsdp_config.json: world_size {world_size!r} is not an integer; re-copy it"
        )
    found = {}
    for f in actor_dir.glob("model_world_size_*_rank_*.pt"):
        m = _RANK_FILE.search(f.name)
        if m and int(m.group(1)) == world_size:
            found[int(m.group(2))] = f
    missing = [r for r in range(world_size) if r not in found]
    if world_size < 1 or missing:
        raise UserError(f"{actor_dir}: world_size {world_size} but rank files missing for ranks {missing}")
    return [found[r] for r in range(world_size)]


def _load(path: Path) -> dict[str, Any]:
    import torch

    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as err:  # any failure to unpickle a file is a bad input here, not a bug
        first = (str(err).splitlines() or [type(err).__name__])[0][:120]
        raise UserError(
            f"rank file {path}: cannot be loaded ({first}); truncated or corrupt, re-copy it"
        ) from None
    if not isinstance(state, dict):
        raise UserError(f"rank file {path}: holds a {type(state).__name__}, not a state dict; re-copy it")
    return state


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor"


def local_region(
    shape: tuple[int, ...], mesh: Any, placements: Any, rank: int
) -> tuple[tuple[int, int], ...]:
    """(start, length) per tensor dim of the part `rank` holds, following DTensor's chunking rules."""
    import numpy as np

    grid = np.asarray(mesh.tolist())
    where = np.argwhere(grid == rank)
    if len(where) != 1:
        raise UserError(f"rank {rank} is not in the DTensor mesh {grid.tolist()}: corrupt checkpoint")
    coord = where[0]
    region = [(0, n) for n in shape]
    for mesh_dim, placement in enumerate(placements):
        kind = type(placement).__name__
        if kind == "Replicate":
            continue
        if kind != "Shard":
            raise UserError(
                f"placement {placement!r} cannot be merged (only Shard and Replicate are supported)"
            )
        dim, parts, idx = placement.dim, grid.shape[mesh_dim], int(coord[mesh_dim])
        start, length = region[dim]
        chunk = -(-length // parts)
        begin = min(idx * chunk, length)
        region[dim] = (start + begin, max(0, min(chunk, length - begin)))
    return tuple(region)


@dataclass
class KeyPlan:
    """Where the pieces of one checkpoint entry live and what the merged tensor looks like."""

    key: str
    shape: tuple[int, ...]
    dtype: Any
    mesh_names: tuple[str, ...] | None
    pieces: list[tuple[int, tuple[tuple[int, int], ...]]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def plan_merge(files: list[Path]) -> dict[str, KeyPlan]:
    """Read placements from every rank (metadata only) and check the pieces tile each tensor."""
    plans: dict[str, KeyPlan] = {}
    for rank, f in enumerate(files):
        sd = _load(f)
        if rank > 0 and set(sd) != set(plans):
            diff = sorted(set(sd) ^ set(plans))[:3]
            raise UserError(f"{f.name} holds different keys from rank 0 (e.g. {diff}): corrupt checkpoint")
        for key, value in sd.items():
            if _is_dtensor(value):
                shape = tuple(value.shape)
                names = tuple(value.device_mesh.mesh_dim_names or ())
                region = local_region(shape, value.device_mesh.mesh, value.placements, rank)
                local = tuple(value._local_tensor.shape)
                if local != tuple(n for _, n in region):
                    raise UserError(f"{key} on rank {rank}: local shape {local} != expected {region}")
                dtype = value._local_tensor.dtype
            else:
                shape, names, dtype = tuple(value.shape), None, value.dtype
                region = tuple((0, n) for n in shape)
            plan = plans.setdefault(key, KeyPlan(key, shape, dtype, names))
            if plan.shape != shape or plan.mesh_names != names or plan.dtype != dtype:
                raise UserError(f"{key}: rank {rank} disagrees with rank 0 on shape, dtype or mesh")
            if all(region != r for _, r in plan.pieces):
                plan.pieces.append((rank, region))
        del sd
    for plan in plans.values():
        covered = sum(_numel(r) for _, r in plan.pieces)
        if covered != _numel(tuple((0, n) for n in plan.shape)):
            raise UserError(f"{plan.key}: shards cover {covered} elements of {plan.shape}: missing ranks?")
    return plans


def _numel(region: tuple[tuple[int, int], ...]) -> int:
    n = 1
    for _, length in region:
        n *= length
    return n


def mesh_names(plans: dict[str, KeyPlan]) -> set[tuple[str, ...]]:
    return {p.mesh_names for p in plans.values() if p.mesh_names is not None}


def written_dtype(stored: Any, dtype: Any) -> Any:
    """The dtype a tensor is merged and exported in: a floating one in `dtype` (when given), any other as
    stored. Export checks first that a tensor is floating exactly where the model's is (verify.py)."""
    return dtype if dtype is not None and stored.is_floating_point else stored


def iter_merged(
    files: list[Path], plans: Iterable[KeyPlan], dtype: Any = None, window_bytes: int = 512 << 20
) -> Iterator[tuple[str, Any]]:
    """Yield (key, full tensor) in the given order; floats are cast to `dtype` when given."""
    import torch

    loaded: dict[int, dict[str, Any]] = {}
    read = 0
    for plan in plans:
        full = torch.empty(plan.shape, dtype=written_dtype(plan.dtype, dtype))
        for rank, region in plan.pieces:
            if rank not in loaded:
                loaded[rank] = _load(files[rank])
            value = loaded[rank][plan.key]
            local = value._local_tensor if _is_dtensor(value) else value
            if local.numel():
                full[tuple(slice(s, s + n) for s, n in region)].copy_(local)
            read += local.numel() * local.element_size()
        yield plan.key, full
        if read >= window_bytes:  # drop the mappings so their resident pages go with them
            loaded.clear()
            read = 0


def tensor_bytes(t: Any) -> memoryview:
    import torch

    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def write_safetensors(
    path: Path,
    specs: list[tuple[str, tuple[int, ...], Any]],
    tensors: Iterator[tuple[str, Any]],
    on_bytes: Callable[[int], None] | None = None,
) -> str:
    """Stream tensors into a safetensors file whose header is known up front; returns its sha256."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, shape, dt in specs:
        size = dt.itemsize
        for d in shape:
            size *= d
        header[key] = {
            "dtype": SAFETENSORS_DTYPES[str(dt)],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as out:
        for chunk in (struct.pack("<Q", len(blob)), blob):
            out.write(chunk)
            digest.update(chunk)
        for (key, shape, dt), (got_key, tensor) in zip(specs, tensors, strict=True):
            if key != got_key or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dt:
                raise RuntimeError(
                    f"writer got {got_key} {tuple(tensor.shape)} {tensor.dtype}, expected {key}"
                )
            data = tensor_bytes(tensor)
            out.write(data)
            digest.update(data)
            if on_bytes:
                on_bytes(len(data))
    return digest.hexdigest()


@contextlib.contextmanager
def quiet_mesh_warnings() -> Iterator[None]:
    logger = logging.getLogger("torch.distributed.device_mesh")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
