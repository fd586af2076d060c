"""Run records: what produced a run, written as JSON and as a Workflow Run RO-Crate, and checked later.

`provenance write RUN_DIR` reads what `engine run` left there (run.json, recipe.yaml, overrides.txt,
metrics.jsonl, checkpoints/) and adds what verl never records: git commit and dirty flag, container
image, pins against installed versions, hardware, allowlisted environment and the sha256 of every
input, checkpoint and exported file. `provenance verify RECORD` re-hashes all of it; `rerun RECORD`
launches the recorded recipe again and compares step metrics. Nothing that looks like a credential is
written: `redact_env` and `scrub` are the filters every writer of the project passes through.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from engine import fsutil, paths
from engine.errors import ArgumentParser, UserError
from engine.hashing import sha256_file
from engine.recipes.plan import overrides_digest
from engine.records import chain, origin
from engine.records.rocrate import ro_crate
from engine.run import devices, rundir
from engine.run.record import RunRecord
from engine.run.redact import redact_env, scrub, scrub_obj
from engine.run.rundir import RunDir

SCHEMA = "qwen35-grpo-engine/provenance/1"


def _rel(path: Path, base: Path) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path.resolve())


def _file_entries(entries_of: list[tuple[Path, str]], base: Path, seen: set[Path]) -> list[dict[str, Any]]:
    """Hash each file once (`seen` spans inputs, outputs and run files; the first role wins)."""
    from rich.progress import Progress

    files = []
    for p, role in entries_of:
        for f in chain.files_of([p]):
            if f.resolve() not in seen:
                seen.add(f.resolve())
                files.append((f, role))
    entries = []
    with Progress(transient=True) as progress:
        task = progress.add_task("hashing", total=sum(f.stat().st_size for f, _ in files) or 1)
        for f, role in files:
            entries.append(
                {"path": _rel(f, base), "role": role, "bytes": f.stat().st_size, "sha256": sha256_file(f)}
            )
            progress.advance(task, f.stat().st_size)
    return entries


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """verl's file-logger rows (torn lines skipped, as `engine run` reads them), numbers only."""
    return [
        {
            "step": int(row["step"]),
            "data": {k: v for k, v in row.get("data", {}).items() if isinstance(v, (int, float))},
        }
        for row in rundir.read_metrics(path)
    ]


def build_record(
    run_dir: Path, exports: list[Path], data: list[Path], repo: Path | None, snakefile: Path | None = None
) -> dict[str, Any]:
    """Everything the record says about one run directory (`snakefile`: it ran in the Snakemake chain)."""
    fix = "the run directory must hold what `python -m engine run` wrote there"
    files = RunDir(run_dir)
    run = RunRecord.read(files.record)
    recipe_file = files.recipe
    resolved = fsutil.read_yaml(recipe_file, "resolved recipe", fix) if recipe_file.is_file() else {}
    if not isinstance(resolved, dict):
        raise UserError(f"resolved recipe {recipe_file}: not a mapping; {fix}")
    overrides_file = files.overrides
    overrides = (
        fsutil.read_text(overrides_file, "overrides", fix).split("\n") if overrides_file.is_file() else []
    )
    overrides = [o for o in overrides if o.strip()]
    inputs: list[tuple[Path, str]] = [(p, "data") for p in data]
    for key in ("train_files", "val_files"):
        items = resolved.get("data", {}).get(key)
        for item in items if isinstance(items, list) else [items]:
            if item and Path(item).is_file():  # relative to where the run was launched (the working dir)
                inputs.append((Path(item), "data"))
    model_path = resolved.get("model", {}).get("path")
    if model_path and (Path(model_path) / "config.json").is_file():
        inputs.append((Path(model_path) / "config.json", "model_config"))
    outputs = [(files.checkpoints, "checkpoint")] if files.checkpoints.is_dir() else []
    outputs += [(e, "export") for e in exports]
    steps: list[dict[str, Any]] = []
    if snakefile is not None:
        configs = [p for p, role in inputs if role == "model_config"]
        chained, steps = chain.steps(run_dir, exports, snakefile, run, configs)
        inputs = chained + inputs
    seen: set[Path] = set()
    hashed = _file_entries(inputs, run_dir, seen), _file_entries(outputs, run_dir, seen)
    manifest = chain.ChainDir(run_dir.parent).manifest if snakefile is not None else None
    chain.check_written_as([*hashed[0], *hashed[1]], run_dir, exports, manifest)
    rows = read_metrics(files.metrics)
    try:
        snakemake = metadata.version("snakemake")
    except metadata.PackageNotFoundError:
        snakemake = None
    record = {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "run_dir": ".",
        "git": origin.git_info(repo),
        "recipe": {
            "name": resolved.get("name") or run.recipe,
            "file": rundir.RECIPE,
            "resolved": resolved,
            "device": run.device,
        },
        "overrides": overrides,
        "overrides_sha256": overrides_digest(overrides),
        "command": run.command,
        "start": run.start,
        "end": run.end,
        "exit_code": run.exit_code,
        "status": run.status,
        # the record an `engine rerun` repeated, and what of it had changed
        "rerun": run.rerun.model_dump() if run.rerun else None,
        "container": origin.container_info(),
        "versions": origin.versions(run.device),
        # the machine the launch recorded; this one for a record older than that field
        "hardware": run.hardware or devices.hardware(),
        "environment": redact_env(os.environ) | redact_env(run.env),
        "snakemake": snakemake,
        "python": sys.version.split()[0],
        "agent": origin.agent(repo),
        "publisher": origin.publisher(),
        "inputs": hashed[0],
        "outputs": hashed[1],
        "run_files": _file_entries(
            [(run_dir / n, "run") for n in rundir.FILES if (run_dir / n).is_file()], run_dir, seen
        ),
        "metrics": {
            "file": rundir.METRICS,
            "steps": len(rows),
            "last": rows[-1]["data"] if rows else {},
            "per_step": rows,
        },
    }
    if snakefile is not None:
        rel = {"object", "result"}
        record["workflow"] = {
            "engine": {"name": "snakemake", "version": snakemake},
            "snakefile": _rel(snakefile, run_dir),
            "steps": [
                {k: [_rel(p, run_dir) for p in v] if k in rel else v for k, v in s.items()} for s in steps
            ],
        }
    return scrub_obj(record)


