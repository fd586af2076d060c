"""engine.runtime.kernels on the CPU: the conv1d and the gated-delta rule keep packed sequences apart,
and verl's packed gated-delta-net forward hands the conv1d the very lengths it was called with (on a GPU:
no device sync)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.runtime import kernels


def _conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    y = F.conv1d(x, w.unsqueeze(1), b, padding=w.shape[-1] - 1, groups=x.shape[1])
    return F.silu(y[..., : x.shape[-1]])


def test_conv1d_cpu_path_keeps_packed_sequences_apart() -> None:
    torch.manual_seed(0)
    lengths = [5, 2, 7]
    x, w, b = torch.randn(1, 6, sum(lengths)), torch.randn(6, 4), torch.randn(6)
    seq_idx = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None].to(torch.int32)
    expected = torch.cat([_conv(part, w, b) for part in x.split(lengths, dim=-1)], dim=-1)
    packed = kernels.fla_conv1d_fn(x, w, b, activation="silu", seq_idx=seq_idx)
    assert torch.allclose(packed, expected, atol=1e-6)
    # one sequence over all tokens would leak the kernel's window across the boundaries
    assert not torch.allclose(kernels.fla_conv1d_fn(x, w, b, activation="silu"), expected, atol=1e-3)


def test_conv_cu_seqlens_derives_lengths_outside_a_packed_forward() -> None:
    seq_idx = torch.tensor([[0, 0, 0, 1, 2, 2]], dtype=torch.int32)
    cu_seqlens, host = kernels.conv_cu_seqlens(seq_idx, 6)
    assert cu_seqlens.tolist() == [0, 3, 4, 6] and host is None
    assert kernels.conv_cu_seqlens(None, 6) == (None, None)


@pytest.fixture
def packed_gdn(monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    """One Qwen3.5 gated-delta-net layer with verl 0.9.1's packed forward, built after
    `forward_packed_lengths` as in a verl worker; the class is restored afterwards."""
    import transformers
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen
    from verl.models.transformers.qwen3_5 import qwen3_5_gated_delta_net_forward

    cls = qwen.Qwen3_5GatedDeltaNet
    monkeypatch.setattr(cls, "__init__", cls.__init__)
    monkeypatch.setattr(cls, "_forwards_packed_lengths", False, raising=False)
    monkeypatch.setattr(cls, "forward", qwen3_5_gated_delta_net_forward)  # what verl's monkey patch does
    kernels.forward_packed_lengths(cls)
    config = transformers.AutoConfig.for_model(
        "qwen3_5_text", hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = cls(config, layer_idx=0).eval()
    layer.causal_conv1d_fn = kernels.fla_conv1d_fn  # what select_kernels("fla") installs, CPU paths
    layer.chunk_gated_delta_rule = kernels.per_sequence(qwen.torch_chunk_gated_delta_rule)
    return layer


def test_packed_forward_hands_its_lengths_to_the_conv(
    packed_gdn: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    lengths = [5, 3, 8]
    cu_seqlens_cpu = torch.tensor([0, 5, 8, 16])
    cu_seqlens = cu_seqlens_cpu.clone()  # the device copy on a GPU
    seen: list[tuple[object, object]] = []
    derive = kernels.conv_cu_seqlens

    def spy(seq_idx: torch.Tensor, length: int) -> tuple[object, object]:
        seen.append(derive(seq_idx, length))
        return seen[-1]

    monkeypatch.setattr(kernels, "conv_cu_seqlens", spy)
    hidden = torch.randn(1, sum(lengths), 32)
    with torch.no_grad():
        packed = packed_gdn(hidden, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        alone = [packed_gdn(part) for part in hidden.split(lengths, dim=1)]
    assert seen[0][0] is cu_seqlens and seen[0][1] is cu_seqlens_cpu  # verl's own tensors, not derived
    assert seen[1:] == [(None, None)] * 3  # the unpacked calls
    assert kernels._PACKED_LENGTHS == []
    assert torch.allclose(packed, torch.cat(alone, dim=1), atol=1e-5)  # no state crosses a boundary


def test_torch_rule_ignores_cu_seqlens_unless_split() -> None:
    """Why per_sequence exists: transformers' torch rule takes cu_seqlens and ignores it."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 12, 2, 8) for _ in range(3))
    g, beta = -torch.rand(1, 12, 2), torch.rand(1, 12, 2)
    cu = torch.tensor([0, 4, 12])
    split = kernels.per_sequence(qwen.torch_chunk_gated_delta_rule)(q, k, v, g=g, beta=beta, cu_seqlens=cu)[0]
    leaky = qwen.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, cu_seqlens=cu)[0]
    second = qwen.torch_chunk_gated_delta_rule(q[:, 4:], k[:, 4:], v[:, 4:], g=g[:, 4:], beta=beta[:, 4:])[0]
    assert torch.allclose(split[:, 4:], second, atol=1e-6)
    assert not torch.allclose(leaky[:, 4:], second, atol=1e-3)


def test_lengths_are_dropped_when_the_forward_fails(packed_gdn: torch.nn.Module) -> None:
    bad = torch.tensor([0, 5, 9])  # ends past the 8 tokens: verl's forward refuses it
    with pytest.raises(ValueError, match="does not match"):
        packed_gdn(torch.randn(1, 8, 32), cu_seqlens=bad, cu_seqlens_cpu=bad)
    assert kernels._PACKED_LENGTHS == []


def test_when_imported_runs_once_after_the_first_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "late_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[int] = []
    kernels.when_imported("late_module", lambda module: seen.append(module.VALUE))
    assert seen == []  # not imported yet: nothing ran
    import late_module  # noqa: F401

    assert seen == [1]
    kernels.when_imported("late_module", lambda module: seen.append(module.VALUE + 1))  # already imported
    assert seen == [1, 2]
    monkeypatch.delitem(sys.modules, "late_module")
