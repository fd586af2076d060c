"""Fewer host reads of device data in verl 0.9.1's packed training step, with the same results.

Each read of device data on the host (`.item()`, `.tolist()`, a tensor as a slice bound or a pad size,
`bool()` of a tensor, `repeat_interleave` without `output_size`) is a sync on a GPU: the host waits
until the device has drained its queue, and the device then idles until the host launches again.
verl's packed step makes dozens per micro-batch (docs/reference/trainer-levers.md counts them). The
replacements build their outputs with the operators verl uses, in the same order, so values, dtype,
shape and gradients are bitwise verl's; what changes is where the host learns the sizes from:

- `no_padding_2_padding` (verl.workers.utils.padding; `ppo_loss`, `value_loss`, the distillation losses
  and the trainer call it): verl slices and pads each sample with device scalars (3 reads a sample) and
  checks the lengths with `.item()` and `.any()` (2 more): 14 at micro-batch 4. Here the prompt and
  response lengths come to the host in one `.tolist()`, verl's checks run on that copy, and the slicing
  and padding use Python ints.
- `expand_as_nested` (verl.utils.torch_functional; the per-token temperature of every packed
  micro-batch): `repeat_interleave` without `output_size` reads the total (2 reads). The total is the
  length of the nested tensor's values, known on the host.
- `qwen3_5_gated_delta_net_forward` (verl.models.transformers.qwen3_5; verl's monkey patch puts it on
  transformers' Qwen3.5 gated-delta-net classes): `int(cu_seqlens[-1].item())` reads the packed total
  from the device once per layer and micro-batch, although verl passes the host copy `cu_seqlens_cpu`
  too. The plain packed case reads it there; every other case is verl's own function.

Left as verl has them here: the token count, and (unless `ENGINE_HOST_SYNCS=deferred`, which
engine.runtime.reads adds) the loss and metric `.item()`s and the grad norm's finiteness check.

`install_host_syncs` puts the replacements in place (`engine.verl_ext` does, in every verl process);
`ENGINE_HOST_SYNCS=verl` keeps verl's own code, to compare (`benchmarks.gpu_bench --host-syncs`);
`deferred` adds the per-step reads moved to the step's end (engine.runtime.reads).
"""

from __future__ import annotations

import functools
import os
import sys
from importlib import import_module
from types import ModuleType
from typing import Any, get_args

from engine.recipes.levers import HOST_SYNCS_ENV as ENV
from engine.recipes.schema import HostSyncs
from engine.runtime.kernels import QWEN35_MODULES, when_imported

# lean: the replacements (the default); verl: verl's own code; deferred: lean + engine.runtime.reads
CHOICES: tuple[str, ...] = get_args(HostSyncs)
PADDING = "verl.workers.utils.padding"
TORCH_FUNCTIONAL = "verl.utils.torch_functional"
QWEN3_5 = "verl.models.transformers.qwen3_5"


def selected() -> str:
    """`lean` unless `ENGINE_HOST_SYNCS` says `verl` or `deferred`; another value is an error."""
    value = os.environ.get(ENV, "").strip() or "lean"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: choose one of {', '.join(CHOICES)} or unset it")
    return value


def host_lengths(data: Any) -> tuple[list[int], list[int]]:
    """Each sample's prompt and response length, as verl's `no_padding_2_padding` computes them, read to
    the host at once: the call's one host read."""
    import torch

    prompts = data["prompts"]
    if prompts.is_nested:
        prompt_lens = prompts.offsets().diff()
        response_lens = data["responses"].offsets().diff()
    else:
        attention_mask = data["attention_mask"]
        assert not attention_mask.is_nested
        prompt_lens = attention_mask[:, : prompts.shape[1]].sum(dim=1)
        response_lens = attention_mask[:, prompts.shape[1] :].sum(dim=1)
    both = torch.stack([prompt_lens, response_lens.to(prompt_lens.dtype)]).tolist()
    return both[0], both[1]