def _not_poorer(path: Path, record: dict[str, Any]) -> str | None:
    """A record is replaced only by one that names at least as many inputs and outputs (a mistyped
    --export must not turn ten recorded export files into none)."""
    try:
        old = json.loads(path.read_text())
        counts = {key: len(old[key]) for key in ("inputs", "outputs")}
    except (OSError, ValueError, KeyError, TypeError):
        return "it is not a readable run record; --force replaces it"
    for key, before in counts.items():
        if len(record[key]) < before:
            return (
                f"it records {before} {key}, the new record {len(record[key])} (a missing --export or "
                "--data?); pass them again, or --force to replace it with the poorer one"
            )
    return None


def write(
    run_dir: Path,
    exports: list[Path] = (),  # type: ignore[assignment]
    data: list[Path] = (),  # type: ignore[assignment]
    repo: Path | None = None,
    force: bool = False,
    workflow: Path | None = None,
) -> Path:
    """provenance.json, ro-crate-metadata.json and the crate's README.md in RUN_DIR."""
    run_dir = run_dir.resolve()
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist: pass the --out of `python -m engine run`")
    if not RunDir(run_dir).record.is_file():
        raise UserError(f"{run_dir} is not a run directory (no run.json): pass the --out of `engine run`")
    for flag, given in (("--export", exports), ("--data", data)):
        for path in given:
            if not Path(path).exists():
                raise UserError(f"{flag} {path}: no such file or directory; fix the path or leave it out")
    repo = repo or paths.checkout()
    files = RunDir(run_dir)
    for path in (files.provenance, files.crate, files.crate_readme):
        fsutil.check_out_file(path, "record", reuse=lambda _: None)
    snakefile = Path(workflow).resolve() if workflow else None
    record = build_record(run_dir, [Path(e) for e in exports], [Path(d) for d in data], repo, snakefile)
    target = files.provenance
    if target.exists() and not force:
        fsutil.check_out_file(target, "record", reuse=lambda path: _not_poorer(path, record))
    crate = json.dumps(scrub_obj(ro_crate(record)), indent=2) + "\n"  # rendered before anything is written
    readme = scrub(crate_readme(record))
    fsutil.atomic_write(target, json.dumps(record, indent=2, sort_keys=True) + "\n")
    fsutil.atomic_write(files.crate, crate)
    fsutil.atomic_write(files.crate_readme, readme)
    return target


ENTRY_KEYS = ("path", "role", "sha256")


