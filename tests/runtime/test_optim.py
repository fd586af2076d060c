"""engine.runtime.optim.BF16AdamW on the CPU: torchao's update, bitwise, in one compiled call; its
stochastic rounding is unbiased; its state is torchao's."""

from __future__ import annotations

import pytest
import torch
from torchao.optim import _AdamW
from torchao.optim.adam import single_param_adam

from engine.runtime.optim import BF16AdamW

SHAPES = [(64, 32), (32,), (16, 16, 8), (7,)]


def _params(seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=generator).to(torch.bfloat16)) for s in SHAPES]


def test_one_compiled_step_is_torchaos_step_bitwise() -> None:
    """Round to nearest (no stochastic rounding), three steps with weight decay: weights and both
    moments equal torchao's per-tensor step bit for bit, the state under torchao's keys."""
    ours, theirs = _params(0), _params(0)
    mine = BF16AdamW(ours, lr=1e-2, weight_decay=0.01, bf16_stochastic_round=False)
    ref = _AdamW(theirs, lr=1e-2, weight_decay=0.01, bf16_stochastic_round=False)
    for step in range(3):
        generator = torch.Generator().manual_seed(100 + step)
        for a, b, shape in zip(ours, theirs, SHAPES, strict=True):
            a.grad = b.grad = torch.randn(*shape, generator=generator).to(torch.bfloat16)
        mine.step()
        ref.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b) and not torch.equal(a, _params(0)[0][:0])  # moved, identically
        assert mine.state[a].keys() == ref.state[b].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(mine.state[a][key], ref.state[b][key])
    assert not all(torch.equal(a, b) for a, b in zip(ours, _params(0), strict=True))


def test_stochastic_rounding_is_unbiased() -> None:
    """One step of 20,000 equal weights: each lands on one of the two bf16 neighbours of the fp32
    update, the upper one as often as the update's position between them says."""
    n = 20_000
    weight = torch.nn.Parameter(torch.full((n,), 1.0, dtype=torch.bfloat16))
    weight.grad = torch.full((n,), 0.3, dtype=torch.bfloat16)
    BF16AdamW([weight], lr=1e-3, weight_decay=0.0, bf16_stochastic_round=True).step()
    exact = torch.full((1,), 1.0)  # the same update in fp32, eagerly
    single_param_adam(
        exact, torch.full((1,), 0.3, dtype=torch.bfloat16), torch.tensor(1.0), torch.zeros(1), torch.zeros(1),
        None, torch.tensor(1e-3), 0.9, 0.999, 0.0, 1e-8, True, False,
    )  # fmt: skip
    low = exact.to(torch.bfloat16)
    low = low if low.float() <= exact else torch.nextafter(low, torch.zeros(1, dtype=torch.bfloat16))
    high = torch.nextafter(low, torch.full((1,), 2.0, dtype=torch.bfloat16))
    values = set(weight.float().unique().tolist())
    assert values <= {low.float().item(), high.float().item()} and len(values) == 2
    share = (weight.float() == high.float()).float().mean().item()
    expected = ((exact - low.float()) / (high.float() - low.float())).item()
    assert abs(share - expected) < 4 * (expected * (1 - expected) / n) ** 0.5 + 1e-3


def test_amsgrad_is_refused() -> None:
    with pytest.raises(ValueError, match="amsgrad"):
        BF16AdamW(_params(0), lr=1e-3, amsgrad=True)
