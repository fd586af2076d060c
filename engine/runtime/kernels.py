"""Fast kernels for Qwen3.5 training: flash-linear-attention with its Triton causal conv1d, and
chunked token log-probs.

verl loads this module in every worker when it is named in `VERL_USE_EXTERNAL_MODULES` (the GPU recipe
does); with `ENGINE_FLA_CONV1D=1` it routes transformers' Qwen3.5 layers through fla before any model
is built. The causal-conv1d CUDA extension is a source build against the installed torch; fla ships the
same operation in Triton, varlen included, so no compiler is needed on the cluster. `token_logprobs`
replaces verl's row-by-row log-prob fallback (installed by `engine.verl_ext`).
"""

from __future__ import annotations

import collections
import functools
import importlib.abc
import importlib.util
import itertools
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from engine.recipes.levers import LOGPROBS_ENV


def fla_conv1d_fn(
    x: Any, weight: Any, bias: Any = None, activation: Any = None, seq_idx: Any = None, **_: Any
):
    """`causal_conv1d_fn` (causal-conv1d's signature, x as [B, D, T]) on fla's Triton causal conv1d.

    causal-conv1d is a CUDA source build; fla ships the same operation in Triton, varlen included:
    packed sequences arrive as `seq_idx` (sequence number per token) and go to fla as cu_seqlens
    (`conv_cu_seqlens`).
    """
    import torch
    import torch.nn.functional as F

    cu_seqlens, cu_seqlens_cpu = conv_cu_seqlens(seq_idx, x.shape[-1])
    if not x.is_cuda:  # the same operation in torch, one sequence at a time
        host = cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu
        bounds = [0, x.shape[-1]] if host is None else host.tolist()
        parts = []
        for start, stop in itertools.pairwise(bounds):
            part = x[..., start:stop]
            y = F.conv1d(part, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])
            parts.append(y[..., : part.shape[-1]])
        y = torch.cat(parts, dim=-1)
        return F.silu(y) if activation in ("silu", "swish") else y
    from fla.modules.causal_conv1d import causal_conv1d

    y, _ = causal_conv1d(
        x.transpose(1, 2),
        weight=weight,
        bias=bias,
        activation=activation,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )
    return y.transpose(1, 2)


# (cu_seqlens, cu_seqlens_cpu) of each gated-delta-net call running now, innermost last
_PACKED_LENGTHS: list[tuple[Any, Any]] = []


def conv_cu_seqlens(seq_idx: Any, length: int) -> tuple[Any, Any]:
    """The packed lengths for a conv1d over `length` tokens: (cu_seqlens, cu_seqlens_cpu), or (None, None)
    for an unpacked batch.

    Inside verl's packed gated-delta-net forward these are the very tensors verl passes the layer (its
    host copy included), so fla takes its chunk indices from the host copy and, the objects being the
    same in every layer, from its cache: no device sync. Otherwise they are derived from `seq_idx`,
    which reads the sequence count back from the device (one sync per call, per layer).
    """
    if seq_idx is None:
        return None, None
    if _PACKED_LENGTHS:
        cu_seqlens, cu_seqlens_cpu = _PACKED_LENGTHS[-1]
        # the host copy says whether they cover this input (Ulysses adds a prefix: derive then)
        if cu_seqlens is not None and cu_seqlens_cpu is not None and int(cu_seqlens_cpu[-1]) == length:
            return cu_seqlens, cu_seqlens_cpu
    import torch
    import torch.nn.functional as F

    counts = torch.bincount(seq_idx.reshape(-1).to(torch.long))
    return F.pad(counts.cumsum(0), (1, 0)).to(torch.int32), None


