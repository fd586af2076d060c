"""The MoE expert key rule, once: transformers keeps a layer's routed experts fused
(`mlp.experts.gate_up_proj` [E, 2I, H] with gate first, `mlp.experts.down_proj` [E, H, I]) and saves
and loads them per expert (`mlp.experts.{i}.{gate,up,down}_proj.weight`), the layout verl also exports
to inference engines. Export splits the fused tensors; the hf rollout fuses synced ones back.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

EXPERTS = "mlp.experts"
FUSED = ("gate_up_proj", "down_proj")
PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<index>\d+)\.(?P<proj>(gate|up|down)_proj)\.weight$")


def is_expert_key(key: str) -> bool:
    """A routed-expert tensor, fused or per expert."""
    return f"{EXPERTS}." in key


def is_fused(key: str) -> bool:
    return key.endswith(tuple(f"{EXPERTS}.{name}" for name in FUSED))


def _fused_parts(key: str) -> tuple[str, str] | None:
    prefix, _, name = key.rpartition(".")
    return (prefix, name) if prefix.endswith(EXPERTS) and name in FUSED else None


def split_experts(key: str, tensor: Any) -> Iterator[tuple[str, Any]]:
    """Fused `mlp.experts.{gate_up_proj,down_proj}` -> the per-expert keys transformers saves and loads."""
    parts = _fused_parts(key)
    if parts is None:
        yield key, tensor
        return
    prefix, name = parts
    for e in range(tensor.shape[0]):
        if name == "down_proj":
            yield f"{prefix}.{e}.down_proj.weight", tensor[e]
        else:
            half = tensor.shape[1] // 2
            yield f"{prefix}.{e}.gate_proj.weight", tensor[e, :half]
            yield f"{prefix}.{e}.up_proj.weight", tensor[e, half:]


def split_expert_specs(key: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """`split_experts` on shapes only (what an export will write, before any tensor exists)."""
    parts = _fused_parts(key)
    if parts is None or len(shape) != 3:
        return [(key, shape)]
    prefix, name = parts
    out: list[tuple[str, tuple[int, ...]]] = []
    for e in range(shape[0]):
        if name == "down_proj":
            out.append((f"{prefix}.{e}.down_proj.weight", shape[1:]))
        else:
            half = (shape[1] // 2, shape[2])
            out += [(f"{prefix}.{e}.gate_proj.weight", half), (f"{prefix}.{e}.up_proj.weight", half)]
    return out


def fuse_experts(weights: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """Per-expert tensors back into the fused parameters, where the model (`own`) has them."""
    import torch

    grouped: dict[str, dict[str, dict[int, Any]]] = {}
    out: dict[str, Any] = {}
    for name, tensor in weights.items():
        match = PER_EXPERT.match(name)
        if match and f"{match['prefix']}.gate_up_proj" in own:
            by_proj = grouped.setdefault(match["prefix"], {})
            by_proj.setdefault(match["proj"], {})[int(match["index"])] = tensor
        else:
            out[name] = tensor
    for prefix, projs in grouped.items():
        count = own[f"{prefix}.gate_up_proj"].shape[0]
        if any(sorted(projs.get(p, {})) != list(range(count)) for p in ("gate_proj", "up_proj", "down_proj")):
            raise KeyError(f"hf rollout: incomplete expert set under {prefix} (expected {count} experts)")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]], dim=0) for e in range(count)]
        )
        out[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(count)])
    return out
