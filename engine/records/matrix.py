"""`python -m engine matrix`: the known-good matrix, from verification cards made from the kept records.

A card says what ran for one recipe on one machine and stack: date, commit, command, versions, and per
stage (smoke, train, control, export) the steps, the gates *replayed now* over the run's own metrics
(so a card follows the current thresholds, and says where the run's recorded verdict differed), the
figures (median step time, peak memory) and the export's checks. Each folder of docs/records/ holds a
`card.yaml` naming what its files do not say (machine, commit, command, which folder is which stage);
`matrix cards --write` turns them into docs/verification/*.json, `matrix` prints the matrix from those,
including what never ran: recipes and devices without a card, fsdp_turbo, NPUs, more than one GPU.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from engine import bounds, fsutil, paths
from engine.checkpoint.layout import ExportDir
from engine.errors import ArgumentParser, UserError
from engine.recipes import loader, models
from engine.run import devices, gates
from engine.run.record import RunRecord
from engine.run.rundir import RunDir

SCHEMA = "qwen35-grpo-engine/verification-card/1"
RECORDS = Path("docs/records")
CARDS = Path("docs/verification")
SOURCE = "card.yaml"
COLUMNS = (
    "recipe",
    "model",
    "hardware",
    "stack",
    "strategy / rollout",
    "date",
    "commit",
    "stages",
    "verdict",
)
COLUMNS += ("record",)
KEY_PACKAGES = ("torch", "vllm", "verl", "transformers", "triton", "flash-linear-attention", "ray")


class Stage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    stage: Literal["smoke", "train", "control", "export"]
    record: str  # the folder under docs/records
    status: Literal["passed", "failed"]
    steps: int | None = None
    recorded_status: str | None = None  # what the run's own run.json said at the time
    gates: dict[str, str] = {}
    figures: dict[str, float | int | str | None] = {}


class Card(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_id: Literal["qwen35-grpo-engine/verification-card/1"] = SCHEMA
    id: str
    recipe: str
    model: str
    device: str
    devices: int
    strategy: str
    rollout: str
    hardware: str
    stack: str
    date: str
    commit: str
    command: str
    versions: dict[str, str]
    stages: list[Stage]
    verdict: Literal["passed", "failed", "partial"]
    not_reached: list[str] = []
    notes: str = ""


def _median(values: list[Any]) -> float | None:
    numbers = [v for v in values if isinstance(v, int | float)]
    return round(statistics.median(numbers), 3) if numbers else None


def _peak(values: list[Any]) -> float | None:
    numbers = [v for v in values if isinstance(v, int | float)]
    return round(max(numbers), 3) if numbers else None


def _run_stage(kind: str, folder: Path, rel: str, fault: str | None) -> tuple[Stage, dict[str, Any]]:
    """A GRPO run's stage: gates replayed on its metrics; for a control, whether its gate caught the
    fault its record names (`fault`: the card's word for records older than the field). A run that did
    not reach its target step fails whatever its gates say."""
    run = RunDir(folder)
    recipe = fsutil.read_yaml(run.recipe, "recipe", "keep recipe.yaml with the record")
    rows = run.read_metrics()
    if not rows:
        raise UserError(f"{folder}: no steps in {run.metrics.name}; a card needs the run's metrics")
    moe = models.lookup(str(recipe["model"]["name"])).moe
    checks = gates.evaluate(rows, str(recipe["cluster"]["device"]), str(recipe["name"]), moe=moe)
    recorded = next((p for p in (run.record, run.failed_record) if p.is_file()), None)
    record = RunRecord.read(recorded, unversioned=True) if recorded else None
    was = record.status if record else None
    finished = max(int(row["step"]) for row in rows) >= int(recipe["trainer"]["total_training_steps"])
    if kind == "control":
        fault = (record and (record.fault or (record.control and record.control.fault))) or fault
        if not fault:
            raise UserError(f"{folder}: its record names no fault; name it in the card (fault: NAME)")
        ok = finished and gates.caught(checks, fault)
    else:
        ok = finished and not gates.failed(checks)
    steps = [row.get("data", {}) for row in rows]
    later = steps[1:] or steps  # step 1 holds compilation and autotuning
    peak = devices.peak_memory_mib(run.gpu_memory)
    figures = {
        "median_step_s": _median([s.get("timing_s/step") for s in later]),
        "trainer_peak_gib": _peak([s.get("actor/perf/max_memory_allocated_gb") for s in steps]),
        "device_peak_mib": max(peak.values()) if peak else None,
        "rollout_probs_corr_min": min(
            (s[gates.PROBS_CORR] for s in steps if isinstance(s.get(gates.PROBS_CORR), int | float)),
            default=None,
        ),
    }
    stage = Stage(
        stage=kind,  # type: ignore[arg-type]
        record=rel,
        status="passed" if ok else "failed",
        steps=len(rows),
        recorded_status=was,
        gates={c.name: c.status for c in checks},
        figures=figures,
    )
    return stage, recipe


def _export_stage(folder: Path, rel: str) -> Stage:
    report = fsutil.read_json(ExportDir(folder).report, "export report", "keep export.json with the record")
    verification = report.get("verification", {})
    structure, logits = verification.get("structure", {}), verification.get("logits") or {}
    same = logits.get("max_abs_diff_same_weights")
    figures = {"keys": structure.get("keys"), "expert_keys": structure.get("expert_keys")}
    figures |= {"dtype": structure.get("dtype"), "logits_max_abs_diff_same_weights": same}
    ok = bool(structure) and (not logits or bounds.at_most(same, logits["atol_same_weights"]))
    return Stage(stage="export", record=rel, status="passed" if ok else "failed", figures=figures)


def _versions(source: dict[str, Any], folder: Path) -> dict[str, str]:
    """Key package versions: a provenance record's, freezes named in the source (later ones win), then
    explicit ones."""
    found: dict[str, str] = {}
    if source.get("provenance"):
        fix = "keep it with the record"
        record = fsutil.read_json(folder / source["provenance"], "provenance record", fix)
        found |= {k.lower(): str(v) for k, v in record["versions"]["installed"].items() if v}
    for name in source.get("freezes", []):
        for line in fsutil.read_text(folder / name, "freeze", "keep it with the record").splitlines():
            package, _, version = line.partition("==")
            found[package.strip().lower()] = version.strip()
    found |= {k: str(v) for k, v in (source.get("versions") or {}).items()}
    return {k: found[k] for k in KEY_PACKAGES if k in found}


def card(folder: Path, source: dict[str, Any], records: Path = RECORDS) -> Card:
    """One card from a record folder and one entry of its card.yaml."""
    stages, recipe = [], None
    for kind in ("smoke", "train", "control"):
        if source.get(kind):
            stage, recipe = _run_stage(
                kind,
                folder / source[kind],
                f"{folder.relative_to(records)}/{source[kind]}",
                source.get("fault"),
            )
            stages.append(stage)
    if source.get("export"):
        stages.append(
            _export_stage(folder / source["export"], f"{folder.relative_to(records)}/{source['export']}")
        )
    if recipe is None:
        raise UserError(f"{folder / SOURCE}: name at least one run (smoke, train or control)")
    failed = [s.stage for s in stages if s.status == "failed"]
    not_reached = list(source.get("not_reached", []))
    cluster = recipe["cluster"]
    return Card(
        id=f"{folder.name}-{recipe['name']}",
        recipe=str(recipe["name"]),
        model=str(recipe["model"]["name"]),
        device=str(cluster["device"]),
        devices=int(cluster["nodes"]) * int(cluster["devices_per_node"]),
        strategy=str(recipe["actor"]["strategy"]),
        rollout=str(recipe["rollout"]["name"]),
        hardware=str(source["hardware"]),
        stack=str(source["stack"]),
        date=str(source["date"]),
        commit=str(source["commit"]),
        command=str(source["command"]),
        versions=_versions(source, folder),
        stages=stages,
        verdict="failed" if failed else ("partial" if not_reached else "passed"),
        not_reached=not_reached,
        notes=str(source.get("notes", "")),
    )


def cards_from_records(records: Path = RECORDS) -> list[Card]:
    found = []
    for source_file in sorted(records.glob(f"*/{SOURCE}")):
        entries = fsutil.read_yaml(source_file, "card source", "see engine/records/matrix.py")
        for entry in entries if isinstance(entries, list) else [entries]:
            found.append(card(source_file.parent, entry, records))
    return found


def read_cards(folder: Path = CARDS) -> list[Card]:
    found = []
    for path in sorted(folder.glob("*.json")):
        data = fsutil.read_json(
            path, "verification card", "regenerate: python -m engine matrix cards --write"
        )
        if data.get("schema_id") != SCHEMA:
            raise UserError(f"{path}: not a verification card of this engine ({SCHEMA})")
        found.append(Card.model_validate(data))
    return found


def without_card(cards: list[Card]) -> list[str]:
    """Recipe x device pairs no kept record shows (the CPU ones run in every CI run, unrecorded)."""
    seen = {(c.recipe, c.device) for c in cards}
    pairs = [(n, d) for n, _ in loader.list_recipes() for d in loader.load(n).devices if (n, d) not in seen]
    return [
        f"{name} on {device}" + (" (in every CI run)" if device == "cpu" else "") for name, device in pairs
    ]


def never_ran(cards: list[Card]) -> list[str]:
    """What no record has at all: the upstream backend, the other accelerator, more than one GPU."""
    lines = []
    if not any(c.strategy == "fsdp_turbo" for c in cards):
        lines.append(
            "fsdp_turbo: FSDPTurbo is not installable where the records were made, all cards ran FSDP2"
        )
    if not any(c.device == "npu" for c in cards):
        lines.append("any NPU run")
    if not any(c.devices > 1 for c in cards):
        lines.append("more than one GPU")
    return lines


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def stages_line(c: Card, steps: bool = False) -> str:
    done = [
        f"{s.stage} {s.status}" + (f" ({_steps(s.steps)})" if steps and s.steps else "") for s in c.stages
    ]
    return ", ".join(done + [f"not reached: {n}" for n in c.not_reached])


def markdown(cards: list[Card]) -> str:
    """The matrix as a page (docs/reference/verification.md)."""
    lines = [
        "# Known-good matrix",
        "",
        "Generated by `python -m engine matrix --markdown` from the cards in docs/verification/, which",
        "`python -m engine matrix cards --write` makes from docs/records/*/card.yaml and the records beside",
        "them; the gates are replayed over each run's metrics with the current thresholds.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for c in sorted(cards, key=lambda c: (c.recipe, c.date)):
        folder = c.stages[0].record.split("/")[0]
        cells = [
            f"`{c.recipe}`",
            c.model,
            c.hardware,
            c.stack,
            f"{c.strategy} / {c.rollout}",
            c.date,
            c.commit,
        ]
        cells += [stages_line(c, steps=True), f"**{c.verdict}**", f"[{folder}](../records/{folder}/)"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Never ran", *(f"- {line}" for line in never_ran(cards))]
    lines += ["", "## No verification record", *(f"- {line}" for line in without_card(cards))]
    return "\n".join(lines) + "\n"


def cli_main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m engine matrix", description=__doc__.splitlines()[0])
    parser.add_argument("action", nargs="?", choices=["show", "cards"], default="show")
    parser.add_argument("--markdown", action="store_true", help="print the matrix as markdown (docs)")
    parser.add_argument("--write", action="store_true", help="cards: write docs/verification/*.json")
    parser.add_argument("--root", type=Path, default=paths.checkout(), help="the checkout holding docs/")
    args = parser.parse_args(argv)
    if args.root is None or not (args.root / RECORDS).is_dir():
        raise UserError("the records are in a checkout's docs/records: run from one, or pass --root CHECKOUT")
    if args.action == "cards":
        for c in cards_from_records(args.root / RECORDS):
            if args.write:
                fsutil.atomic_write(
                    args.root / CARDS / f"{c.id}.json", json.dumps(c.model_dump(), indent=2) + "\n"
                )
            print(f"{c.id}: {c.verdict}")
        return 0
    cards = read_cards(args.root / CARDS)
    if args.markdown:
        print(markdown(cards), end="")
        return 0
    for c in sorted(cards, key=lambda c: (c.recipe, c.date)):
        where = f"{c.hardware} ({c.stack}, {c.strategy}/{c.rollout}) {c.date} {c.commit}"
        print(f"{c.verdict:<8} {c.recipe:<24} {where}: {stages_line(c)}")
    print("never ran: " + "; ".join(never_ran(cards)))
    print("no verification record: " + "; ".join(without_card(cards)))
    return 0