def _enter_packed(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
    _PACKED_LENGTHS.append((kwargs.get("cu_seqlens"), kwargs.get("cu_seqlens_cpu")))


def _leave_packed(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
    _PACKED_LENGTHS.pop()


def forward_packed_lengths(layer_cls: type) -> None:
    """Let every `layer_cls` (a gated-delta-net class) built from now on hand the packed lengths it is
    called with to `conv_cu_seqlens` for the duration of its forward.

    Hooks, not a new forward: verl replaces the class's forward with its packed one when it builds the
    actor, after this runs; a module's hooks survive that. The leave hook runs on exceptions too.
    """
    if getattr(layer_cls, "_forwards_packed_lengths", False):
        return
    original_init = layer_cls.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self.register_forward_pre_hook(_enter_packed, with_kwargs=True)
        self.register_forward_hook(_leave_packed, with_kwargs=True, always_call=True)

    layer_cls.__init__ = init  # type: ignore[method-assign]
    layer_cls._forwards_packed_lengths = True  # type: ignore[attr-defined]


def per_sequence(rule: Any) -> Any:
    """A gated-delta rule without varlen support (transformers' torch ones) made to honour `cu_seqlens`:
    one call per packed sequence. Those functions accept and ignore the argument, so a packed batch
    would carry one sequence's recurrent state into the next."""
    import torch

    @functools.wraps(rule)
    def call(
        query: Any, *args: Any, cu_seqlens: Any = None, cu_seqlens_cpu: Any = None, **kwargs: Any
    ) -> Any:
        if cu_seqlens is None:
            return rule(query, *args, **kwargs)
        if kwargs.get("initial_state") is not None or kwargs.get("output_final_state"):
            raise NotImplementedError(
                "packed sequences with recurrent state in or out need fla's varlen kernels"
            )
        length = query.shape[1]
        bounds = (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).tolist()

        def cut(value: Any, start: int, stop: int) -> Any:  # [B, T, ...] tensors along T
            per_token = isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == length
            return value[:, start:stop] if per_token else value

        outputs = [
            rule(
                cut(query, start, stop),
                *(cut(a, start, stop) for a in args),
                **{k: cut(v, start, stop) for k, v in kwargs.items()},
            )[0]
            for start, stop in itertools.pairwise(bounds)
        ]
        return torch.cat(outputs, dim=1), None

    return call


QWEN35_MODULES = (
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
)


def honour_packed_sequences(module: ModuleType) -> None:
    """Where fla is absent (CPU, Ascend, a GPU without it), transformers leaves Qwen3.5's gated-delta
    rule to its torch version, which verl's packed forward still hands `cu_seqlens`: route it through
    `per_sequence` so packing stays exact instead of carrying state from one sequence into the next."""
    if module.chunk_gated_delta_rule is None:
        module.chunk_gated_delta_rule = per_sequence(module.torch_chunk_gated_delta_rule)


@functools.cache
def guard_packed_sequences() -> None:
    """`honour_packed_sequences` on each Qwen3.5 modeling module when it is imported (now, if it is
    already): a verl process that never builds a Qwen3.5 model pays nothing. Once per process (the
    extension and `select_kernels("torch")` both ask)."""
    for name in QWEN35_MODULES:
        when_imported(name, honour_packed_sequences)


def when_imported(name: str, action: Callable[[ModuleType], None]) -> None:
    """Run `action(module)` right after module `name` is first imported, or now if it already is."""
    if name in sys.modules:
        action(sys.modules[name])
        return

    class AfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
            if fullname != name:
                return None
            sys.meta_path.remove(self)  # once; the other finders locate the module
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            load = spec.loader.exec_module

            def exec_module(module: ModuleType) -> None:
                load(module)
                action(module)

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, AfterImport())


def select_kernels(kernels: str) -> str:
    """Before any Qwen3.5 model is built: hide fla (`torch`), or route the gated-delta-net through fla.

    With `fla`, each fast op dispatches on the tensor's device: CUDA tensors take fla's Triton kernels
    (conv1d included), CPU tensors (the hf rollout server, tests) keep transformers' torch code, so one
    environment serves both.
    """
    if kernels == "torch":
        for name in ("fla", "causal_conv1d"):
            sys.modules[name] = None  # type: ignore[assignment]  # find_spec() -> None: "not installed"
        guard_packed_sequences()
        return "torch fallback"
    from fla.modules import FusedRMSNormGated
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    def on_device(fast: Any, slow: Any) -> Any:
        @functools.wraps(fast)
        def call(query: Any, *args: Any, **kwargs: Any) -> Any:
            if query.is_cuda:
                return fast(query, *args, **kwargs)
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
    forward_packed_lengths(qwen.Qwen3_5GatedDeltaNet)
    qwen.chunk_gated_delta_rule = on_device(
        chunk_gated_delta_rule, per_sequence(qwen.torch_chunk_gated_delta_rule)
    )
    qwen.fused_recurrent_gated_delta_rule = on_device(
        fused_recurrent_gated_delta_rule, per_sequence(qwen.torch_recurrent_gated_delta_rule)
    )
    qwen.FusedRMSNormGated = GatedNorm
    if hasattr(qwen, "is_fast_path_available"):
        qwen.is_fast_path_available = True
    from engine.env.pins import dist_version

    return f"fla {dist_version('fla-core')} + Triton conv1d (triton {dist_version('triton')})"


CHUNK_BYTES = 1 << 30  # fp32 working set per chunk of rows in forward and backward


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab))


# token_logprobs calls by kernel in this process: the evidence, read back by the benchmarks, that verl's
# log-probs went through the kernel a row names (a lever that silently did not apply shows here)
LOGPROBS_CALLS: collections.Counter[str] = collections.Counter()


def logprobs_kernel() -> str:
    """`chunked` (eager ops per chunk, the default) or `compiled` (`ENGINE_LOGPROBS=compiled`, the
    compiled-logprobs lever); another value is an error."""
    value = os.environ.get(LOGPROBS_ENV, "").strip() or "chunked"
    if value not in ("chunked", "compiled"):
        raise ValueError(f"{LOGPROBS_ENV}={value!r}: choose chunked or compiled, or unset it")
    return value


