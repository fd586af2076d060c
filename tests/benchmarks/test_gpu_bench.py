"""bench-gpu parts that run without a GPU: the 0.8B shape, the parameter count, input checks, tables."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks import gpu_bench
from engine.data import assets
from engine.errors import UserError
from engine.runtime import kernels


def test_text_params_matches_the_real_module() -> None:
    from transformers.models import qwen3_5

    text = dict(gpu_bench.TEXT_0P8B) | {"num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3}
    text["layer_types"] = text["layer_types"] + ["full_attention"]
    text |= {"vocab_size": 1000}
    config = qwen3_5.Qwen3_5TextConfig(**text)
    model = qwen3_5.Qwen3_5ForCausalLM(config)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n or n.endswith("dt_bias"))
    norms += sum(p.numel() for n, p in model.named_parameters() if n.endswith("A_log"))
    counted = sum(p.numel() for p in model.parameters()) - norms
    assert gpu_bench.text_params(config) == counted


def test_conv1d_cpu_path_equals_torch_depthwise_conv() -> None:
    import torch
    import torch.nn.functional as F

    x, w, b = torch.randn(2, 6, 9), torch.randn(6, 4), torch.randn(6)
    conv = torch.nn.Conv1d(6, 6, 4, groups=6, padding=3)
    conv.weight.data, conv.bias.data = w.unsqueeze(1), b
    expected = F.silu(conv(x)[..., :9])
    assert torch.allclose(kernels.fla_conv1d_fn(x, w, b, activation="silu"), expected, atol=1e-6)


def _args(tmp_path: Path, **kw: object) -> argparse.Namespace:
    base = {"modes": ["plain"], "kernels": ["fla"], "gpus": 1, "batch": 4, "mbs": 4, "seq": 2048}
    base |= {"steps": 2, "warmup": 1, "model": tmp_path, "fill": 1.0}
    return argparse.Namespace(**(base | kw))


def test_validate_refuses_bad_matrix(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    gpu_bench.validate_args(_args(tmp_path))
    with pytest.raises(UserError, match="unknown"):
        gpu_bench.validate_args(_args(tmp_path, modes=["fast"]))
    with pytest.raises(UserError, match="multiple"):
        gpu_bench.validate_args(_args(tmp_path, batch=6))
    with pytest.raises(UserError, match="--fill"):
        gpu_bench.validate_args(_args(tmp_path, fill=0.0))
    with pytest.raises(UserError, match="make-model"):
        gpu_bench.validate_args(_args(tmp_path / "nope"))


def test_markdown_table_rows_and_failures() -> None:
    ok = {"mode": "plain", "kernels": "fla", "gpus": 1, "batch": 4, "mbs": 4, "seq": 2048}
    ok |= {"tokens_per_s": 31362.3, "tokens_per_s_per_gpu": 31362.3, "step_ms": 261.2, "mfu": 0.1431}
    ok |= {"peak_alloc_gib": 48.71}
    bad = {"mode": "verl-packed", "kernels": "torch", "gpus": 1, "batch": 4, "mbs": 4, "seq": 2048}
    bad["error"] = "timeout after 90 s"
    table = gpu_bench.markdown_table([ok, bad])
    assert "| plain | fla | 1 | 4/4/2048 | 31,362 | 31,362 | 261 | 14.3% | 48.71 |" in table
    assert "failed: timeout after 90 s" in table


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_token_logprobs_equal_log_softmax_in_value_and_gradient(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    vocab = 3000
    monkeypatch.setattr(kernels, "CHUNK_BYTES", 4 * vocab * 7)  # 7 rows per chunk: several + a ragged end
    generator = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(3, 11, vocab, generator=generator)).to(getattr(torch, dtype))
    logits = logits.transpose(0, 1).requires_grad_()  # non-contiguous, as verl's slices can be
    labels = torch.randint(0, vocab, (11, 3), generator=generator)
    weights = torch.randn(11, 3, generator=generator)

    ours = kernels.token_logprobs(logits, labels)
    (ours * weights).sum().backward()
    grad, logits.grad = logits.grad, None
    reference = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    (reference * weights).sum().backward()

    assert ours.dtype == torch.float32 and ours.shape == labels.shape
    assert torch.allclose(ours, reference, atol=1e-5)
    assert grad.dtype == logits.dtype
    tolerance = 1e-6 if dtype == "float32" else 1e-2  # bf16 rounding of the gradient itself
    assert torch.allclose(grad.float(), logits.grad.float(), atol=tolerance)


def test_timeout_kills_the_workers_a_launcher_started(tmp_path: Path) -> None:
    import os
    import time

    log = tmp_path / "run.log"
    with log.open("w") as handle:  # the launcher starts a worker and waits, as torch.distributed.run does
        code = gpu_bench.run_group(["bash", "-c", "sleep 60 & echo $!; wait"], handle, timeout=2.0)
    worker = int(log.read_text().split()[0])
    time.sleep(0.2)
    assert code == "timeout after 2 s"
    stat = Path(f"/proc/{worker}/stat")
    state = stat.read_text().split()[2] if os.path.exists(stat) else "gone"
    assert state in ("gone", "Z"), f"worker {worker} survived the timeout (state {state})"


def test_make_model_writes_a_loadable_qwen35_with_the_project_tokenizer(tmp_path: Path) -> None:
    import transformers

    out = gpu_bench.make_model(tmp_path / "model", small=True)
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = model.config.get_text_config()
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert model.config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert text.eos_token_id == tokenizer.eos_token_id == model.generation_config.eos_token_id
    # the tokenizer covers the vocabulary (verl's vLLM rollout masks ids past len(tokenizer)), and the
    # padding changes no tokenization
    assert len(tokenizer) == text.vocab_size == 1024
    plain = assets.build_tokenizer(0)
    prompt = plain.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], tokenize=False)
    assert tokenizer(prompt)["input_ids"] == [
        tokenizer.convert_tokens_to_ids(plain.convert_ids_to_tokens(i)) for i in plain(prompt)["input_ids"]
    ]
    assert not list(tmp_path.glob(".model.*"))  # the temporary directory was renamed, not left behind