def no_padding_2_padding(tensor: Any, data: Any) -> Any:
    """verl's `no_padding_2_padding` (slice each response's outputs from the packed model output, shifted
    left by one token, right-padded to [bsz, max_response_len, *]) with one host read instead of one
    per sample and check."""
    import torch
    import torch.nn.functional as F
    from verl.utils import tensordict_utils as tu

    values = tensor.values() if tensor.is_nested else tensor
    prompt_lens, response_lens = host_lengths(data)
    if data["prompts"].is_nested:
        max_response_len = tu.get_non_tensor_data(data=data, key="max_response_len", default=-1)
        if max_response_len < 0:
            max_response_len = max(response_lens)
    else:
        max_response_len = data["responses"].shape[1]
    assert sum(prompt_lens) + sum(response_lens) == values.shape[0]
    assert 0 not in prompt_lens, f"seq_offset - resp_len - 1 assumes prompt_len > 0. Got {prompt_lens}"

    response_list = []
    skip_padding = (0, 0) * (values.ndim - 1)  # the dimensions after the sequence one
    seq_offset = 0
    for prompt_len, resp_len in zip(prompt_lens, response_lens, strict=True):
        seq_offset += prompt_len + resp_len
        piece = values[seq_offset - resp_len - 1 : seq_offset - 1]
        response_list.append(F.pad(piece, (*skip_padding, 0, max_response_len - resp_len)))
    return torch.stack(response_list, dim=0)


def expand_as_nested(tensor: Any, nested_tensor: Any) -> Any:
    """verl's `expand_as_nested` (one value per sequence repeated over its tokens) with the output size
    given: the length of the nested tensor's values, which its offsets span (torch's constructors and
    verl's packing build them so; verl's packed forward relies on it too)."""
    import torch

    assert nested_tensor.is_nested, "nested_tensor must be nested"
    assert tensor.shape[0] == nested_tensor.shape[0], (
        f"The batch shape must be the same. Got {tensor.shape[0]} vs {nested_tensor.shape[0]}"
    )
    assert len(tensor.shape) == 1, "The ndim of tensor must be 1"
    assert len(nested_tensor.shape) == 2, "The ndim of nested_tensor must be 2"

    offsets = nested_tensor.offsets()
    total = nested_tensor.values().shape[0]
    output = torch.repeat_interleave(tensor, offsets.diff(), dim=0, output_size=total)
    return torch.nested.nested_tensor_from_jagged(values=output, offsets=offsets)


def qwen3_5_gated_delta_net_forward(
    self: Any,
    hidden_states: Any,
    cache_params: Any = None,
    attention_mask: Any = None,
    cu_seqlens: Any = None,
    cu_seqlens_cpu: Any = None,
) -> Any:
    """verl's packed gated-delta-net forward with the packed total read from `cu_seqlens_cpu` instead of
    the device (one sync fewer per layer and micro-batch).

    Only the plain packed training case is computed here: one row, offsets on both sides, no cache, and
    a total equal to the row's length (under Ulysses it is the full length, and verl builds a context
    for the shard). Anything else goes to verl's function, which then checks and raises as before. The
    steps are verl's for a forward without that context, with verl's helpers: the same operators in the
    same order, for the conv kernel (`causal_conv1d_fn`) and for verl's per-sequence torch conv.
    """
    verl = verl_function("qwen3_5_gated_delta_net_forward")
    batch, length = hidden_states.shape[:2]
    if (
        cu_seqlens is None
        or cu_seqlens_cpu is None
        or cache_params is not None
        or batch != 1
        or cu_seqlens_cpu.tolist()[-1] != length  # host memory: no operator, no sync
    ):
        return verl(self, hidden_states, cache_params, attention_mask, cu_seqlens, cu_seqlens_cpu)
    import torch
    import torch.nn.functional as F

    helpers = sys.modules[QWEN3_5]
    modeling = import_module(self.__class__.__module__)  # transformers' dense or MoE Qwen3.5
    hidden_states = modeling.apply_mask_to_padding_states(hidden_states, attention_mask)
    mixed_qkv = self.in_proj_qkv(hidden_states).transpose(1, 2)  # [1, channels, tokens] for the conv
    z = self.in_proj_z(hidden_states).reshape(batch, length, -1, self.head_v_dim)
    b = self.in_proj_b(hidden_states)
    a = self.in_proj_a(hidden_states)
    if self.causal_conv1d_fn is None:  # verl's conv: one F.conv1d per sequence, on the host offsets
        mixed_qkv = helpers._packed_causal_conv1d_fallback(self, mixed_qkv, cu_seqlens, cu_seqlens_cpu)
    else:  # the kernel keeps the sequences apart by each token's sequence number
        conv_input = helpers._as_channel_last_conv1d_input(mixed_qkv)
        seq_idx = helpers._prepare_cp_conv_seq_idx(cu_seqlens, cu_seqlens_cpu, 0)
        mixed_qkv = self.causal_conv1d_fn(
            x=conv_input,
            weight=self.conv1d.weight.squeeze(1),
            bias=self.conv1d.bias,
            activation=self.activation,
            seq_idx=seq_idx,
        )
    sizes = [self.key_dim, self.key_dim, self.value_dim]
    query, key, value = torch.split(mixed_qkv.transpose(1, 2), sizes, dim=-1)
    query = query.reshape(batch, length, -1, self.head_k_dim)
    key = key.reshape(batch, length, -1, self.head_k_dim)
    value = value.reshape(batch, length, -1, self.head_v_dim)
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    heads_per_key = self.num_v_heads // self.num_k_heads
    if heads_per_key > 1:
        query = query.repeat_interleave(heads_per_key, dim=2)
        key = key.repeat_interleave(heads_per_key, dim=2)
    core, _ = helpers._packed_chunk_gated_delta_rule(
        self, query, key, value, g, beta, cu_seqlens, cu_seqlens_cpu, None
    )
    core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(core.reshape(batch, length, -1))