@functools.cache
def _compiled_chunk_steps() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The forward and backward of one chunk of rows, each traced into fused kernels: the eager chunk
    makes an fp32 copy of the logits and then separate passes for the maximum, the shift, the
    exponential, the sum and (backward) the gradient, each reading or writing fp32 rows of the whole
    vocabulary; on one H100 (0.8B, 8,192 tokens) the shift, exponential, product and maximum alone took
    34 ms of a 217 ms step's device time, against 22 ms for plain FSDP2's whole log-softmax.
    Symbolic row counts: one graph for every chunk."""
    import torch

    def forward(rows: Any, labels: Any) -> tuple[Any, Any]:
        x = rows.float()
        lse = torch.logsumexp(x, dim=-1)
        return x.gather(1, labels).squeeze(1) - lse, lse

    def backward(rows: Any, labels: Any, lse: Any, grad: Any) -> Any:
        probs = torch.exp(rows.float() - lse[:, None])
        hit = torch.arange(rows.shape[1], device=rows.device)[None, :] == labels
        return (grad * (hit.float() - probs)).to(rows.dtype)  # g * (onehot - softmax)

    compile_ = functools.partial(torch.compile, dynamic=True, fullgraph=True)
    return compile_(forward), compile_(backward)


def _token_logprobs_function() -> type:
    import torch

    class TokenLogProbs(torch.autograd.Function):
        """log softmax(logits)[label] in fp32, chunked over rows; backward recomputes softmax per chunk.

        Saves only the logits (alive anyway) and one fp32 logsumexp per row, so memory stays that of
        the row-by-row loop it replaces while the kernel count drops from O(tokens) to O(tokens/chunk).
        """

        @staticmethod
        def forward(ctx: Any, logits: Any, labels: Any) -> Any:
            vocab = logits.shape[-1]
            flat, flat_labels = logits.reshape(-1, vocab), labels.reshape(-1, 1)
            lse = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
            step = _chunk_rows(vocab)
            kernel = logprobs_kernel()
            LOGPROBS_CALLS[kernel] += 1
            ctx.compiled = kernel == "compiled"
            if ctx.compiled:
                out = torch.empty_like(lse)
                fused = _compiled_chunk_steps()[0]
                for start in range(0, flat.shape[0], step):
                    rows = slice(start, start + step)
                    out[rows], lse[rows] = fused(flat[rows], flat_labels[rows])
            else:
                for start in range(0, flat.shape[0], step):
                    stop = start + step
                    lse[start:stop] = torch.logsumexp(flat[start:stop].float(), dim=-1)
                out = flat.gather(1, flat_labels).squeeze(1).float() - lse
            ctx.save_for_backward(logits, labels, lse)
            return out.view(labels.shape)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            logits, labels, lse = ctx.saved_tensors
            vocab = logits.shape[-1]
            flat, flat_labels = logits.reshape(-1, vocab), labels.reshape(-1, 1)
            flat_grad = grad.reshape(-1, 1).float()
            out = torch.empty_like(flat)
            step = _chunk_rows(vocab)
            fused = _compiled_chunk_steps()[1] if ctx.compiled else None
            for start in range(0, flat.shape[0], step):
                stop = start + step
                g = flat_grad[start:stop]
                if fused is not None:
                    out[start:stop] = fused(flat[start:stop], flat_labels[start:stop], lse[start:stop], g)
                    continue
                probs = (flat[start:stop].float() - lse[start:stop, None]).exp_()
                probs.mul_(-g).scatter_add_(1, flat_labels[start:stop], g)  # g * (onehot - softmax)
                out[start:stop] = probs
            return out.view(logits.shape), None

    return TokenLogProbs


_TOKEN_LOGPROBS: type | None = None


def token_logprobs(logits: Any, labels: Any, inplace_backward: bool = True) -> Any:
    """Drop-in for verl's `logprobs_from_logits`; `inplace_backward` is accepted and ignored."""
    global _TOKEN_LOGPROBS
    if _TOKEN_LOGPROBS is None:
        _TOKEN_LOGPROBS = _token_logprobs_function()
    return _TOKEN_LOGPROBS.apply(logits, labels)


def install_token_logprobs() -> str | None:
    """Replace verl's row-by-row log-prob fallback with `token_logprobs`, where verl would use it.

    Without flash-attn's Triton cross-entropy (absent from the GPU image: it is a CUDA source build)
    and off Ascend, verl 0.9.1 computes log-probs one token row at a time: ~20 kernels per token in
    forward and backward, tens of thousands per micro-batch, which made its engine step several
    times slower than the model's own forward and backward on H200. Returns what was replaced.
    """
    from verl.utils import torch_functional as verl_F

    if verl_F.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE or verl_F.NPU_CROSS_ENTROPY_LOSS_AVAILABLE:
        return None
    original = verl_F.logprobs_from_logits
    for name, module in list(sys.modules.items()):  # verl modules that imported the name before us
        if name.startswith("verl.") and vars(module).get("logprobs_from_logits") is original:
            module.logprobs_from_logits = token_logprobs  # type: ignore[attr-defined]
    return "verl.utils.torch_functional.logprobs_from_logits -> engine.runtime.kernels.token_logprobs"


if os.environ.get("ENGINE_FLA_CONV1D") == "1":  # imported by verl workers through VERL_USE_EXTERNAL_MODULES
    select_kernels("fla")
