"""engine.runtime.syncs on the CPU: its replacements give verl 0.9.1's own functions' tensors bitwise
(values, dtype, shape, gradients) and read device data on the host at most once where verl's read it
many times (counted as benchmarks.host_syncs counts them in a profile, and by the Python calls that
read a tensor's data, which on a CPU leave no operator in a profile: `.tolist()`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile

from benchmarks.host_syncs import HOST_READS
from engine.runtime import syncs
from tests.support import verl_step

PROMPTS, RESPONSES = [3, 1, 5, 2, 7], [4, 0, 6, 1, 9]  # ragged; one empty response


def _nested(lengths: list[int], generator: torch.Generator) -> torch.Tensor:
    rows = [torch.randint(0, 50, (n,), generator=generator) for n in lengths]
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def nested_batch(max_response_len: int | None) -> TensorDict:
    """`prompts` and `responses` nested, as verl's no-padding data carries them."""
    from verl.utils import tensordict_utils as tu

    generator = torch.Generator().manual_seed(0)
    data = TensorDict(
        {"prompts": _nested(PROMPTS, generator), "responses": _nested(RESPONSES, generator)},
        batch_size=[len(PROMPTS)],
    )
    if max_response_len is not None:
        tu.assign_non_tensor(data, max_response_len=max_response_len)
    return data


def padded_batch() -> TensorDict:
    """`prompts` padded (left) and the attention mask over prompt and response (right-padded): the
    branch verl's actor data takes (`left_right_2_no_padding` leaves `prompts` padded)."""
    width, response_width = max(PROMPTS), max(RESPONSES) + 2
    mask = torch.zeros(len(PROMPTS), width + response_width, dtype=torch.long)
    for row, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        mask[row, width - prompt : width + response] = 1
    prompts = torch.ones(len(PROMPTS), width, dtype=torch.long)
    responses = torch.ones(len(PROMPTS), response_width, dtype=torch.long)
    return TensorDict(
        {"prompts": prompts, "responses": responses, "attention_mask": mask}, batch_size=[len(PROMPTS)]
    )


BATCHES = {
    "nested, max_response_len given": lambda: nested_batch(12),
    "nested, max_response_len derived": lambda: nested_batch(None),
    "padded attention mask": padded_batch,
}
# (trailing shape, dtype, values nested): entropy-like [tokens], vocab-like [tokens, vocab]
VALUES = {
    "1-D fp32": ((), torch.float32, False),
    "1-D fp32 nested": ((), torch.float32, True),
    "2-D bf16": ((11,), torch.bfloat16, False),
    "2-D fp32 nested": ((11,), torch.float32, True),
}


