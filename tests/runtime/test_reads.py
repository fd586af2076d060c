"""engine.runtime.reads on the CPU: verl's FSDP2 engine stepping with its reads deferred gives verl's
numbers (losses, metrics, grad norm, weights) bitwise, reading the step's scalars once at its end instead
of once per loss and metric; a step with a non-finite grad norm is skipped as verl skips it."""

from __future__ import annotations

import pytest

from engine.runtime import reads, syncs
from tests.support import verl_step

STEP = """
import contextlib, io, json, sys
import torch
from tests.support.verl_step import ppo_step as verl_ppo_step, start
from tests.runtime.test_syncs import PythonReads
start()
from benchmarks.gpu_worker import build_verl_engine
from engine.runtime import reads, syncs
import verl.workers.utils.losses as losses
syncs.install_host_syncs()
verl_loss = losses.ppo_loss

def nan_loss(*args, **kwargs):  # every gradient NaN
    loss, metrics = verl_loss(*args, **kwargs)
    return loss * float("nan"), metrics

def ppo_step(*args, **kwargs):  # bf16 stochastic rounding draws from torch's generator
    torch.manual_seed(0)
    return verl_ppo_step(*args, **kwargs)

def weights(engine):
    return float(sum(p.detach().double().abs().sum() for p in engine.module.parameters()))

results = {}
for mode in ("lean", "deferred"):
    if mode == "deferred":
        for name in (reads.METRIC, reads.CORE_ALGOS, reads.IMPL):
            reads.install(sys.modules[name])
    assert reads.installed() == (mode == "deferred")
    for levers in ("fast", "fast-bf16"):  # torch's fused AdamW (takes found_inf), torchao's (does not)
        engine, config = build_verl_engine(sys.argv[1], True, 2, 32, False, [levers])
        with PythonReads() as counted:
            out = ppo_step(engine, config, entropy_coeff=0.01)
        metrics = {k: getattr(v, "values", v) for k, v in out["metrics"].items()}
        after_clean = weights(engine)
        losses.ppo_loss, printed = nan_loss, io.StringIO()
        with contextlib.redirect_stdout(printed):
            skipped = ppo_step(engine, config)
        losses.ppo_loss = verl_loss
        grads = [p.grad for p in engine.module.parameters()]
        after_nan = weights(engine)
        again = ppo_step(engine, config)
        values = [x for v in metrics.values() for x in (v if isinstance(v, list) else [v])]
        results[f"{mode} {levers}"] = {
            "loss": out["loss"], "metrics": metrics, "weights": after_clean,
            "types": sorted({type(x).__name__ for x in values}), "reads": counted.calls,
            "nan": {
                "grad_norm": str(skipped["metrics"]["grad_norm"]),
                "warned": "not finite" in printed.getvalue(),
                "unchanged": after_nan == after_clean,
                "grads_cleared": all(g is None or not g.any() for g in grads),
            },
            "next": {"weights": weights(engine), "grad_norm": again["metrics"]["grad_norm"]},
        }
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def stepped(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return verl_step.run_script(STEP, tmp_path_factory.mktemp("reads"), env={syncs.ENV: "lean"})


@pytest.mark.slow
@pytest.mark.parametrize("levers", ["fast", "fast-bf16"])
def test_deferred_step_gives_verls_numbers(stepped: dict, levers: str) -> None:
    lean, deferred = stepped[f"lean {levers}"], stepped[f"deferred {levers}"]
    for key in ("loss", "metrics", "weights", "types", "nan", "next"):
        assert deferred[key] == lean[key], key
    assert lean["types"] == ["float"] and len(lean["loss"]) == 2
    assert lean["metrics"]["grad_norm"] > 0 and "actor/entropy_loss" in lean["metrics"]


@pytest.mark.slow
@pytest.mark.parametrize("levers", ["fast", "fast-bf16"])
def test_a_non_finite_step_is_skipped_as_verl_skips_it(stepped: dict, levers: str) -> None:
    for mode in ("lean", "deferred"):
        nan = stepped[f"{mode} {levers}"]["nan"]
        assert nan == {"grad_norm": "nan", "warned": True, "unchanged": True, "grads_cleared": True}, mode
        assert stepped[f"{mode} {levers}"]["next"]["grad_norm"] > 0


@pytest.mark.slow
def test_deferred_step_reads_its_scalars_once(stepped: dict) -> None:
    """verl reads the loss and each metric per micro-batch (`item`) and the norm's finiteness
    (`__bool__`); deferred, the step reads them in one `tolist` at its end, and with torch's fused AdamW
    the finiteness check is the kernel's. Left: reads before the first forward, the padding's lengths
    (engine.runtime.syncs' one `tolist` a call) and transformers' checks of a packed mask."""
    lean, deferred = stepped["lean fast"]["reads"], stepped["deferred fast"]["reads"]
    assert lean.count("item") > 10 and "__bool__" in lean  # fails on verl's own reads
    assert deferred.count("item") == 2  # the batch's unpadding and token count, before work is queued
    assert deferred.count("__bool__") == lean.count("__bool__") - 1  # the rest: transformers' mask checks
    # one read a dtype (the fp32 metrics and norm, the bf16 losses of autocast), when all is queued
    assert deferred.count("tolist") == lean.count("tolist") + 2
    torchao = stepped["deferred fast-bf16"]["reads"]
    # torchao's AdamW takes no found_inf: verl's optimizer step, with its finiteness check and norm read
    assert torchao.count("item") == 3 and torchao.count("__bool__") == deferred.count("__bool__") + 1


def test_read_to_host_gives_what_item_gives() -> None:
    import torch

    values = [torch.tensor(0.1), 3, torch.tensor([2.5], dtype=torch.bfloat16), torch.tensor(7), 0.5]
    assert reads.read_to_host(values) == [v.item() if isinstance(v, torch.Tensor) else v for v in values]
    assert [type(v) for v in reads.read_to_host(values)] == [float, int, float, int, float]


def test_defer_outside_a_step_reads_now_and_inside_keeps_one_copy() -> None:
    import torch

    value = torch.tensor(1.25, requires_grad=True) * 2
    assert reads.defer(value) == 2.5
    with reads.deferring() as pending:
        copy = reads.defer(value)
        assert isinstance(copy, torch.Tensor) and not copy.requires_grad
        assert reads.defer(copy) is copy  # verl's aggregation passes it on: no second copy
        with reads.deferring() as inner:
            assert inner is pending
    assert reads._PENDING.get() is None
