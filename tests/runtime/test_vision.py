"""The text-only lever (engine.runtime.vision): verl's packed step without the vision tower's
placeholder pass trains the language model exactly as verl does, and refuses images."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.runtime import vision
from tests.support import verl_step

ENGINE_STEP = """
import json
from tests.support.verl_step import ppo_step, start
start()
from benchmarks.gpu_worker import applied_settings, build_verl_engine
import sys
results = {}
for levers in (["fast"], ["fast", "text-only"]):
    # lr 1e-2: AdamW's weight decay on the tower's zero gradients shows in fp32 weights
    engine, config = build_verl_engine(sys.argv[1], True, 2, 32, False, levers, lr=1e-2)
    tower = next(m for name, m in engine.module.named_modules() if name.endswith("visual"))
    calls = []
    tower.register_forward_hook(lambda *_: calls.append(1))
    out = ppo_step(engine, config)
    named = list(engine.module.named_parameters())
    total = lambda keep: float(sum(p.detach().double().abs().sum() for n, p in named if keep(n)))
    results["+".join(levers)] = {
        "tower_calls": len(calls), "loss": out["loss"],
        "grad_norm": float(getattr(out["metrics"]["grad_norm"], "values", out["metrics"]["grad_norm"])),
        "language": total(lambda n: ".visual." not in "." + n),
        "tower": total(lambda n: ".visual." in "." + n),
        "stepped": applied_settings(engine.module, engine.optimizer)["vision_tower_stepped"],
    }
print(json.dumps(results))
"""


@pytest.mark.slow
def test_verls_step_without_the_placeholder_pass_trains_the_language_model_alike(tmp_path: Path) -> None:
    """verl's FSDP2 engine on the CPU (the small Qwen3.5 with its vision tower, packed, two micro-batches):
    verl runs the tower on every micro-batch and steps its zero gradients; with the lever the tower is
    never called, the optimizer keeps no state for it, the loss is verl's bit for bit, and grad norm and
    the language model's updated weights are verl's to fp32 rounding. The tower keeps its weights where
    verl's weight decay shrinks them."""
    results = verl_step.run_script(ENGINE_STEP, tmp_path)
    print(json.dumps(results))
    verl, lean = results["fast"], results["fast+text-only"]
    assert verl["tower_calls"] == 2 and verl["stepped"] is True  # once per micro-batch, zero gradients
    assert lean["tower_calls"] == 0 and lean["stepped"] is False
    assert lean["loss"] == verl["loss"]  # bit for bit
    # the norm sums the same squares without the tower's zeros, in another order: equal to rounding, and
    # so is the clipped update (the norm is above the clip)
    assert lean["grad_norm"] == pytest.approx(verl["grad_norm"], rel=1e-6, abs=0)
    assert lean["language"] == pytest.approx(verl["language"], rel=1e-9, abs=0)
    assert lean["tower"] > verl["tower"]  # verl's decay of the tower, which the lever leaves as loaded


def test_images_under_the_lever_are_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank running the tower while the others skip it would hang FSDP's gather: refuse."""
    monkeypatch.setenv(vision.ENV, "1")
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"unset model\.text_only for data with images"):
        vision.get_input_embeds(torch.nn.Module(), ids, None, torch.zeros(16, 8))


def test_text_batches_take_the_embeddings_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    embed = torch.nn.Embedding(10, 4)
    model = torch.nn.Module()
    model.get_input_embeddings = lambda: embed  # type: ignore[method-assign]
    monkeypatch.setenv(vision.ENV, "1")
    ids = torch.tensor([[1, 2, 3]])
    out = vision.get_input_embeds(model, ids, torch.ones(1, 3))
    assert torch.equal(out["inputs_embeds"], embed(ids)) and out["attention_mask"].shape == (1, 3)


@pytest.mark.parametrize("value", ["yes", "2"])
def test_a_bad_setting_fails_at_start(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(vision.ENV, value)
    with pytest.raises(ValueError, match=f"{vision.ENV}='{value}': set 1"):
        vision.install()
