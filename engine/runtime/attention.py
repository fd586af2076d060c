"""`torch_varlen`: attention over verl's packed micro-batches one sequence at a time, without a mask.

verl's packed step (`use_remove_padding`) hands Qwen3.5 one row of concatenated sequences whose
position ids restart at 0 for each. verl expects flash-attn there (`flash_attention_2`, its default);
the project's GPU image has no flash-attn (a CUDA source build), so the recipes run `sdpa`, and
transformers then builds a block-diagonal mask over the whole row. SDPA with an arbitrary mask cannot
use its causal fast path: on one H200 (0.8B, micro-batch 4 x 2,048 packed to 8,192 tokens) the cuDNN
attention kernels took ~51 ms of a step against ~4 ms for the same tokens as four causal rows
(docs/reference/trainer-levers.md). torch's own flash-attention kernel for variable-length batches,
`torch.nn.attention.varlen.varlen_attn` (torch >= 2.10), takes the sequences' boundaries instead:
causal attention within each sequence, nothing across them, no mask.

`register()` (in every verl process, by `engine.runtime.install`) names it `torch_varlen` in
transformers' attention registry; `model.attn_implementation: torch_varlen` (the `varlen-attn` lever)
selects it. It is also named in transformers' mask registry with flash-attention's mask (None where
nothing is padded, else the 2-D padding mask): without that entry transformers passes no mask at all to
an attention it does not know, and a padded batch would run as if nothing were padded. So:
- a packed row (no mask, position ids) goes to `varlen_attn` on a GPU, and on a CPU (or a torch
  without `varlen_attn`) to causal SDPA per sequence: the same result, which the tests compare with
  transformers' masked SDPA; several full rows without a mask (verl's padded mode when nothing is
  padded) are laid end to end as one such row;
- a call without position ids (Qwen3.5's vision blocks, which pass each image separately) is SDPA with
  the caller's `is_causal`;
- a padded batch (a 2-D mask) is refused: preflight requires `model.use_remove_padding` with it.

`sdpa_no_cudnn` (the `sdpa-no-cudnn` lever) is transformers' SDPA, mask and all, with every SDPA kernel
but cuDNN's: where `torch_varlen` does not apply (a padded batch). cuDNN builds an execution graph for
each new shape, and a GRPO batch packs to a new length every step: on one H100 (35B-A3B-6L, ragged
4 x 2,048) each of its forward and backward held the host 43.8 ms in a step (1.19x a step of repeating
shape). Without it, SDPA under a mask runs torch's memory-efficient kernel (flash takes no mask), a
precompiled kernel with no per-shape graph.
"""

from __future__ import annotations

import inspect
import weakref
from itertools import pairwise
from typing import Any

NAME = "torch_varlen"
NO_CUDNN = "sdpa_no_cudnn"

# One packed row's boundaries, kept for the row's position-ids tensor: every attention layer of a
# forward receives the same tensor, so the host reads the boundaries once per forward, not per layer.
_cached: tuple[Any, Any, list[int]] | None = None


def sequence_bounds(position_ids: Any) -> tuple[Any, list[int]]:
    """(cu_seqlens on the device as int32, the same on the host) of the rows laid end to end: a sequence
    starts at each row's first token and wherever its position id is 0 (as transformers'
    `find_packed_sequence_indices` reads packed rows)."""
    global _cached
    if _cached is not None and _cached[0]() is position_ids:
        return _cached[1], _cached[2]
    import torch

    rows, length = position_ids.shape if position_ids.ndim == 2 else (1, position_ids.numel())
    flat = position_ids.reshape(-1)
    row_starts = torch.arange(0, rows * length + 1, length, device=flat.device)
    bounds = torch.unique(torch.cat([torch.nonzero(flat == 0).flatten(), row_starts])).to(torch.int32)
    host = bounds.tolist()
    _cached = (weakref.ref(position_ids), bounds, host)
    return bounds, host


