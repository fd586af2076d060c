"""`python -m benchmarks.compare`: a bench-gpu run against the last regression baseline.

A baseline (benchmarks/baselines/*.json) is the summary of one bench-gpu run on a named machine:
commit, stack, machine, command, and per configuration (benchmarks.gpu_bench.CONFIG_KEYS) the median
tokens/s over its repeats with min and max, and the largest peak memory. `record` writes one from a
run's rows (the seeded baselines are `record` over the kept records in docs/records/); the default
action compares a new run's rows with the newest baseline that measured each configuration and says
which figure moved: tokens/s by more than --throughput (default 5%) or peak memory by more than
--memory (default 1%). Exit 1 when a figure regressed (slower, or more memory), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.gpu_bench import CONFIG_KEYS, DEFAULTED_KEYS, config_key, summarize
from engine import bounds, errors, fsutil
from engine.errors import ArgumentParser, UserError
from engine.recipes import levers

BASELINES = Path(__file__).parent / "baselines"
SCHEMA = "qwen35-grpo-engine/bench-baseline/1"
STACK_KEYS = ("device", "torch", "transformers", "verl", "kernel_detail")


def read_rows(path: Path, model: str | None = None) -> list[dict[str, Any]]:
    """bench-gpu rows (JSON lines); rows from before the levers existed ran verl's defaults, rows from
    before the model tag get `model` (benchmarks.gpu_bench.model_tag of the model they measured)."""
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as err:
        raise UserError(
            f"{path}: not bench-gpu rows (JSON lines): {err}; pass the --out of bench-gpu"
        ) from None
    for row in rows:
        row.setdefault("levers", "baseline")
        if model is not None:
            row.setdefault("model", model)
    return rows


def key_of(row: dict[str, Any]) -> tuple:
    """A row's configuration (benchmarks.gpu_bench.config_key): a row at a DEFAULTED_KEYS default, e.g.
    `host_syncs` lean (what `engine run` does), matches the baselines recorded before that field existed;
    levers compare by what they set, so a bundle's row (`fast-text-bf16`) meets the baseline recorded
    under its parts' names."""
    return config_key(row | {"levers": levers.canonical(str(row.get("levers", "baseline")))})