def read_record(record_path: Path) -> dict[str, Any]:
    """A provenance record, checked for the keys verify and rerun read (UserError naming the file)."""
    fix = "pass a provenance.json written by `python -m engine provenance write`"
    record = fsutil.read_json(record_path, "record", fix)
    if record.get("schema") != SCHEMA:
        raise UserError(f"{record_path}: schema {record.get('schema')!r} is not {SCHEMA}: not a run record")
    for key in ("inputs", "outputs", "run_files"):
        entries = record.get(key)
        if not isinstance(entries, list) or not all(
            isinstance(e, dict) and all(isinstance(e.get(k), str) for k in ENTRY_KEYS) for e in entries
        ):
            raise UserError(f"{record_path}: '{key}' is not a list of {{path, role, sha256}}; {fix}")
    return record


def entry_path(record_path: Path, entry: dict[str, Any]) -> Path:
    """Where a file the record names is: relative to the record's directory (an absolute path as is)."""
    return record_path.resolve().parent / entry["path"]  # pathlib: an absolute right side replaces it


def verify(record_path: Path, skip_roles: tuple[str, ...] = ()) -> list[str]:
    """Re-hash every file a record names (but those of `skip_roles`); one line per changed or missing one."""
    record = read_record(record_path)
    problems = []
    for entry in record["inputs"] + record["outputs"] + record["run_files"]:
        if entry["role"] in skip_roles:
            continue
        path = entry_path(record_path, entry)
        if not path.is_file():
            problems.append(f"missing: {entry['path']} ({entry['role']})")
        elif sha256_file(path) != entry["sha256"]:
            problems.append(f"changed: {entry['path']} ({entry['role']}) sha256 differs from the record")
    return problems


def cli_main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m engine provenance", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    w = sub.add_parser("write", help="write RUN_DIR/provenance.json and RUN_DIR/ro-crate-metadata.json")
    w.add_argument("run_dir")
    w.add_argument("--export", action="append", default=[], help="exported model dir to hash (repeatable)")
    w.add_argument("--data", action="append", default=[], help="extra input file to hash (repeatable)")
    w.add_argument("--force", action="store_true", help="replace a record that names more files")
    w.add_argument(
        "--workflow",
        help="the Snakefile that ran RUN_DIR as its train step: record every step of the chain "
        "(data/, smoke/, RUN_DIR, --export) as a Provenance Run Crate",
    )
    v = sub.add_parser("verify", help="re-hash what a record names; exit 1 on any mismatch")
    v.add_argument("record")
    args = parser.parse_args(argv)
    if args.action == "write":
        exports, data = [Path(e) for e in args.export], [Path(d) for d in args.data]
        workflow = Path(args.workflow) if args.workflow else None
        path = write(Path(args.run_dir), exports, data, force=args.force, workflow=workflow)
        record = json.loads(path.read_text())
        n = len(record["inputs"]) + len(record["outputs"]) + len(record["run_files"])
        print(f"provenance: {path} ({n} files hashed, git {str(record['git'].get('commit'))[:12]})")
        return 0
    record_path = Path(args.record)
    if record_path.is_dir():
        record_path = RunDir(record_path).provenance
    if not record_path.is_file():
        raise UserError(f"record {record_path} not found: pass a provenance.json or its run directory")
    problems = verify(record_path)
    for line in problems:
        print(f"provenance: {line}", file=sys.stderr)
    print(f"provenance: {'MISMATCH' if problems else 'ok'} ({record_path})")
    return 1 if problems else 0


def crate_readme(record: dict[str, Any]) -> str:
    """README.md of the crate: what the record is and the commands that check it."""
    chain = record.get("workflow")
    steps = " -> ".join(s["name"] for s in chain["steps"]) if chain else "one `engine run`"
    return "\n".join(
        [
            f"# Run record of {record['recipe']['name']}",
            "",
            f"GRPO run of recipe `{record['recipe']['name']}` ({record.get('status')}, "
            f"{record.get('start')} -> {record.get('end')}), git {record['git'].get('commit')} "
            f"(dirty: {record['git'].get('dirty')}); steps: {steps}.",
            "",
            f"- `provenance.json`: the full record (schema `{record['schema']}`, docs/reference/records.md)",
            "- `ro-crate-metadata.json`: the same as an RO-Crate 1.1 ("
            + ("Provenance" if chain else "Workflow")
            + " Run Crate 0.5)",
            "- check every hashed file: `python -m engine provenance verify .`",
            "- rerun and compare step metrics: `python -m engine rerun . --out NEW_DIR`",
            "",
        ]
    )
