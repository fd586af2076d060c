"""`python -m engine export CHECKPOINT --out DIR`: verified safetensors with the run's model card.

The merge and every check are engine.checkpoint.export's; this adds what only the records know: the
model card (engine.records.model_card) names the run directory around the checkpoint, its recipe, the
commit, and quotes a provenance record (`--record`) only when that record still verifies and names this
checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine import fsutil, paths
from engine.checkpoint import layout, merge
from engine.checkpoint.export import DTYPES, check_out, export, parse_size
from engine.errors import ArgumentParser, UserError
from engine.records import origin, provenance
from engine.records.model_card import model_card
from engine.run.rundir import RunDir


def quoted_record(path: Path, files: list[Path]) -> dict[str, Any]:
    """The record the model card quotes (git commit, image, run times) must be about this checkpoint and
    still true: it verifies (every file it names unchanged; an earlier export it names may be gone) and
    names the checkpoint's rank files among its outputs."""
    if not path.is_file():
        raise UserError(
            f"--record {path}: no such file; pass the provenance.json of the run, or leave it out"
        )
    rec = provenance.read_record(path)
    changed = provenance.verify(path, skip_roles=("export",))
    if changed:
        raise UserError(
            f"--record {path}: {len(changed)} file(s) it names changed since it was written "
            f"({'; '.join(changed[:3])}): the card would quote a record of other files; "
            "pass one `python -m engine provenance verify` accepts, or leave --record out"
        )
    named = {provenance.entry_path(path, e).resolve() for e in rec["outputs"] if e["role"] == "checkpoint"}
    if not all(f.resolve() in named for f in files):
        raise UserError(
            f"--record {path}: it does not name {files[0].parent} among its checkpoints: pass the record of "
            "the run this checkpoint belongs to, or leave --record out"
        )
    return rec


def run_around(actor: Path) -> RunDir | None:
    """The run directory whose checkpoints/ holds this actor (RUN/checkpoints/global_step_N/actor)."""
    root = layout.checkpoint_root(actor)
    run = RunDir(root.parent)
    return run if run.checkpoints == root and run.recipe.is_file() else None


def card_for(actor: Path, record: dict[str, Any] | None) -> Any:
    """The card renderer `export` calls with its report: the run's recipe, the commit (the record's, else
    the checkout's) and the record."""
    run = run_around(actor)
    recipe = fsutil.read_yaml(run.recipe, "recipe", "re-run the launch") if run else None
    git = (record or {}).get("git") or origin.git_info(paths.checkout())
    context = {"run_dir": run.path, "recipe": recipe if isinstance(recipe, dict) else {}} if run else None
    return lambda report: model_card(report, context, git, record)


def export_main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m engine export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="checkpoint root, global_step_N or its actor/ dir")
    parser.add_argument("--out", required=True, help="new directory for the export")
    parser.add_argument(
        "--method",
        choices=["auto", "verl", "dtensor"],
        default="auto",
        help="auto: verl.model_merger for fsdp / ddp,fsdp meshes, the DTensor merge otherwise",
    )
    parser.add_argument(
        "--dtype", choices=["auto", *DTYPES], default="auto", help="export dtype (auto: bf16)"
    )
    parser.add_argument(
        "--shard-size", default="2GiB", help="split safetensors above this size (with an index)"
    )
    parser.add_argument("--verify-logits", action="store_true", help="also compare logits (small models)")
    parser.add_argument("--record", help="provenance record whose summary goes into the model card")
    args = parser.parse_args(argv)
    shard_size = parse_size(args.shard_size)
    check_out(args.out)  # a mistyped --out fails before a record is hashed
    actor = merge.resolve_actor_dir(args.checkpoint)
    record = quoted_record(Path(args.record), merge.rank_files(actor)) if args.record else None
    report = export(
        args.checkpoint,
        args.out,
        args.method,
        args.dtype,
        shard_size,
        args.verify_logits,
        card=card_for(actor, record),
    )
    structure = report["verification"]["structure"]
    print(
        f"export: {args.out} ({report['method']}, {structure['keys']} keys, {structure['dtype']}, "
        f"{len(report['files'])} files hashed, {report['seconds']} s)"
    )
    logits = report["verification"].get("logits")
    if logits:
        line = f"export: logits max |diff| {logits['max_abs_diff_same_weights']:.2e} against the checkpoint"
        line += f" rounded, {logits['max_rel_diff_full_precision']:.2%} relative against its fp32 weights"
        if "routing_changed_share" in logits:
            line += f" (not gated: MoE, {logits['routing_changed_share']:.1%} of router choices differ)"
        print(line)
    return 0