def _values(trailing: tuple[int, ...], dtype: torch.dtype, nested: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(leaf, what the function gets): the packed model output of every prompt + response token."""
    generator = torch.Generator().manual_seed(1)
    leaf = torch.randn(sum(PROMPTS) + sum(RESPONSES), *trailing, generator=generator).to(dtype)
    leaf.requires_grad_()
    if not nested:
        return leaf, leaf
    offsets = torch.tensor([0, *torch.tensor(PROMPTS) + torch.tensor(RESPONSES)]).cumsum(0)
    return leaf, torch.nested.nested_tensor_from_jagged(leaf * 1, offsets=offsets)


@pytest.mark.parametrize("values", VALUES, ids=str)
@pytest.mark.parametrize("batch", BATCHES, ids=str)
def test_no_padding_2_padding_is_verls_bitwise(batch: str, values: str) -> None:
    verl = syncs.verl_function("no_padding_2_padding")
    outputs, grads = [], []
    for function in (verl, syncs.no_padding_2_padding):
        leaf, tensor = _values(*VALUES[values])
        out = function(tensor, BATCHES[batch]())
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype)
        (out * weights).sum().backward()
        outputs.append(out)
        grads.append(leaf.grad)
    ours, theirs = outputs[1], outputs[0]
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape and ours.requires_grad
    assert torch.equal(ours, theirs)
    assert torch.equal(grads[1], grads[0])
    assert ours.grad_fn.name() == theirs.grad_fn.name()  # the same operators: stack of pads


def _profiled_reads(call: Callable[[], Any]) -> int:
    """Host reads of tensor data as `benchmarks.host_syncs` counts them in a CPU profile."""
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        call()
    return sum(event.name in HOST_READS for event in profiler.events())


class PythonReads(TorchFunctionMode):
    """The Python calls that read a tensor's data on the host (on a GPU each is a sync), where they pass
    through torch's function overrides: a tensor used as a slice bound or pad size does not."""

    READS = ("tolist", "item", "__bool__", "__int__", "__index__", "__float__")

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in self.READS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("batch", BATCHES, ids=str)
def test_no_padding_2_padding_reads_the_host_once(batch: str) -> None:
    tensor = _values((11,), torch.float32, False)[1]
    verl = syncs.verl_function("no_padding_2_padding")
    data = BATCHES[batch]()
    assert _profiled_reads(lambda: verl(tensor, data)) > 1  # fails on verl's own
    assert _profiled_reads(lambda: syncs.no_padding_2_padding(tensor, data)) <= 1
    with PythonReads() as ours:
        syncs.no_padding_2_padding(tensor, data)
    with PythonReads() as theirs:
        verl(tensor, data)
    assert ours.calls == ["tolist"]  # the one read, which a CPU profile does not show
    assert "item" in theirs.calls  # besides the slice bounds and pad sizes the profile counts


def test_no_padding_2_padding_keeps_verls_checks() -> None:
    tensor = _values((), torch.float32, False)[1]
    with pytest.raises(AssertionError):  # the lengths must cover the packed values
        syncs.no_padding_2_padding(tensor[:-1], nested_batch(12))
    data = padded_batch()
    data["attention_mask"][1, : max(PROMPTS)] = 0  # a sample without a prompt
    with pytest.raises(AssertionError, match="assumes prompt_len > 0"):
        syncs.no_padding_2_padding(tensor[: -PROMPTS[1]], data)


def test_expand_as_nested_is_verls_without_host_reads() -> None:
    verl = syncs.verl_function("expand_as_nested")
    temperature = torch.tensor([0.5, 1.0, 0.7, 1.3, 2.0])
    input_ids = nested_batch(None)["prompts"]
    ours, theirs = syncs.expand_as_nested(temperature, input_ids), verl(temperature, input_ids)
    assert torch.equal(ours.values(), theirs.values()) and torch.equal(ours.offsets(), theirs.offsets())
    assert _profiled_reads(lambda: verl(temperature, input_ids)) == 2  # the total and the sign check
    assert _profiled_reads(lambda: syncs.expand_as_nested(temperature, input_ids)) == 0
    with PythonReads() as ours_reads:
        syncs.expand_as_nested(temperature, input_ids)
    assert ours_reads.calls == []


def test_replace_reaches_modules_that_imported_the_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.workers.utils import losses, padding

    verl = syncs.verl_function("no_padding_2_padding")
    monkeypatch.setattr(padding, "no_padding_2_padding", verl)
    monkeypatch.setattr(losses, "no_padding_2_padding", verl)
    syncs.replace(padding)
    assert padding.no_padding_2_padding is syncs.no_padding_2_padding
    assert losses.no_padding_2_padding is syncs.no_padding_2_padding  # ppo_loss looks it up here
    assert syncs.verl_function("no_padding_2_padding") is verl


def test_the_switch_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(syncs.ENV, raising=False)
    assert syncs.selected() == "lean"
    monkeypatch.setenv(syncs.ENV, "verl")
    assert syncs.selected() == "verl"
    monkeypatch.setenv(syncs.ENV, "deferred")
    assert syncs.selected() == "deferred"
    monkeypatch.setenv(syncs.ENV, "fast")
    with pytest.raises(ValueError, match="choose one of lean, verl, deferred"):
        syncs.selected()


STEP = """
import json, sys
from tests.support.verl_step import ppo_step, start
start()
from benchmarks.gpu_worker import build_verl_engine
from engine.runtime import syncs
results = {}
for host_syncs in ("verl", "lean"):
    if host_syncs == "lean":
        for name in syncs.REPLACEMENTS:
            syncs.replace(sys.modules[name])
    assert syncs.installed() == (host_syncs == "lean")
    engine, config = build_verl_engine(sys.argv[1], True, 2, 32, False, ["fast"])
    gdn = next(type(m) for m in engine.module.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet")
    assert (gdn.forward is syncs.qwen3_5_gated_delta_net_forward) == (host_syncs == "lean")
    out = ppo_step(engine, config, entropy_coeff=0.01)  # entropy on: ppo_loss pads it too
    metrics = {k: getattr(v, "values", v) for k, v in out["metrics"].items()}
    weights = sum(p.detach().double().abs().sum() for p in engine.module.parameters())
    results[host_syncs] = {"loss": out["loss"], "metrics": metrics, "weights": float(weights)}
print(json.dumps(results))
"""


@pytest.mark.slow
def test_verls_packed_step_is_the_same_with_the_replacements(tmp_path: Path) -> None:
    """verl's FSDP2 engine on the CPU (the small dense model, ragged responses, two micro-batches, entropy
    on): one packed train_batch with verl's functions, then one from the same weights with the
    replacements (the gated-delta-net layers' forward included: verl packs with cu_seqlens and its
    host copy there). Losses, metrics, grad norm and the updated weights are bitwise equal."""
    results = verl_step.run_script(STEP, tmp_path, env={syncs.ENV: "verl"})
    assert results["lean"] == results["verl"]
    assert results["verl"]["metrics"]["grad_norm"] > 0
    assert len(results["verl"]["loss"]) == 2 and "actor/entropy_loss" in results["verl"]["metrics"]


GDN_LENGTHS = [5, 3, 8, 1]  # ragged, one a single token
GDN_CONFIG = {
    "hidden_size": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
}  # fmt: skip
GDN_CLASSES = {  # (modeling module, config model type, gated-delta-net class)
    "dense": ("transformers.models.qwen3_5.modeling_qwen3_5", "qwen3_5_text", "Qwen3_5GatedDeltaNet"),
    "moe": (
        "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
        "qwen3_5_moe_text",
        "Qwen3_5MoeGatedDeltaNet",
    ),
}
CONVS = ("verl's per-sequence conv", "the project's conv kernel")


def gdn_layer(kind: str, conv: str, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    """One small gated-delta-net layer as a verl worker has it (the packed-lengths hooks of
    `forward_packed_lengths`, the torch rule made per-sequence), with either conv: `causal_conv1d_fn`
    None (verl's `_packed_causal_conv1d_fallback`) or `fla_conv1d_fn` (its CPU path)."""
    import importlib

    import transformers

    from engine.runtime import kernels

    module_name, model_type, class_name = GDN_CLASSES[kind]
    modeling = importlib.import_module(module_name)
    cls = getattr(modeling, class_name)
    monkeypatch.setattr(cls, "__init__", cls.__init__)
    monkeypatch.setattr(cls, "forward", cls.forward)
    monkeypatch.setattr(cls, "_forwards_packed_lengths", False, raising=False)
    kernels.forward_packed_lengths(cls)
    torch.manual_seed(0)
    layer = cls(transformers.AutoConfig.for_model(model_type, **GDN_CONFIG), layer_idx=0)
    layer.causal_conv1d_fn = kernels.fla_conv1d_fn if conv == CONVS[1] else None
    layer.chunk_gated_delta_rule = kernels.per_sequence(modeling.torch_chunk_gated_delta_rule)
    return layer


def packed_input() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden states [1, tokens, 32], cu_seqlens, cu_seqlens_cpu) of the ragged sequences."""
    cu_seqlens_cpu = torch.tensor([0, *GDN_LENGTHS]).cumsum(0).to(torch.int32)
    hidden = torch.randn(1, sum(GDN_LENGTHS), 32, generator=torch.Generator().manual_seed(3))
    return hidden, cu_seqlens_cpu.clone(), cu_seqlens_cpu  # the first the device copy on a GPU


def _gdn_run(layer: torch.nn.Module, forward: Callable[..., Any], **kwargs: Any) -> list[torch.Tensor]:
    """Output, input gradient and parameter gradients of one forward and backward through the module
    call (so its hooks run) with `forward` as the class's forward."""
    type(layer).forward = forward
    layer.zero_grad(set_to_none=True)
    hidden, cu_seqlens, cu_seqlens_cpu = packed_input()
    hidden.requires_grad_()
    out = layer(hidden, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, **kwargs)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(4))).sum().backward()
    return [out, hidden.grad, *(p.grad for p in layer.parameters())]


