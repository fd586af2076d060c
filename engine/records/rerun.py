"""`python -m engine rerun RECORD --out DIR`: launch a recorded run again and compare its step metrics.

The record names the resolved recipe it ran (kept in its run directory), so the rerun is that recipe on
that device in a fresh directory; what must reproduce is the per-step metrics the record holds. The
record is verified first (every file it names re-hashed, as `provenance verify` does): a recipe edited
after the record was written is not the recorded recipe, so a record that does not verify is refused,
unless `--allow-changed` says to rerun the files as they are now, which the new run's run.json keeps.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from engine import bounds, fsutil, procs
from engine.errors import ArgumentParser, UserError
from engine.records.provenance import read_metrics, read_record, verify
from engine.run.rundir import RunDir


def compare_metrics(
    recorded: list[dict], fresh: list[dict], keys: list[str], rtol: float, atol: float = 0.0
) -> list[str]:
    """Step metrics of a rerun against the record (same steps, each key within atol + rtol * |value|)."""
    problems = []
    if [r["step"] for r in recorded] != [r["step"] for r in fresh]:
        return [f"steps {[r['step'] for r in fresh]} != recorded {[r['step'] for r in recorded]}"]
    for old, new in zip(recorded, fresh, strict=True):
        for key in keys or sorted(set(old["data"]) & set(new["data"])):
            a, b = old["data"].get(key), new["data"].get(key)
            if a is None or b is None:
                problems.append(f"step {old['step']} {key}: missing ({a} vs {b})")
            elif not bounds.close(a, b, rtol, atol):  # NaN or inf on either side is no reproduction
                problems.append(f"step {old['step']} {key}: {b} != recorded {a}")
    return problems


REPRODUCIBLE_KEYS = [
    "critic/score/mean",
    "critic/rewards/mean",
    "response_length/mean",
    "actor/pg_loss",
    "actor/grad_norm",
]


def rerun_main(argv: list[str]) -> int:
    """`python -m engine rerun RECORD --out DIR`: launch the recorded recipe and compare step metrics."""
    parser = ArgumentParser(prog="python -m engine rerun", description=rerun_main.__doc__)
    parser.add_argument("record", help="provenance.json (or its run directory)")
    parser.add_argument("--out", required=True, help="new run directory")
    # CPU reruns sample the same tokens, but the async rollout may order the batch differently, so float32
    # sums differ slightly (docs/reference/gates.md): grad norms by ~2e-4 relative, GRPO's zero-mean pg_loss
    # (about 1e-8) by its whole size.
    parser.add_argument(
        "--rtol", type=bounds.finite_float, default=1e-3, help="relative tolerance per metric"
    )
    parser.add_argument(
        "--atol", type=bounds.finite_float, default=1e-6, help="absolute tolerance per metric"
    )
    parser.add_argument(
        "--keys", nargs="*", default=REPRODUCIBLE_KEYS, help="metrics to compare (none: all shared)"
    )
    parser.add_argument("--dry-run", action="store_true", help="verify the record, print the command only")
    parser.add_argument(
        "--allow-changed",
        action="store_true",
        help="rerun a record that no longer verifies, with its files as they are now (kept in run.json)",
    )
    args = parser.parse_args(argv)
    record_path = RunDir(Path(args.record)).provenance if Path(args.record).is_dir() else Path(args.record)
    if not record_path.is_file():
        raise UserError(f"record {record_path} not found: pass a provenance.json or its run directory")
    record = read_record(record_path)
    recipe = record.get("recipe")
    per_step = record.get("metrics", {}).get("per_step") if isinstance(record.get("metrics"), dict) else None
    if (
        not isinstance(recipe, dict)
        or not isinstance(recipe.get("file"), str)
        or not isinstance(per_step, list)
    ):
        raise UserError(f"{record_path}: no recipe.file or metrics.per_step; not a record of `engine run`")
    recipe_file = record_path.parent / recipe["file"]
    if not recipe_file.is_file():
        raise UserError(f"{recipe_file} is missing: the record's run directory must keep recipe.yaml")
    # a rerun needs a fresh directory: verl would resume from a checkpoint left there
    out = fsutil.check_out_dir(args.out).resolve()
    changed = verify(record_path)
    if changed and not args.allow_changed:
        raise UserError(
            f"record {record_path}: {len(changed)} file(s) it names changed since it was written "
            f"({'; '.join(changed[:4])}{'; ...' if len(changed) > 4 else ''}): not the recorded run; "
            "`python -m engine provenance verify` lists them, --allow-changed reruns them as they are now"
        )
    for line in changed:
        print(f"rerun: {line} (--allow-changed: rerun as it is now)", file=sys.stderr)
    cmd = [sys.executable, "-m", "engine", "run", str(recipe_file), "--out", str(out)]
    if recipe.get("device"):
        cmd += ["--device", str(recipe["device"])]
    cmd += ["--rerun-of", str(record_path.resolve())]
    cmd += [arg for line in changed for arg in ("--rerun-changed", line)]
    print(" ".join(cmd))
    if args.dry_run:
        return 0
    # the run goes with this process, however it ends (its verl with it: engine.procs)
    code = subprocess.run(cmd, check=False, preexec_fn=procs.dies_with_this_process()).returncode
    if code != 0:
        print(f"rerun: the run exited {code}", file=sys.stderr)
        return code
    problems = compare_metrics(per_step, read_metrics(RunDir(out).metrics), args.keys, args.rtol, args.atol)
    for line in problems:
        print(f"rerun: {line}", file=sys.stderr)
    print(f"rerun: {'metrics differ' if problems else 'step metrics reproduced'} ({out})")
    return 1 if problems else 0
