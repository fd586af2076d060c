"""`torch_varlen` (engine.runtime.attention) attends each packed sequence as transformers' masked SDPA
does, reads the boundaries once per forward, and is what verl's engine runs when the lever selects it;
`sdpa_no_cudnn` is that masked SDPA with cuDNN's kernel switched off around each call."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.runtime import attention
from tests.support import verl_step

LENGTHS = [5, 9, 1, 3]  # ragged, one a single token


def tiny_qwen35(implementation: str, moe: bool = False) -> torch.nn.Module:
    """A 4-layer Qwen3.5 text model (one full-attention layer, 4 query heads over 2 key-value heads)."""
    import transformers

    attention.register()
    shape = {
        "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 300, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    }  # fmt: skip
    if moe:
        config = transformers.Qwen3_5MoeTextConfig(
            **shape, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2,
        )  # fmt: skip
        model_cls = transformers.Qwen3_5MoeForCausalLM
    else:
        config = transformers.Qwen3_5TextConfig(**shape, intermediate_size=128)
        model_cls = transformers.Qwen3_5ForCausalLM
    torch.manual_seed(0)
    return model_cls._from_config(config, attn_implementation=implementation, dtype=torch.float32)


def packed_row(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 300, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    return ids, torch.cat([torch.arange(n) for n in lengths])[None]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_packed_row_attends_as_masked_sdpa(moe: bool) -> None:
    """Logits and every gradient equal transformers' SDPA under its block-diagonal mask (fp32, CPU;
    transformers builds that mask only without a cache, as in training)."""
    reference, varlen = tiny_qwen35("sdpa", moe), tiny_qwen35(attention.NAME, moe)
    varlen.load_state_dict(reference.state_dict())
    assert varlen.config._attn_implementation == attention.NAME
    ids, positions = packed_row(LENGTHS)
    outputs = []
    for model in (reference, varlen):
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits  # as verl trains
        logits.square().mean().backward()
        outputs.append(logits)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)
    for (name, want), got in zip(reference.named_parameters(), varlen.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-7, msg=name)
    # the check can fail: one unbroken sequence attends across the boundaries
    unpacked = varlen(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits
    assert (unpacked - outputs[0]).abs().max() > 1e-3


def test_full_rows_without_a_mask_attend_row_by_row() -> None:
    """verl's padded mode with nothing padded: a batch of rows, no mask, positions from 0 in each."""
    reference, varlen = tiny_qwen35("sdpa"), tiny_qwen35(attention.NAME)
    varlen.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 300, (3, 7), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(7).expand(3, 7)
    want, got = (
        m(input_ids=ids, position_ids=positions, use_cache=False).logits for m in (reference, varlen)
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert attention.sequence_bounds(positions)[1] == [0, 7, 14, 21]


def test_the_boundaries_are_read_once_per_row(monkeypatch: pytest.MonkeyPatch) -> None:
    _, positions = packed_row(LENGTHS)
    bounds, host = attention.sequence_bounds(positions)
    assert host == [0, 5, 14, 15, 18] and bounds.dtype == torch.int32 and bounds.tolist() == host
    reads = []
    monkeypatch.setattr(torch, "nonzero", lambda *a, **k: reads.append(1) or torch.ops.aten.nonzero(*a))
    assert attention.sequence_bounds(positions)[1] == host and not reads  # same tensor: cached
    assert attention.sequence_bounds(positions.clone())[1] == host and len(reads) == 1


def test_calls_without_position_ids_are_plain_sdpa() -> None:
    """Qwen3.5's vision blocks call once per image, non-causal, without position ids."""
    q, k, v = (torch.randn(1, 4, 6, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    module = torch.nn.Module()
    out, weights = attention.varlen_attention_forward(module, q, k, v, None, is_causal=False)
    assert weights is None
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v).transpose(1, 2))


def test_a_padded_batch_is_refused() -> None:
    q = torch.randn(2, 4, 6, 8)
    with pytest.raises(ValueError, match="use_remove_padding=true"):
        attention.varlen_attention_forward(torch.nn.Module(), q, q, q, torch.ones(2, 6, dtype=torch.bool))


def test_a_padded_batch_is_refused_through_the_model() -> None:
    """transformers hands an attention it does not know no mask at all: the padding mask must reach the
    refusal, or left-padded rows would attend their pads."""
    model = tiny_qwen35(attention.NAME)
    ids = torch.randint(0, 300, (2, 6), generator=torch.Generator().manual_seed(3))
    padded = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="use_remove_padding=true"):
        model(input_ids=ids, attention_mask=padded, use_cache=False)
    full = model(input_ids=ids, attention_mask=torch.ones_like(padded), use_cache=False).logits
    torch.testing.assert_close(full, model(input_ids=ids, use_cache=False).logits)  # nothing padded: no mask


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_sdpa_without_cudnn_is_sdpa_under_its_mask(moe: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each attention call gets transformers' block-diagonal mask with cuDNN's kernel off (and only
    there): logits and gradients are SDPA's own (the same kernels on a CPU)."""
    reference, no_cudnn = tiny_qwen35("sdpa", moe), tiny_qwen35(attention.NAME, moe)
    no_cudnn.load_state_dict(reference.state_dict())
    no_cudnn.set_attn_implementation(attention.NO_CUDNN)
    assert no_cudnn.config._attn_implementation == attention.NO_CUDNN
    calls: list[tuple[bool, bool, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def watched(*args, **kwargs):
        backends, mask = torch.backends.cuda, kwargs.get("attn_mask")
        calls.append((backends.cudnn_sdp_enabled(), backends.mem_efficient_sdp_enabled(), mask is not None))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", watched)
    ids, positions = packed_row(LENGTHS)
    outputs = []
    for model in (reference, no_cudnn):
        calls.clear()
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        logits.square().mean().backward()
        outputs.append(logits)
        on = model is reference
        assert calls and all(call == (on, True, True) for call in calls), calls  # one full-attention layer
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the call
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
    for (name, want), got in zip(reference.named_parameters(), no_cudnn.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0, msg=name)


ENGINE_STEP = """
import json, sys
from tests.support.verl_step import ppo_step, start
start()
from benchmarks.gpu_worker import build_verl_engine
from engine.runtime import attention
calls = []
bounds = attention.sequence_bounds
attention.sequence_bounds = lambda p: calls.append(1) or bounds(p)
results = {}
for levers in (["fast"], ["fast", "varlen-attn"], ["fast", "sdpa-no-cudnn"]):
    calls.clear()
    engine, config = build_verl_engine(sys.argv[1], True, 2, 32, False, levers)
    out = ppo_step(engine, config)
    weights = sum(p.detach().double().abs().sum() for p in engine.module.parameters())
    results["+".join(levers)] = {
        "attn": config.hf_config._attn_implementation, "calls": len(calls), "loss": out["loss"],
        "grad_norm": getattr(out["metrics"]["grad_norm"], "values", out["metrics"]["grad_norm"]),
        "weights": float(weights),
    }
print(json.dumps(results))
"""


@pytest.mark.slow
def test_verls_packed_step_runs_it_and_trains_alike(tmp_path: Path) -> None:
    """verl's FSDP2 engine on the CPU (the small dense model, ragged responses, two micro-batches): with
    the lever the model is built with `torch_varlen`, every attention layer's forward comes through it,
    and loss, grad norm and updated weights match the sdpa step from the same weights to bf16 precision
    (the fp32 equality is the first test's)."""
    results = verl_step.run_script(ENGINE_STEP, tmp_path)
    sdpa, varlen = results["fast"], results["fast+varlen-attn"]
    assert (sdpa["attn"], sdpa["calls"]) == ("sdpa", 0)
    assert varlen["attn"] == attention.NAME and varlen["calls"] > 0
    print(json.dumps(results))
    # bf16 compute (FSDP2's param dtype): the two kernels round differently, so equal to bf16 precision
    assert varlen["loss"] == pytest.approx(sdpa["loss"], rel=2e-3)
    assert varlen["grad_norm"] == pytest.approx(sdpa["grad_norm"], rel=1e-2)
    assert varlen["weights"] == pytest.approx(sdpa["weights"], rel=1e-6)
    # the sdpa-no-cudnn lever builds the model with its name; on a CPU its kernels are sdpa's
    no_cudnn = results["fast+sdpa-no-cudnn"]
    assert (no_cudnn["attn"], no_cudnn["calls"]) == (attention.NO_CUDNN, 0)
    assert {k: no_cudnn[k] for k in ("loss", "grad_norm", "weights")} == {
        k: sdpa[k] for k in ("loss", "grad_norm", "weights")
    }


def test_the_gpu_check_agrees_on_the_cpu(tmp_path: Path) -> None:
    """`benchmarks.attention_check` (run on the GPU with the bench stages) on the small model in bf16:
    logits and gradients within its tolerance, its JSON line appended to --out."""
    from benchmarks import attention_check
    from engine.data import random_model

    model = random_model.make_model(tmp_path / "dense", small=True)
    out = tmp_path / "check.jsonl"
    argv = ["--model", str(model), "--device", "cpu", "--seqs", "3", "--seq", "32", "--repeats", "1"]
    assert attention_check.cli_main([*argv, "--out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["ok"] and row["logits_rel_l2"] < 1e-2 and row["grad_rel_l2_global"] < 2e-2
    assert row["sdpa_fwd_bwd_ms"] > 0 and row["varlen_fwd_bwd_ms"] > 0


def _varlen_211(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1)):  # fmt: skip
    """torch 2.11's `varlen_attn` signature (no `enable_gqa`), computed by SDPA per sequence."""
    assert key.shape[1] == query.shape[1] and window_size == (-1, 0) and max_q == max_k
    host = cu_seq_q.tolist()
    assert max_q == max(b - a for a, b in pairwise(host))
    parts = [
        F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (query, key, value)), is_causal=True,
                                       scale=scale).transpose(0, 1)
        for a, b in pairwise(host)
    ]  # fmt: skip
    return torch.cat(parts)


def test_the_flash_call_adapts_to_torch_2_11s_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel runs on a GPU only; its call is checked here against torch 2.11's signature, which has a
    causal window but no GQA argument (the first GPU run failed on that): heads are repeated instead."""
    import torch.nn.attention.varlen as varlen

    monkeypatch.setattr(varlen, "varlen_attn", _varlen_211)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 18, 8, generator=gen)
    k, v = torch.randn(1, 2, 18, 8, generator=gen), torch.randn(1, 2, 18, 8, generator=gen)
    _, positions = packed_row(LENGTHS)
    bounds, host = attention.sequence_bounds(positions)
    got = attention._flash_varlen(q, k, v, bounds, host, 0.3)
    torch.testing.assert_close(got, attention._per_sequence_sdpa(q, k, v, host, 0.3))
