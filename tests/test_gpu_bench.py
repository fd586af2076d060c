"""bench-gpu parts that run without a GPU: the 0.8B shape, the parameter count, input checks, tables."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from engine import gpu_bench, kernels
from engine.errors import UserError


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
    base |= {"steps": 2, "warmup": 1, "model": tmp_path}
    return argparse.Namespace(**(base | kw))


def test_validate_refuses_bad_matrix(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    gpu_bench._validate(_args(tmp_path))
    with pytest.raises(UserError, match="unknown"):
        gpu_bench._validate(_args(tmp_path, modes=["fast"]))
    with pytest.raises(UserError, match="multiple"):
        gpu_bench._validate(_args(tmp_path, batch=6))
    with pytest.raises(UserError, match="make-model"):
        gpu_bench._validate(_args(tmp_path / "nope"))


def test_markdown_table_rows_and_failures() -> None:
    ok = {"mode": "plain", "kernels": "fla", "gpus": 1, "batch": 4, "mbs": 4, "seq": 2048}
    ok |= {"tokens_per_s": 31362.3, "tokens_per_s_per_gpu": 31362.3, "step_ms": 261.2, "mfu": 0.1431}
    ok |= {"peak_alloc_gib": 48.71}
    bad = {"mode": "verl-packed", "kernels": "torch", "gpus": 1, "batch": 4, "mbs": 4, "seq": 2048}
    bad["error"] = "timeout after 90 s"
    table = gpu_bench.markdown_table([ok, bad])
    assert "| plain | fla | 1 | 4/4/2048 | 31,362 | 31,362 | 261 | 14.3% | 48.71 |" in table
    assert "failed: timeout after 90 s" in table