@pytest.mark.parametrize("conv", CONVS, ids=str)
@pytest.mark.parametrize("kind", GDN_CLASSES, ids=str)
def test_gated_delta_net_forward_is_verls_bitwise(
    kind: str, conv: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.runtime import kernels

    layer = gdn_layer(kind, conv, monkeypatch)
    seen, derive = [], kernels.conv_cu_seqlens
    monkeypatch.setattr(kernels, "conv_cu_seqlens", lambda *a: seen.append(a) or derive(*a))
    verl = syncs.verl_function("qwen3_5_gated_delta_net_forward")
    mask = torch.ones(1, sum(GDN_LENGTHS), dtype=torch.long)  # verl's packed rows pass one; a no-op
    for kwargs in ({}, {"attention_mask": mask}):
        theirs = _gdn_run(layer, verl, **kwargs)
        ours = _gdn_run(layer, syncs.qwen3_5_gated_delta_net_forward, **kwargs)
        assert len(ours) == 2 + len(list(layer.parameters())) and all(t is not None for t in ours)
        for mine, verls in zip(ours, theirs, strict=True):
            assert mine.dtype == verls.dtype and torch.equal(mine, verls)
        assert ours[0].grad_fn.name() == theirs[0].grad_fn.name()
    assert kernels._PACKED_LENGTHS == []  # the hooks saw the kwargs and left
    assert len(seen) == (4 if conv == CONVS[1] else 0)  # the kernel conv asked for the lengths each call


@pytest.mark.parametrize("conv", CONVS, ids=str)
def test_gated_delta_net_forward_reads_the_host_once_less(conv: str, monkeypatch: pytest.MonkeyPatch) -> None:
    layer = gdn_layer("dense", conv, monkeypatch)
    hidden, cu_seqlens, cu_seqlens_cpu = packed_input()
    verl = syncs.verl_function("qwen3_5_gated_delta_net_forward")
    calls = {
        name: (lambda f=f: f(layer, hidden, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu))
        for name, f in (("verl", verl), ("ours", syncs.qwen3_5_gated_delta_net_forward))
    }
    with torch.no_grad():
        reads = {name: _profiled_reads(call) for name, call in calls.items()}
        assert reads["ours"] == reads["verl"] - 1  # fails on verl's own
        with PythonReads() as ours:
            calls["ours"]()
        with PythonReads() as theirs:
            calls["verl"]()
    assert theirs.calls.count("item") == 1 and "item" not in ours.calls  # verl's cu_seqlens[-1].item()
    assert ours.calls.count("tolist") == theirs.calls.count("tolist") + 1  # the host copy's total


def test_gated_delta_net_forward_leaves_the_other_cases_to_verl(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = gdn_layer("dense", CONVS[0], monkeypatch)
    hidden, cu_seqlens, cu_seqlens_cpu = packed_input()
    verl = syncs.verl_function("qwen3_5_gated_delta_net_forward")
    calls: list[tuple[Any, ...]] = []

    def spy(*args: Any) -> Any:
        calls.append(args)
        return verl(*args)

    monkeypatch.setitem(syncs.VERL_FUNCTIONS, "qwen3_5_gated_delta_net_forward", spy)
    ours = syncs.qwen3_5_gated_delta_net_forward
    with torch.no_grad():
        # without the host copy: verl reads the device one
        out = ours(layer, hidden, cu_seqlens=cu_seqlens, cu_seqlens_cpu=None)
        assert len(calls) == 1 and calls[0][4] is cu_seqlens and calls[0][5] is None
        assert torch.equal(out, verl(layer, hidden, cu_seqlens=cu_seqlens, cu_seqlens_cpu=None))
        # unpacked: verl's plain conv over the row
        assert torch.equal(ours(layer, hidden), verl(layer, hidden)) and len(calls) == 2
        # a total that is not the row's (Ulysses shards, or wrong offsets): verl decides and raises
        bad = torch.tensor([0, 5, 9], dtype=torch.int32)
        with pytest.raises(ValueError, match="does not match seq_len 8"):
            ours(layer, hidden[:, :8], cu_seqlens=bad, cu_seqlens_cpu=bad)
        assert len(calls) == 3
        # a cache: verl refuses packed cached forwards
        with pytest.raises(NotImplementedError, match="cached forward"):
            ours(layer, hidden, cache_params=object(), cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        assert len(calls) == 4


INSTALLED = """
import json, sys
from engine.runtime.kernels import select_kernels
select_kernels("torch")
from engine.runtime import syncs
from transformers import AutoModelForImageTextToText
from transformers.models.qwen3_5 import modeling_qwen3_5 as dense
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as moe
syncs.install_host_syncs()
from verl.models.transformers.monkey_patch import apply_monkey_patch
model = AutoModelForImageTextToText.from_pretrained(sys.argv[1])  # as verl loads Qwen3.5
apply_monkey_patch(model, use_remove_padding=True)
ours, verl = syncs.qwen3_5_gated_delta_net_forward, syncs.verl_function("qwen3_5_gated_delta_net_forward")
def which(forward):
    return {ours: "ours", verl: "verl"}.get(forward, repr(forward))
layer = next(m for m in model.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet")
found = [which(dense.Qwen3_5GatedDeltaNet.forward), which(moe.Qwen3_5MoeGatedDeltaNet.forward)]
found.append(which(type(layer).forward))
import verl.workers.engine.fsdp.transformer_impl  # verl's engine, imported after the switch was read
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from engine.runtime import reads
deferred = [reads.installed(), get_policy_loss_fn("vanilla") is reads.vanilla_policy_loss]
print(json.dumps({"found": found, "installed": syncs.installed(), "deferred": deferred}))
"""


@pytest.mark.parametrize("host_syncs", syncs.CHOICES)
def test_verls_monkey_patch_installs_the_forward(host_syncs: str, tmp_path: Path) -> None:
    """In a fresh process as in a verl worker: the replacements installed before verl's qwen3_5 module
    is imported, then verl's `apply_monkey_patch` on the small dense model puts ours on both classes,
    or verl's with `ENGINE_HOST_SYNCS=verl`; `deferred` puts engine.runtime.reads on verl's engine and
    policy loss when they are imported."""
    from engine.data import random_model
    from tests.conftest import ROOT

    model = random_model.make_model(tmp_path / "dense", small=True)
    env = dict(os.environ) | {
        "PYTHONPATH": str(ROOT),
        syncs.ENV: host_syncs,
    }
    done = subprocess.run(
        [sys.executable, "-c", INSTALLED, str(model)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    expected = "verl" if host_syncs == "verl" else "ours"
    deferred = [host_syncs == "deferred"] * 2
    assert result == {"found": [expected] * 3, "installed": host_syncs != "verl", "deferred": deferred}


def test_replace_reaches_a_forward_verl_already_assigned(monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's actor built before the replacement: the classes' forward is verl's; `replace` swaps it."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as dense
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as moe
    from verl.models.transformers import qwen3_5

    verl = syncs.verl_function("qwen3_5_gated_delta_net_forward")
    monkeypatch.setattr(qwen3_5, "qwen3_5_gated_delta_net_forward", verl)
    monkeypatch.setattr(dense.Qwen3_5GatedDeltaNet, "forward", verl)
    monkeypatch.setattr(moe.Qwen3_5MoeGatedDeltaNet, "forward", verl)
    syncs.replace(qwen3_5)
    ours = syncs.qwen3_5_gated_delta_net_forward
    assert qwen3_5.qwen3_5_gated_delta_net_forward is ours
    assert dense.Qwen3_5GatedDeltaNet.forward is ours and moe.Qwen3_5MoeGatedDeltaNet.forward is ours
    assert syncs.verl_function("qwen3_5_gated_delta_net_forward") is verl