REPLACEMENTS = {PADDING: ("no_padding_2_padding", no_padding_2_padding)}
REPLACEMENTS[TORCH_FUNCTIONAL] = ("expand_as_nested", expand_as_nested)
REPLACEMENTS[QWEN3_5] = ("qwen3_5_gated_delta_net_forward", qwen3_5_gated_delta_net_forward)
VERL_FUNCTIONS: dict[str, Any] = {}  # name -> verl's own function, once replaced


def verl_function(name: str) -> Any:
    """verl's own function of that name, replaced or not (tests compare against it)."""
    if name in VERL_FUNCTIONS:
        return VERL_FUNCTIONS[name]
    module_name = next(m for m, (n, _) in REPLACEMENTS.items() if n == name)
    __import__(module_name)  # which may replace it, once installed
    return VERL_FUNCTIONS.get(name) or getattr(sys.modules[module_name], name)


def replace(module: ModuleType) -> None:
    """Put this module's replacement in `module` and in every verl module that imported the name
    before (`from ... import name`); modules imported later take it from `module`. A method verl
    already assigned it to (`apply_monkey_patch` sets the gated-delta-net forward on transformers'
    Qwen3.5 classes) is replaced too."""
    name, ours = REPLACEMENTS[module.__name__]
    original = vars(module).get(name)
    if original is None or original is ours:
        return
    VERL_FUNCTIONS.setdefault(name, original)
    for module_name, other in list(sys.modules.items()):
        if other is None or not module_name.startswith(("verl.", *QWEN35_MODULES)):
            continue
        if vars(other).get(name) is original:
            setattr(other, name, ours)
        for cls in list(vars(other).values()):
            if (
                isinstance(cls, type)
                and cls.__module__ == module_name
                and vars(cls).get("forward") is original
            ):
                cls.forward = ours


@functools.cache
def install_host_syncs() -> str | None:
    """The replacements, in each verl module when it is imported (now, if it is already), unless
    `ENGINE_HOST_SYNCS=verl`; with `deferred`, engine.runtime.reads too. Once per process. Returns what
    was replaced."""
    choice = selected()
    if choice == "verl":
        return None
    for module_name in REPLACEMENTS:
        when_imported(module_name, replace)
    done = ", ".join(f"{m}.{name} -> {__name__}.{name}" for m, (name, _) in REPLACEMENTS.items())
    if choice == "deferred":
        from engine.runtime import reads

        for module_name in (reads.METRIC, reads.CORE_ALGOS, reads.IMPL):
            when_imported(module_name, reads.install)
        done += f", {reads.IMPL}.FSDPEngine steps -> {reads.__name__}"
    return done


def installed() -> bool:
    """Whether verl's modules (those imported so far) call the replacements."""
    return any(
        vars(sys.modules[m]).get(name) is ours for m, (name, ours) in REPLACEMENTS.items() if m in sys.modules
    )