def make_baseline(rows: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """One machine's figures: rows measured on several devices are refused (a baseline names one)."""
    ok = [r for r in rows if "error" not in r]
    devices = sorted({str(r.get("device")) for r in ok})
    if len(devices) > 1:
        raise UserError(f"rows measured on {', '.join(devices)}: record each device's rows apart")
    stack = {k: ok[0].get(k) for k in STACK_KEYS} if ok else {}
    return {"schema": SCHEMA, **meta, "stack": stack, "rows": [s for s in summarize(rows) if s["repeats"]]}


def load_baselines(paths: list[Path]) -> list[dict[str, Any]]:
    """Oldest first (by date, then name): the last one that measured a configuration is its baseline."""
    docs = []
    for path in paths:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise UserError(
                f"--baseline {path}: unreadable ({err}); pass a file `compare record` wrote"
            ) from None
        if doc.get("schema") != SCHEMA:
            raise UserError(f"--baseline {path}: schema {doc.get('schema')!r}, expected {SCHEMA!r}")
        docs.append(doc | {"file": path.name})
    return sorted(docs, key=lambda d: (d["date"], d["file"]))


def compare(
    rows: list[dict[str, Any]], baselines: list[dict[str, Any]], throughput: float, memory: float
) -> list[dict[str, Any]]:
    """One line per figure of each configuration of the new run: baseline, new, change, verdict."""
    latest: dict[tuple, tuple[dict, dict]] = {}  # (device, configuration) -> its newest baseline
    for doc in baselines:
        for base in doc["rows"]:
            latest[(doc["stack"].get("device"), key_of(base))] = (doc, base)
    devices = {key_of(row): row.get("device") for row in rows if "error" not in row}
    lines = []
    for new in summarize(rows):
        keys = (*CONFIG_KEYS, *DEFAULTED_KEYS)
        name = " ".join(f"{k}={new[k]}" for k in keys if new.get(k) is not None)
        if not new["repeats"]:
            lines.append({"config": name, "figure": "run", "verdict": "failed", "regression": True})
            continue
        mine = (devices.get(key_of(new)), key_of(new))
        if mine not in latest:  # a figure of another GPU is no baseline: say where it was measured
            elsewhere = sorted({str(d) for d, key in latest if key == mine[1]})
            lines.append({"config": name, "figure": "all", "verdict": "no baseline", "regression": False})
            if elsewhere:
                lines[-1]["note"] = f"on {mine[0]}; measured on {', '.join(elsewhere)} only"
            continue
        doc, base = latest[mine]
        for figure, tolerance, worse in (("tokens_per_s", throughput, -1), ("peak_alloc_gib", memory, 1)):
            was, now = bounds.finite(base.get(figure)), bounds.finite(new.get(figure))
            if now is None or not was:  # a NaN figure regressed; a zero baseline (CPU peak) has no ratio
                verdict = "regressed" if now is None else "no baseline"
                lines.append({"config": name, "figure": figure, "baseline": was, "new": new.get(figure)})
                lines[-1] |= {"verdict": verdict, "regression": now is None}
                continue
            change = now / was - 1
            moved = abs(change) > tolerance
            regression = moved and change * worse > 0
            verdict = ("regressed" if regression else "improved") if moved else "within"
            lines.append(
                {"config": name, "figure": figure, "baseline": base[figure], "new": new[figure]}
                | {"change": round(change, 4), "tolerance": tolerance, "verdict": verdict}
                | {
                    "regression": regression,
                    "baseline_file": doc["file"],
                    "baseline_spread": base.get("spread"),
                }
            )
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action")
    rec = sub.add_parser("record", help="write a baseline from a bench-gpu run's rows")
    rec.add_argument("rows", type=Path, nargs="+", help="bench-gpu --out files (repeats may be in several)")
    rec.add_argument("--out", type=Path, required=True, help="benchmarks/baselines/NAME.json")
    for field in ("date", "commit", "machine", "command", "source"):
        rec.add_argument(f"--{field}", required=field != "source")
    rec.add_argument("--model", default=None, help="model tag of rows that lack one (older records)")
    return parser


def compare_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.splitlines()[0])
    parser.add_argument("rows", type=Path, help="the new run's bench-gpu --out (JSON lines)")
    parser.add_argument(
        "--baseline",
        type=Path,
        action="append",
        help="baseline file(s); default: benchmarks/baselines/*.json",
    )
    parser.add_argument("--model", default=None, help="model tag of rows that lack one (older records)")
    parser.add_argument("--throughput", type=float, default=0.05, help="tokens/s tolerance (relative)")
    parser.add_argument("--memory", type=float, default=0.01, help="peak memory tolerance (relative)")
    parser.add_argument("--json", type=Path, default=None, help="also write the comparison here")
    return parser


def cli_main(argv: list[str]) -> int:
    if argv[:1] == ["record"]:
        args = build_parser().parse_args(argv)
        rows = [row for path in args.rows for row in read_rows(path, args.model)]
        meta = {k: getattr(args, k) for k in ("date", "commit", "machine", "command", "source")}
        out = fsutil.check_out_file(args.out)  # a baseline is never rewritten
        fsutil.atomic_write(out, json.dumps(make_baseline(rows, meta), indent=1) + "\n")
        return 0
    args = compare_parser().parse_args(argv)
    if min(args.throughput, args.memory) < 0:
        raise UserError("--throughput and --memory are relative tolerances >= 0, e.g. 0.05")
    baselines = load_baselines(args.baseline or sorted(BASELINES.glob("*.json")))
    lines = compare(read_rows(args.rows, args.model), baselines, args.throughput, args.memory)
    for line in lines:
        figures = f"({line['note']})" if "note" in line else ""
        if "change" in line:
            figures = f"{line['baseline']:,} -> {line['new']:,} ({100 * line['change']:+.1f}%, "
            figures += f"tolerance {100 * line['tolerance']:g}%, {line['baseline_file']}"
            spread = line["baseline_spread"] if line["figure"] == "tokens_per_s" else None
            figures += f", baseline spread {100 * spread:.1f}%)" if spread is not None else ")"
        print(f"{line['verdict']:<11} {line['figure']:<15} {line['config']} {figures}")
    if args.json is not None:
        fsutil.atomic_write(fsutil.check_out_file(args.json), json.dumps(lines, indent=1) + "\n")
    regressed = [line for line in lines if line["regression"]]
    print(f"{len(regressed)} regression(s) in {len(lines)} figure(s)")
    return 1 if regressed else 0


if __name__ == "__main__":
    errors.entry(cli_main)
