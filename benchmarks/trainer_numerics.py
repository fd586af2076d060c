"""`python -m benchmarks.trainer_numerics`: do the trainer levers train like the fp32 AdamW reference?

Each lever (engine.recipes.levers) trains the same model through verl's real FSDP2 engine, built as a
recipe with that lever renders it (benchmarks.gpu_worker.build_verl_engine), for `--steps` steps on the
same fixed batches, with the loss of every response token (negative log-likelihood, so that the loss
falls and the gradients are real). Against the `baseline` lever (fp32 master weights, torch's AdamW)
it prints, per lever, the largest relative loss difference over the steps, the ratio of the loss drops,
and the largest relative grad-norm difference, and judges them by the tolerances below. A control that
is no lever, `bf16-rn` (bf16 weights and moments updated by torch's AdamW, i.e. rounded to nearest),
shows that the check fails what it should: at a small learning rate its updates round away.

One process group (`torch.distributed.run`, gloo on a CPU host, NCCL on a GPU), engines one after the
other. Rows go to `--out` (JSON lines): one per lever and step, then one verdict per lever.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from engine import bounds, errors, fsutil
from engine.errors import ArgumentParser, UserError
from engine.recipes.levers import lever_fields, lever_names

REFERENCE = "baseline"
CONTROL = "bf16-rn"  # not a lever: bf16 weights with torch's AdamW (round to nearest)
MIN_DROP = 1e-3  # the reference's loss must fall by 0.1% on its first batch for drops to be compared
# Tolerances against the fp32 reference over the steps (relative). `exact`: levers that leave every
# operation as it was (the same kernels in another schedule): bitwise equal on the CPU and on one H200.
# `rounding`: levers that round differently (another optimizer kernel, bf16 master weights with
# stochastic rounding, gradients summed in bf16): over 24 steps the difference grows from an ulp. Set
# from the H200 run of 2026-12-04 (0.8B, lr 1e-4; docs/records/h200-levers-2026-12-04b): the largest
# lever there (fused 5.2e-3 / 2.3e-2, fast-bf16 1.6e-2 / 3.7e-2) is ~2x inside, the control (bf16-rn,
# 0.107 / 0.202) 3.6x and 2x outside. `drop` bounds |1 - drop / reference drop|.
TOLERANCE = {
    "exact": {"loss": 1e-3, "drop": 0.02, "grad_norm": 1e-2},
    "rounding": {"loss": 0.03, "drop": 0.10, "grad_norm": 0.10},
}


def tolerance_class(lever: str) -> str:
    """A lever that changes the optimizer's or the attention's kernel, keeps bf16 master weights, sums
    gradients in bf16 (bf16-reduce: across devices and deferred micro-batches), fuses the log-prob passes
    (compiled-logprobs: another summation order) or sums the grad norm over
    other tensors (text-only: without the vision tower's zeros, another order; on one H100 out of `exact`
    after 24 steps, 2026-12-06) is held to `rounding`; one that only reschedules the same operations to
    `exact`."""
    fields = {} if lever == CONTROL else lever_fields([lever])
    rounds = (
        fields.get("actor.optim.precision") == "bf16_sr"
        or fields.get("actor.reduce_dtype") == "bf16"
        or fields.get("actor.optim.implementation") == "fused"
        or fields.get("model.attn_implementation") == "torch_varlen"
        or fields.get("model.text_only", False)
        or fields.get("actor.logprobs_kernel") == "compiled"
    )
    return "rounding" if lever == CONTROL or rounds else "exact"


def engine_levers(lever: str) -> list[str]:
    return [] if lever == CONTROL else [lever]


def _nll(model_output: Any, data: Any, dp_group: Any = None, losses: list | None = None) -> tuple[Any, dict]:
    """Mean negative log-likelihood of the response tokens, as verl's losses aggregate over the batch."""
    from verl.utils.torch_functional import masked_sum
    from verl.workers.utils.padding import no_padding_2_padding

    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    loss = -masked_sum(log_prob, data["response_mask"].to(bool)) / data["batch_num_tokens"] * data["dp_size"]
    if losses is not None:
        losses.append(float(loss.detach()))
    return loss, {}