def _per_sequence_sdpa(query: Any, key: Any, value: Any, host: list[int], scaling: float | None) -> Any:
    """Causal SDPA over each sequence of a packed row: (1, heads, tokens, dim) in and out."""
    import torch
    import torch.nn.functional as F

    gqa = query.shape[1] != key.shape[1]
    parts = [
        F.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            is_causal=True,
            scale=scaling,
            enable_gqa=gqa,
        )
        for start, end in pairwise(host)
    ]
    return torch.cat(parts, dim=2)


def _flash_varlen(
    query: Any, key: Any, value: Any, bounds: Any, host: list[int], scaling: float | None
) -> Any:
    """torch's varlen flash attention on one packed row; None where this torch has no such kernel."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (tokens, heads, dim)
    if k.shape[1] != q.shape[1] and "enable_gqa" not in params:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    longest = max(end - start for start, end in pairwise(host))
    kwargs: dict[str, Any] = {}
    if "window_size" in params:  # torch 2.11: causal is a window (GQA an argument only in later ones)
        kwargs["window_size"] = (-1, 0)
    else:  # torch 2.10
        kwargs["is_causal"] = True
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = k.shape[1] != q.shape[1]
    if "scale" in params:
        kwargs["scale"] = scaling
    elif scaling is not None and abs(scaling - q.shape[-1] ** -0.5) > 1e-12:
        return None  # a kernel without a scale argument computes another attention
    out = varlen_attn(q, k, v, bounds, bounds, longest, longest, **kwargs)
    return out.transpose(0, 1).unsqueeze(0)


def varlen_attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_ids: Any = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers' attention-function contract: (batch, heads, tokens, dim) in, (batch, tokens, heads,
    dim) out."""
    import torch.nn.functional as F

    if dropout:
        raise ValueError(f"{NAME}: attention dropout {dropout} is not supported; set it to 0")
    if attention_mask is not None:
        raise ValueError(
            f"{NAME}: got a padded batch (an attention mask); it attends packed rows only: set "
            "model.use_remove_padding=true, or model.attn_implementation=sdpa"
        )
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if position_ids is None or not causal:
        gqa = query.shape[1] != key.shape[1]
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=causal and query.shape[2] > 1, scale=scaling, enable_gqa=gqa
        )
        return out.transpose(1, 2).contiguous(), None
    rows, heads, length, _ = query.shape
    bounds, host = sequence_bounds(position_ids)
    if rows > 1:  # full rows without a mask (verl's padded mode at full length): one row, end to end
        query, key, value = (
            t.transpose(0, 1).reshape(1, t.shape[1], rows * length, -1) for t in (query, key, value)
        )
    out = None
    if query.is_cuda:
        out = _flash_varlen(query, key, value, bounds, host, scaling)
    if out is None:
        out = _per_sequence_sdpa(query, key, value, host, scaling)
    out = out.reshape(heads, rows, length, -1).transpose(0, 1) if rows > 1 else out
    return out.transpose(1, 2).contiguous(), None


def sdpa_no_cudnn_forward(
    module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any
) -> tuple[Any, Any]:
    """transformers' SDPA with cuDNN's kernel left out (NPUs' own kernel, `OVERRIDEABLE`, stays in)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kernels = [
        b for b in SDPBackend.__members__.values() if b not in (SDPBackend.CUDNN_ATTENTION, SDPBackend.ERROR)
    ]
    with sdpa_kernel(kernels):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> str:
    """Name `torch_varlen` and `sdpa_no_cudnn` in transformers' attention and mask registries
    (idempotent). Returns the first name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask, sdpa_mask

    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)  # the padding mask reaches the refusal
    AttentionInterface.register(NO_CUDNN, sdpa_no_cudnn_forward)
    AttentionMaskInterface.register(NO_CUDNN, sdpa_mask)  # SDPA's masks: block-diagonal, padding, causal
    return NAME
