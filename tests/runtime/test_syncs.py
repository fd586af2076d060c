"""engine.runtime.syncs on the CPU: its replacements give verl 0.9.1's own functions' tensors bitwise
(values, dtype, shape, gradients) and read device data on the host at most once where verl's read it
many times (counted as benchmarks.host_syncs counts them in a profile, and by the Python calls that
read a tensor's data, which on a CPU leave no operator in a profile: `.tolist()`)."""

from __future__ import annotations

import json
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
    monkeypatch.setenv(syncs.ENV, "fast")
    with pytest.raises(ValueError, match="choose one of lean, verl"):
        syncs.selected()


STEP = """
import json, sys
from functools import partial
import torch, torch.distributed as dist
from engine.runtime.kernels import select_kernels
select_kernels("torch")
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
from verl.utils import tensordict_utils as tu
from verl.workers.config import ActorConfig
from verl.workers.utils.losses import ppo_loss
from benchmarks.gpu_worker import _batch, _response_mask, build_verl_engine, verl_batch
from engine.runtime import syncs
results = {}
for host_syncs in ("verl", "lean"):
    if host_syncs == "lean":
        for name in syncs.REPLACEMENTS:
            syncs.replace(sys.modules[name])
    assert syncs.installed() == (host_syncs == "lean")
    engine, config = build_verl_engine(sys.argv[1], True, 2, 32, False, ["fast"])
    vocab = config.hf_config.get_text_config().vocab_size
    ids, mask = _batch(vocab, 4, 32, "cpu", 7), _response_mask(0.3, 4, 32, 16, 7)
    advantages = torch.randn(4, 16, generator=torch.Generator().manual_seed(7))
    td = verl_batch(ids, mask, advantages, 1, 2, True)
    tu.assign_non_tensor(td, calculate_entropy=True)  # ppo_loss pads the entropy too
    td["old_log_probs"] = torch.full_like(td["old_log_probs"], -7.0)  # near the model's: few clipped
    actor = ActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=2, entropy_coeff=0.01)
    with engine.train_mode():
        out = engine.train_batch(td, loss_function=partial(ppo_loss, config=actor))
    metrics = {k: getattr(v, "values", v) for k, v in out["metrics"].items()}
    weights = sum(p.detach().double().abs().sum() for p in engine.module.parameters())
    results[host_syncs] = {"loss": out["loss"], "metrics": metrics, "weights": float(weights)}
print(json.dumps(results))
"""


@pytest.mark.slow
def test_verls_packed_step_is_the_same_with_the_replacements(tmp_path: Path) -> None:
    """verl's FSDP2 engine on the CPU (the small dense model, ragged responses, two micro-batches, entropy
    on): one packed train_batch with verl's functions, then one from the same weights with the
    replacements. Losses, metrics, grad norm and the updated weights are bitwise equal."""
    from benchmarks.gpu_bench import worker_env
    from engine.data import random_model
    from tests.conftest import ROOT

    model = random_model.make_model(tmp_path / "dense", small=True)
    env = worker_env() | {"PYTHONPATH": str(ROOT), syncs.ENV: "verl"}
    env |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", STEP, str(model), str(tmp_path / "pg")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    assert results["lean"] == results["verl"]
    assert results["verl"]["metrics"]["grad_norm"] > 0
    assert len(results["verl"]["loss"]) == 2 and "actor/entropy_loss" in results["verl"]["metrics"]
