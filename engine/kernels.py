"""Fast Qwen3.5 gated-delta-net kernels on GPU: flash-linear-attention, with its Triton causal conv1d.

verl loads this module in every worker when it is named in `VERL_USE_EXTERNAL_MODULES` (the GPU recipe
does); with `ENGINE_FLA_CONV1D=1` it routes transformers' Qwen3.5 layers through fla before any model
is built. The causal-conv1d CUDA extension is a source build against the installed torch; fla ships the
same operation in Triton, varlen included, so no compiler is needed on the cluster.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def fla_conv1d_fn(
    x: Any, weight: Any, bias: Any = None, activation: Any = None, seq_idx: Any = None, **_: Any
):
    """`causal_conv1d_fn` (causal-conv1d's signature, x as [B, D, T]) on fla's Triton causal conv1d.

    causal-conv1d is a CUDA source build; fla ships the same operation in Triton, varlen included:
    packed sequences arrive as `seq_idx` (sequence number per token) and go to fla as cu_seqlens.
    """
    import torch
    import torch.nn.functional as F

    if not x.is_cuda:  # the same operation in torch (what transformers does without a fast path)
        y = F.conv1d(x, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])
        y = y[..., : x.shape[-1]]
        return F.silu(y) if activation in ("silu", "swish") else y
    from fla.modules.causal_conv1d import causal_conv1d

    cu_seqlens = None
    if seq_idx is not None:
        counts = torch.bincount(seq_idx.reshape(-1).to(torch.long))
        cu_seqlens = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    y, _ = causal_conv1d(
        x.transpose(1, 2), weight=weight, bias=bias, activation=activation, cu_seqlens=cu_seqlens
    )
    return y.transpose(1, 2)


def select_kernels(kernels: str) -> str:
    """Before any Qwen3.5 model is built: hide fla (`torch`), or route the gated-delta-net through fla.

    With `fla`, each fast op dispatches on the tensor's device: CUDA tensors take fla's Triton kernels
    (conv1d included), CPU tensors (the hf rollout server, tests) keep transformers' torch code, so one
    environment serves both.
    """
    if kernels == "torch":
        for name in ("fla", "causal_conv1d"):
            sys.modules[name] = None  # type: ignore[assignment]  # find_spec() -> None: "not installed"
        return "torch fallback"
    import functools

    from fla.modules import FusedRMSNormGated
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    def on_device(fast: Any, slow: Any) -> Any:
        @functools.wraps(fast)
        def call(query: Any, *args: Any, **kwargs: Any) -> Any:
            if query.is_cuda:
                return fast(query, *args, **kwargs)
            kwargs = {k: v for k, v in kwargs.items() if not k.startswith("cu_seqlens")}
            return slow(query, *args, **kwargs)

        return call

    class GatedNorm(FusedRMSNormGated):
        def __init__(self, hidden_size: int, eps: float = 1e-6, activation: str = "swish", **_: Any) -> None:
            super().__init__(hidden_size, eps=eps, activation=activation)

        def forward(self, x: Any, g: Any, *args: Any, **kwargs: Any) -> Any:
            if x.is_cuda:
                return super().forward(x, g, *args, **kwargs)
            return qwen.Qwen3_5RMSNormGated.forward(self, x, g)  # type: ignore[arg-type]

        @property
        def variance_epsilon(self) -> float:
            return self.eps

    qwen.causal_conv1d_fn = fla_conv1d_fn
    qwen.chunk_gated_delta_rule = on_device(chunk_gated_delta_rule, qwen.torch_chunk_gated_delta_rule)
    qwen.fused_recurrent_gated_delta_rule = on_device(
        fused_recurrent_gated_delta_rule, qwen.torch_recurrent_gated_delta_rule
    )
    qwen.FusedRMSNormGated = GatedNorm
    if hasattr(qwen, "is_fast_path_available"):
        qwen.is_fast_path_available = True
    return f"fla {_version('fla-core')} + Triton conv1d (triton {_version('triton')})"


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


if os.environ.get("ENGINE_FLA_CONV1D") == "1":  # imported by verl workers through VERL_USE_EXTERNAL_MODULES
    select_kernels("fla")