def train_lever(args: argparse.Namespace, lever: str) -> list[dict[str, Any]]:
    """`--steps` steps of one lever on the fixed batches; one row per step."""
    from functools import partial

    import torch

    from benchmarks.gpu_worker import _batch, applied_settings, build_verl_engine, verl_batch
    from engine.runtime.kernels import LOGPROBS_CALLS

    LOGPROBS_CALLS.clear()  # this lever's calls alone
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    control = {"model_dtype": "bf16"} if lever == CONTROL else None  # bf16 weights, torch's AdamW
    engine, model_config = build_verl_engine(
        str(args.model), False, args.mbs, args.seq, False, engine_levers(lever), args.lr, control
    )
    vocab = model_config.hf_config.get_text_config().vocab_size
    batches = []
    for index in range(args.batches):
        ids = _batch(vocab, args.batch, args.seq, "cpu", 1000 * rank + index)
        mask = torch.ones_like(ids)
        batches.append(verl_batch(ids, mask, torch.zeros(args.batch, args.seq // 2), world, args.mbs, False))
    rows = []
    for step in range(args.steps):
        losses: list[float] = []
        with engine.train_mode():
            out = engine.train_batch(batches[step % args.batches], loss_function=partial(_nll, losses=losses))
        grad_norm = out["metrics"]["grad_norm"]
        rows.append({"lever": lever, "step": step, "batch_index": step % args.batches})
        rows[-1] |= {"loss": sum(losses), "grad_norm": float(grad_norm)}
    sync = {"defer_gradient_sync": engine.engine_config.use_no_sync_for_gradient_accumulation}
    rows[-1]["applied"] = applied_settings(engine.module, engine.optimizer) | sync  # read back, not assumed
    del engine
    return rows


def _relative(a: float, b: float) -> float:
    """|a - b| relative to b; infinity where either is not finite (a NaN loss can never pass)."""
    x, y = bounds.finite(a), bounds.finite(b)
    if x is None or y is None:
        return math.inf
    return abs(x - y) / abs(y) if y else abs(x - y)


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each lever against the reference: largest relative loss and grad-norm differences over the steps,
    the loss drop on the first batch (its first step against its last) against the reference's, and
    whether all are within the lever's tolerance. Where the reference's drop is below MIN_DROP of its
    loss the drops are noise and no lever can pass: raise --lr or --steps."""
    by_lever: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_lever.setdefault(row["lever"], []).append(row)
    ref = by_lever[REFERENCE]
    last = max(i for i, row in enumerate(ref) if row.get("batch_index", 0) == ref[0].get("batch_index", 0))
    ref_drop = ref[0]["loss"] - ref[last]["loss"]
    conclusive = ref_drop > MIN_DROP * ref[0]["loss"]
    out = []
    for lever, steps in by_lever.items():
        kind = tolerance_class(lever)
        figures = {
            "loss": max(_relative(s["loss"], r["loss"]) for s, r in zip(steps, ref, strict=True)),
            "drop": _relative(steps[0]["loss"] - steps[last]["loss"], ref_drop),
            "grad_norm": max(
                _relative(s["grad_norm"], r["grad_norm"]) for s, r in zip(steps, ref, strict=True)
            ),
        }
        applied = steps[-1].get("applied")
        ran = logprobs_applied(lever, applied, ref[-1].get("applied"))
        within = conclusive and ran is not False
        within = within and all(bounds.at_most(figures[k], TOLERANCE[kind][k]) for k in figures)
        out.append(
            {"lever": lever, "tolerance": kind, "steps": len(steps), "logprobs_applied": ran}
            | {f"max_rel_{k}" if k != "drop" else "drop_error": round(v, 6) for k, v in figures.items()}
            | {"loss_first": steps[0]["loss"], "loss_last": steps[last]["loss"], "drop_step": last}
            | {"conclusive": conclusive, "within": within}
            | {"applied": applied}
        )
    return out


def logprobs_applied(
    lever: str, applied: dict[str, Any] | None, reference: dict[str, Any] | None
) -> bool | None:
    """Whether the lever's steps computed log-probs the way it says: compiled-logprobs with the compiled
    kernel alone, every other lever as the reference did (the project's chunked function, or verl's fused
    cross-entropy where flash-attn provides one: no call counted). None for rows recorded before the
    kernels were counted. A lever compared through the wrong kernel has not been checked at all."""
    if not applied or "logprobs_calls" not in applied:
        return None
    fields = {} if lever == CONTROL else lever_fields([lever])
    ran = set(applied["logprobs_calls"])
    if fields.get("actor.logprobs_kernel") == "compiled":
        return ran == {"compiled"}
    if lever == REFERENCE:
        return "compiled" not in ran
    return reference is not None and ran == set(reference.get("logprobs_calls", ()))


def worker_main(argv: list[str]) -> int:
    """Every lever in turn in this process group; rank 0 writes the rows and the verdicts."""
    import torch
    import torch.distributed as dist

    args = build_parser().parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    from engine.runtime.kernels import install_token_logprobs

    install_token_logprobs()  # verl's log-probs through the project's function, as in every `engine run`
    rows: list[dict[str, Any]] = []
    for lever in args.levers:
        started = time.perf_counter()
        steps = train_lever(args, lever)
        for row in steps:
            row["seconds"] = round((time.perf_counter() - started) / len(steps), 3)
        rows += steps
    if dist.get_rank() == 0:
        lines = [json.dumps(r) for r in rows + [v | {"verdict": True} for v in verdicts(rows)]]
        args.out.write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()
    return 0


def _lever_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip() and n.strip() != REFERENCE]
    levers = [n for n in names if n != CONTROL]
    checked = lever_names(",".join(levers)) if levers else []
    return [REFERENCE, *checked] + ([CONTROL] if CONTROL in names else [])


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m benchmarks.trainer_numerics", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="model dir (`python -m engine make-model`)")
    parser.add_argument("--out", type=Path, default=Path("results/trainer-numerics/numerics.jsonl"))
    parser.add_argument(
        "--levers",
        type=_lever_list,
        default=[
            REFERENCE,
            "foreach",
            "fused",
            "no-reshard",
            "no-sync",
            "bf16-reduce",
            "bf16-sr",
            "bf16-sr-compiled",
            "fast",
            "fast-bf16",
            "fast-bf16-reduce+no-sync",
            "varlen-attn",
            "text-only",
            "compiled-logprobs",
            CONTROL,
        ],
        help=f"levers to compare with {REFERENCE} (always run, first); {CONTROL}: the control, must fail",
    )
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batches", type=int, default=4, help="distinct fixed batches, cycled")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole group")
    return parser


def cli_main(argv: list[str]) -> int:
    """Launch the group, print the verdicts; exit 1 when a lever is out of tolerance (the control is
    expected out, and fails the run when it is within)."""
    from benchmarks.gpu_bench import run_group, worker_env

    args = build_parser().parse_args(argv)
    if min(args.steps, args.batches, args.batch, args.mbs) < 1 or args.batch % args.mbs or args.seq < 4:
        raise UserError(
            "--steps/--batches/--batch/--mbs must be positive, --batch a multiple of --mbs, --seq >= 4"
        )
    if not (args.model / "config.json").is_file():
        raise UserError(f"--model {args.model}: no config.json; write one with `python -m engine make-model`")
    args.out = fsutil.check_out_file(args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    cmd += ["-m", "benchmarks.trainer_numerics", *argv, "--out", str(args.out), "--worker"]
    log = args.out.with_suffix(".group.log")  # the process group's output (a caller may log to OUT.log)
    started = time.monotonic()
    with log.open("w") as handle:
        code = run_group(cmd, handle, args.timeout, env=worker_env())
    if code != 0 or not args.out.exists():
        raise UserError(f"the numerics run failed ({code}); see {log}")
    rows = [json.loads(line) for line in args.out.read_text().splitlines()]
    ok = True
    head = f"{'lever':<12} {'tolerance':<9} {'max rel loss':>12} {'drop error':>10} {'max rel gnorm':>13}"
    print(f"{head}  verdict")
    for v in (r for r in rows if r.get("verdict")):
        expected = v["lever"] != CONTROL
        ran = v.get("logprobs_applied") is not False
        ok &= ran and v["conclusive"] and (v["within"] == expected or v["lever"] == REFERENCE)
        verdict = "within" if v["within"] else "OUT" if v["conclusive"] else "inconclusive"
        verdict = verdict if ran else f"NOT APPLIED (log-probs by {sorted(v['applied']['logprobs_calls'])})"
        verdict += "" if v["within"] == expected else " (unexpected)"
        print(
            f"{v['lever']:<12} {v['tolerance']:<9} {v['max_rel_loss']:>12.2e} {v['drop_error']:>10.2e} "
            f"{v['max_rel_grad_norm']:>13.2e}  {verdict}"
        )
    if not all(v["conclusive"] for v in rows if v.get("verdict")):
        print(f"inconclusive: the reference's loss fell by less than {MIN_DROP:.1%}; raise --lr or --steps")
    print(f"wall {time.monotonic() - started:.0f} s; rows in {args.out}")
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    if "--worker" in argv:
        return worker_main([a for a in argv if a != "--worker"])
    return cli_main(argv)


if __name__ == "__main__":
    errors.entry(main)
