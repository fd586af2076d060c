"""`python -m benchmarks.gpu_bench`: training throughput and peak memory of Qwen3.5 through verl's engine.

Every configuration runs in its own `torch.distributed.run` process group, so an out-of-memory or a
kernel failure costs one row, not the table. Rows: plain FSDP2 (our own fully_shard + AdamW loop, the
ceiling) and verl's FSDP2 engine (`EngineRegistry`, GRPO's `ppo_loss`) padded and packed
(remove-padding), each with the gated-delta-net on transformers' torch fallback (`torch`) or on
flash-linear-attention with its Triton causal conv1d (`fla`). Throughput counts every token of the
batch; MFU uses 6 x N x tokens/s against the device's dense bf16 peak.

The models are the random-init ones `python -m engine make-model` writes in a registry shape (the
Qwen3.5-0.8B, dense, or the 35B-A3B architecture at 6 layers, MoE). MFU counts the parameters a token
multiplies by (`flops_params`: for the MoE, attention + router + shared expert + 8 routed experts + head)
and ignores attention-score and gated-delta-rule FLOPs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.phase_clock import phases_table
from engine import errors, fsutil, procs
from engine.errors import ArgumentParser, UserError
from engine.recipes.levers import lever_names
from engine.recipes.params import count_text_params
from engine.runtime.syncs import CHOICES as HOST_SYNCS_CHOICES
from engine.runtime.syncs import ENV as HOST_SYNCS_ENV

console = Console(stderr=True, highlight=False)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
MODES = ("plain", "verl-padded", "verl-packed")
# what makes two rows repeats of one measurement (benchmarks.compare matches baselines by them too)
CONFIG_KEYS = ("model", "mode", "kernels", "levers", "logprobs", "gpus", "batch", "mbs", "seq", "fill")
# settings newer than some baselines: a row at the default (or without the field) keys as before, so the
# rows of `engine run`'s code keep matching the baselines recorded before the setting existed
DEFAULTED_KEYS = {"host_syncs": "lean"}
KERNELS = ("torch", "fla")


def config_key(row: dict[str, Any]) -> tuple:
    """What makes two rows repeats of one measurement: CONFIG_KEYS, and DEFAULTED_KEYS off their default."""
    off_default = tuple(
        (k, row[k]) for k, default in DEFAULTED_KEYS.items() if row.get(k) not in (None, default)
    )
    return tuple(row.get(k) for k in CONFIG_KEYS) + off_default


def flops_params(config: Any) -> int:
    """The N of the MFU estimate (6 x N x tokens): text parameters a token's forward multiplies by, i.e.
    attention, router, shared and top-k routed experts and the head (models.count_text_params)."""
    return count_text_params(config.get_text_config().to_dict()).matmul


def model_tag(config: Any) -> str:
    """The model's shape in a few words, what tells two benchmarked models apart: `qwen3_5_moe_text 6L
    h2048 256e` (the directory name is the user's)."""
    text = config.get_text_config()
    experts = getattr(text, "num_experts", 0) or 0
    return f"{text.model_type} {text.num_hidden_layers}L h{text.hidden_size}" + (
        f" {experts}e" if experts else ""
    )


Shape = tuple[int, int, int]  # sequences per GPU per step, micro-batch, sequence length


def parse_shapes(text: str) -> list[Shape]:
    """`4/4/2048,8/2/2048`: batch/mbs/seq triples, as the tables print them."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().split("/")
        if len(parts) != 3 or not all(part.isdigit() for part in parts):
            raise argparse.ArgumentTypeError(f"shape {item!r} is not BATCH/MBS/SEQ, e.g. 4/4/2048")
        batch, mbs, seq = (int(part) for part in parts)
        shapes.append((batch, mbs, seq))
    return shapes


def shapes_of(args: argparse.Namespace) -> list[Shape]:
    return getattr(args, "shapes", None) or [(args.batch, args.mbs, args.seq)]


def configurations(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(kernels, mode, lever) of each process group, in the order they run: the levers apply to verl's
    engine, so plain FSDP2 (the ceiling, with its own fused AdamW) runs once, as `baseline`."""
    return [
        (kernels, mode, lever)
        for kernels in args.kernels
        for mode in args.modes
        for lever in (["baseline"] if mode == "plain" else args.levers)
    ]


def run_matrix(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (kernels, mode, lever) in a fresh process group, which measures each shape in turn (the model
    is loaded once per group); the whole sequence `--repeats` times, so that the repeats of one row are
    spread over the allocation rather than back to back."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for repeat in range(1, args.repeats + 1):
        for kernels, mode, lever in configurations(args):
            rows += run_configuration(args, kernels, mode, lever, repeat)
    return rows


def run_configuration(
    args: argparse.Namespace, kernels: str, mode: str, lever: str, repeat: int
) -> list[dict[str, Any]]:
    """One process group's rows (one per shape); what failed becomes a row with the last error line."""
    shapes = shapes_of(args)
    spec = ",".join("/".join(map(str, shape)) for shape in shapes)
    before = args.out.read_text().count("\n") if args.out.exists() else 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}"]
    cmd += ["-m", "benchmarks.gpu_worker", "--model", str(args.model), "--out", str(args.out)]
    cmd += ["--modes", mode, "--kernels", kernels, "--shapes", spec]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--recompute"] if args.recompute else []
    cmd += ["--profile", str(args.profile)] if args.profile and repeat == 1 else []  # one table a lever
    cmd += ["--logprobs", args.logprobs, "--fill", str(args.fill), "--gpus", str(args.gpus)]
    cmd += ["--levers", lever, "--repeat", str(repeat), "--host-syncs", args.host_syncs]
    console.print(f"[bold]bench[/bold] {mode}/{kernels}/{lever} x{args.gpus} shapes {spec}, repeat {repeat}")
    started = time.monotonic()
    log = args.out.with_suffix(f".{run_slug(mode, kernels, args, shapes[0], lever)}.r{repeat}.log")
    with log.open("w") as handle:
        code = run_group(cmd, handle, args.timeout, env=worker_env() | {HOST_SYNCS_ENV: args.host_syncs})
    lines = args.out.read_text().splitlines() if args.out.exists() else []
    measured = [json.loads(line) for line in lines[before:]]
    if code != 0 or len(measured) < len(shapes):
        # the worker's own error, not torchrun's ChildFailedError that wraps it
        lines = log.read_text(errors="replace").splitlines()
        tail = [ln for ln in lines if "Error" in ln and "ChildFailedError" not in ln][-1:]
        batch, mbs, seq = shapes[len(measured)] if len(measured) < len(shapes) else shapes[-1]
        row = {"mode": mode, "kernels": kernels, "gpus": args.gpus, "batch": batch, "mbs": mbs}
        row |= {"seq": seq, "fill": args.fill, "logprobs": args.logprobs, "levers": lever, "repeat": repeat}
        row["host_syncs"] = None if mode == "plain" else args.host_syncs
        row["error"] = (tail or [f"exit {code}"])[0]
        with args.out.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        measured.append(row)
    wall = round(time.monotonic() - started, 1)
    for row in measured:
        row["wall_s"] = wall  # the whole group's, model load included
        console.print(f"  {_shape(row)}: {_cell(row)}")
    return measured


# verl's GRPO trainer allocates with expandable segments from its first weight sync on (engine_workers'
# update_weights ends with set_expandable_segments(True)); without them an 80 GB card at 68 GiB peak
# spent 53 cudaMalloc and 53 cudaFree (each a device sync) in every step of the MoE bench (2026-12-05)
TRAINER_ALLOC_CONF = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def worker_env() -> dict[str, str]:
    """The environment of a worker: this one, on a GPU with the allocator settings verl's trainer
    steps under (a setting of the caller's own wins), and on a host without a GPU the cpu profile's
    settings that let verl's engine run there (engine.verl_ext's platform, gloo), as `engine run` has."""
    import torch

    from engine.recipes.loader import device_profile
    from engine.recipes.plan import EXTERNAL_MODULE

    if torch.cuda.is_available():
        return TRAINER_ALLOC_CONF | dict(os.environ)
    profile = device_profile("cpu")
    verl_ext = {"VERL_USE_EXTERNAL_MODULES": EXTERNAL_MODULE}
    return {k: str(v) for k, v in profile["env"].items()} | verl_ext | dict(os.environ)


def run_group(cmd: list[str], log: Any, timeout: float, env: dict[str, str] | None = None) -> int | str:
    """Run in its own session, killed whole on timeout and when this process ends, however it ends.

    torch.distributed.run's workers outlive a killed launcher: left running they hold the GPU and
    the CPU, and they append a late row to the results, which skews every row measured after them.
    """
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
        preexec_fn=procs.dies_with_this_process(),
    )
    with procs.session_reaper(proc):
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"timeout after {timeout:.0f} s"


def run_slug(mode: str, kernels: str, args: argparse.Namespace, shape: Shape, lever: str = "baseline") -> str:
    """One configuration's file stem: its log here, its profile table in the worker."""
    batch, mbs, seq = shape
    shape_text = f"g{args.gpus}.b{batch}.m{mbs}.s{seq}.f{args.fill:g}"
    syncs = getattr(args, "host_syncs", "lean")
    slug = f"{mode}.{kernels}.{args.logprobs}.{shape_text}" + ("" if lever == "baseline" else f".{lever}")
    return slug + ("" if syncs == "lean" or mode == "plain" else f".syncs-{syncs}")


def _run_name(row: dict[str, Any]) -> str:
    verl_logprobs = row.get("logprobs") == "verl" and row["mode"] != "plain"
    lever = row.get("levers") or "baseline"
    name = row["mode"] + (f" +{lever}" if lever != "baseline" else "")
    syncs = row.get("host_syncs") or "lean"
    name += " (verl log-probs)" if verl_logprobs else ""
    return name + (f" ({syncs} host syncs)" if syncs != "lean" and row["mode"] != "plain" else "")


def _shape(row: dict[str, Any]) -> str:
    fill = row.get("fill", 1.0)
    return f"{row['batch']}/{row['mbs']}/{row['seq']}" + (f" fill {fill:g}" if fill < 1 else "")


def _mfu(row: dict[str, Any]) -> str:
    return f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "-"


def _cell(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"failed: {row['error'][:160]}"
    mfu = _mfu(row)
    speed = f"{row['tokens_per_s']:,.0f} tok/s, {row['step_ms']:,.0f} ms/step"
    return f"{speed}, MFU {mfu}, peak {row['peak_alloc_gib']} GiB"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The table docs/reference/performance.md carries."""
    head = "| run | kernels | GPUs | batch/mbs/seq | tokens/s | tokens/s/GPU | step ms | MFU | peak GiB |\n"
    head += "|---|---|---|---|---|---|---|---|---|\n"
    body = []
    for r in rows:
        shape = _shape(r)
        if "error" in r:
            body.append(
                f"| {_run_name(r)} | {r['kernels']} | {r['gpus']} | {shape} | failed: {r['error'][:80]} |||||"
            )
            continue
        mfu = _mfu(r)
        body.append(
            f"| {_run_name(r)} | {r['kernels']} | {r['gpus']} | {shape} | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s_per_gpu']:,.0f} | {r['step_ms']:,.0f} | {mfu} | {r['peak_alloc_gib']} |"
        )
    return head + "\n".join(body) + "\n"


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration and shape over its repeats: medians, the spread of tokens/s
    ((max - min) / median), the largest peak; failed repeats are counted, not averaged."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(config_key(row), []).append(row)
    summary = []
    for key, group in groups.items():
        ok = [r for r in group if "error" not in r]
        entry: dict[str, Any] = dict(zip(CONFIG_KEYS, key, strict=False)) | dict(key[len(CONFIG_KEYS) :])
        entry |= {"repeats": len(ok), "failed": len(group) - len(ok)}
        if ok:
            speeds = sorted(r["tokens_per_s"] for r in ok)
            median = statistics.median(speeds)
            entry |= {
                "tokens_per_s": round(median, 1),
                "tokens_per_s_min": speeds[0],
                "tokens_per_s_max": speeds[-1],
                "spread": round((speeds[-1] - speeds[0]) / median, 4) if median else None,
                "step_ms": round(statistics.median(r["step_ms"] for r in ok), 1),
                "mfu": _median_or_none([r.get("mfu") for r in ok]),
                "peak_alloc_gib": max(r["peak_alloc_gib"] for r in ok),
            }
        summary.append(entry)
    return summary


def _median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 4) if known else None


def summary_table(summary: list[dict[str, Any]]) -> str:
    """Medians over the repeats, as the issue's lever table wants them."""
    head = "| run | kernels | batch/mbs/seq | repeats | median tokens/s | min-max | spread | median step ms "
    head += "| median MFU | peak GiB |\n|---|---|---|---|---|---|---|---|---|---|\n"
    body = []
    for r in summary:
        cells = [_run_name(r), r["kernels"], _shape(r), f"{r['repeats']} ok, {r['failed']} failed"]
        if r["repeats"]:
            spread = f"{100 * r['spread']:.1f}%" if r["spread"] is not None else "-"
            cells += [
                f"{r['tokens_per_s']:,.0f}",
                f"{r['tokens_per_s_min']:,.0f}-{r['tokens_per_s_max']:,.0f}",
            ]
            cells += [spread, f"{r['step_ms']:,.0f}", _mfu(r), str(r["peak_alloc_gib"])]
        else:
            cells += ["-"] * 6
        body.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(body) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m benchmarks.gpu_bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    run = sub.add_parser("run", help="run the benchmark matrix")
    run.add_argument(
        "--model", type=Path, required=True, help="model directory (`python -m engine make-model` writes one)"
    )
    run.add_argument("--out", type=Path, default=Path("results/bench-gpu/bench.jsonl"))
    run.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    run.add_argument("--kernels", type=lambda s: s.split(","), default=list(KERNELS))
    run.add_argument("--gpus", type=int, default=1)
    run.add_argument("--batch", type=int, default=4, help="sequences per GPU per step")
    run.add_argument("--mbs", type=int, default=4, help="micro-batch per GPU")
    run.add_argument("--seq", type=int, default=2048)
    run.add_argument(
        "--shapes",
        type=parse_shapes,
        default=None,
        help="BATCH/MBS/SEQ,...: measure each in turn in one process group (instead of --batch/--mbs/--seq)",
    )
    run.add_argument("--steps", type=int, default=3, help="timed steps")
    run.add_argument("--warmup", type=int, default=1)
    run.add_argument("--recompute", action="store_true", help="gradient checkpointing")
    run.add_argument(
        "--logprobs",
        choices=("chunked", "verl"),
        default="chunked",
        help="verl rows: engine.runtime.kernels.token_logprobs (what `engine run` uses) "
        "or verl's own fallback",
    )
    run.add_argument(
        "--host-syncs",
        choices=HOST_SYNCS_CHOICES,
        default="lean",
        help="verl rows: engine.runtime.syncs' replacements with fewer host reads (what `engine run` uses), "
        "verl's own code, or the replacements with the step's reads at its end (engine.runtime.reads)",
    )
    run.add_argument(
        "--fill",
        type=float,
        default=1.0,
        help="verl rows: response lengths uniform in [FILL, 1] x seq/2; tokens/s counts real tokens",
    )
    run.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="write torch.profiler tables of one extra step after the timed ones (last shape, first "
        "repeat) here",
    )
    run.add_argument(
        "--levers",
        type=lever_names,
        default=["baseline"],
        help="verl rows: one process group per lever (engine.recipes.levers; e.g. baseline,fused,no-reshard,"
        "bf16-sr,fast), each with the settings a recipe with that lever renders",
    )
    run.add_argument(
        "--repeats", type=int, default=1, help="run the whole sequence of configurations this many times"
    )
    run.add_argument("--repeat", type=int, default=1, help=argparse.SUPPRESS)  # the worker's repeat number
    run.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    return parser


def validate_args(args: argparse.Namespace) -> None:
    bad = [m for m in args.modes if m not in MODES] + [k for k in args.kernels if k not in KERNELS]
    if bad:
        raise UserError(f"unknown --modes/--kernels {bad}; choose from {list(MODES)} and {list(KERNELS)}")
    if min(args.gpus, args.steps, args.repeats) < 1 or args.warmup < 0:
        raise UserError("--gpus, --steps and --repeats must be positive (--warmup >= 0)")
    for batch, mbs, seq in shapes_of(args):
        if min(batch, mbs, seq) < 1:
            raise UserError(f"shape {batch}/{mbs}/{seq}: batch, mbs and seq must be positive")
        if batch % mbs:
            raise UserError(f"batch {batch} is not a multiple of mbs {mbs}; make it one")
        if seq < 2:
            raise UserError(f"seq {seq} must be at least 2 (half prompt, half response)")
    if not 0 < args.fill <= 1:
        raise UserError(f"--fill {args.fill} must be in (0, 1]: the shortest response as a share of seq/2")
    if not (args.model / "config.json").is_file():
        raise UserError(
            f"--model {args.model}: no config.json; write one with `python -m engine make-model --out DIR`"
        )


def _bench_rows(path: Path) -> str | None:
    """Rows accumulate in --out across invocations: append only to a file of earlier rows."""
    try:
        lines = path.read_text().splitlines()
        ok = all(isinstance(json.loads(line), dict) for line in lines if line.strip())
    except (OSError, ValueError):
        ok = False
    return None if ok else "it exists and does not hold bench-gpu rows (JSON lines)"


def cli_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    validate_args(args)
    args.out = fsutil.check_out_file(args.out, reuse=_bench_rows)
    if args.profile is not None:
        args.profile = fsutil.check_out_dir(args.profile, "--profile", reuse=lambda _: None)
    rows = run_matrix(args)
    table = Table(title=f"bench-gpu ({args.out})")
    for column in ("run", "kernels", "GPUs", "b/mbs/seq", "result"):
        table.add_column(column)
    for r in rows:
        table.add_row(_run_name(r), r["kernels"], str(r["gpus"]), _shape(r), _cell(r))
    console.print(table)
    md = args.out.with_suffix(".md")
    summary = summary_table(summarize(rows))
    clocked = [(f"{_run_name(r)} {_shape(r)} #{r.get('repeat', 1)}", r.get("phases")) for r in rows]
    fsutil.atomic_write(md, markdown_table(rows) + "\n" + summary + phases_table(clocked))
    console.print(summary)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    errors.entry(cli_main)
