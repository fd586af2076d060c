"""The chain of one recipe's runs under results/<recipe>/, named once, and what a record says of it.

The workflow's rules write the chain (docs/guide/workflow.md): data/ (prepare_data), smoke/, train/ (the run
directory), export/, control/, report/, logs/. `ChainDir` names every path of it, for the rules and for
the record. `provenance write RUN_DIR --workflow SNAKEFILE` records RUN_DIR as the train step of its chain
and the --export directories as its export steps; the RO-Crate turns the steps into a Provenance Run Crate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from engine.checkpoint import layout
from engine.checkpoint.layout import ExportDir
from engine.data import prepare
from engine.errors import UserError
from engine.run.record import RunRecord
from engine.run.rundir import RunDir

ENGINE = "python -m engine"
# Everything the workflow writes is under RESULTS (relative to where Snakemake runs): one chain per recipe,
# the tiny assets the tiny recipes point at, and the random-init models of the rehearsal recipes.
RESULTS = Path("results")
ASSETS = RESULTS / "assets"
MODELS = RESULTS / "models"


@dataclass(frozen=True)
class ChainDir:
    """The paths of one recipe's chain; also a pattern for the rules: `ChainDir.of("{recipe}")`."""

    path: Path

    @classmethod
    def of(cls, recipe: str) -> ChainDir:
        return cls(RESULTS / recipe)

    @property
    def data(self) -> Path:
        return self.path / "data"

    def split(self, name: str) -> Path:
        """One of prepare-data's parquet files (engine.data.prepare.SPLITS)."""
        return self.data / f"{name}.parquet"

    @property
    def manifest(self) -> Path:
        return self.data / prepare.MANIFEST

    @property
    def smoke(self) -> RunDir:
        return self.run("smoke")

    @property
    def train(self) -> RunDir:
        return self.run("train")

    @property
    def control(self) -> RunDir:
        return self.run("control")

    @property
    def export(self) -> ExportDir:
        return ExportDir(self.path / "export")

    @property
    def curves(self) -> Path:
        return self.path / "report" / "curves.png"

    def run(self, kind: str) -> RunDir:
        """The run directory of a launch kind: smoke, train or control."""
        return RunDir(self.path / kind)

    def log(self, rule: str) -> Path:
        return self.path / "logs" / f"{rule}.log"

    def benchmark(self, rule: str) -> Path:
        return self.path / "benchmarks" / f"{rule}.tsv"


def mtime(path: Path) -> str:
    """When a step's last output was written (UTC, ISO 8601): its end time."""
    return datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat(timespec="seconds")


def _need(path: Path, what: str) -> Path:
    if not path.is_file():
        raise UserError(
            f"--workflow: {path} is missing, so the chain's {what} did not finish here: pass --workflow only "
            "for a run directory of the Snakemake chain (results/<recipe>/train)"
        )
    return path


def files_of(paths: list[Path]) -> list[Path]:
    """Files of files-or-directories, in the order the record hashes them."""
    return [f for p in paths for f in (sorted(p.rglob("*")) if p.is_dir() else [p]) if f.is_file()]


def checkpoint_files(run_dir: Path) -> list[Path]:
    """Files of the step the tracker names (what `engine export` reads), else of every step."""
    root = RunDir(run_dir).checkpoints
    step = layout.tracked_step(root)
    chosen = layout.step_dir(root, step)
    return files_of([chosen if step and chosen.is_dir() else root])


def check_written_as(
    entries: list[dict[str, Any]], run_dir: Path, exports: list[Path], data_manifest: Path | None
) -> None:
    """Each hashed file of an export (its SHA256SUMS) or of the chain's data set (its manifest.json) must
    be as its own command wrote it: the record vouches for it ("keys verified", "N rows")."""
    expected: dict[Path, str] = {}
    for export in exports:
        sums = ExportDir(export).sums
        for line in sums.read_text(errors="replace").splitlines() if sums.is_file() else []:
            digest, _, name = line.partition("  ")
            expected[(export / name).resolve()] = digest
    if data_manifest is not None and data_manifest.is_file():
        files = json.loads(data_manifest.read_text()).get("files", {})
        for name, entry in files.items() if isinstance(files, dict) else []:
            expected[(data_manifest.parent / name).resolve()] = (entry or {}).get("sha256")
    found = {(run_dir / e["path"]).resolve(): e for e in entries}
    changed = [e["path"] for path, e in found.items() if expected.get(path) not in (None, e["sha256"])]
    if changed:
        raise UserError(
            f"{', '.join(changed[:3])}: changed since written (the export's SHA256SUMS or the data set's "
            "manifest.json says otherwise); export or prepare it again: the record would vouch for it"
        )


def steps(
    run_dir: Path, exports: list[Path], snakefile: Path, run: RunRecord, model_config: list[Path]
) -> tuple[list[tuple[Path, str]], list[dict[str, Any]]]:
    """(files to hash with their roles, the steps with object/result as Paths), prepare_data to export.

    `run` is the train step's run.json; `model_config` the model files the record hashes as inputs.
    """
    if not snakefile.is_file():
        raise UserError(f"--workflow {snakefile}: no such file: pass the Snakefile that ran the chain")
    chain = ChainDir(run_dir.parent)
    manifest_path = _need(chain.manifest, "prepare_data step")
    manifest = json.loads(manifest_path.read_text())
    data = [chain.data / name for name in sorted(manifest.get("files", {}))] + [manifest_path]
    smoke_dir = chain.smoke
    smoke_run = _need(smoke_dir.record, "smoke step")
    smoke = RunRecord.read(smoke_run, "smoke step's run record")
    smoke_files = [p for p in (smoke_run, smoke_dir.metrics) if p.is_file()]
    train_data = [p for p in data if p.suffix == ".parquet"]
    found = [
        {
            "name": "prepare_data",
            "command": f"{ENGINE} prepare-data",
            "description": f"`{ENGINE} prepare-data` of dataset {manifest.get('dataset')}: "
            + ", ".join(f"{k} {v.get('rows')} rows" for k, v in sorted(manifest.get("files", {}).items())),
            "end": mtime(manifest_path),
            "object": [],
            "result": data,
        },
        {
            "name": "smoke",
            "command": f"{ENGINE} run",
            "description": f"`{ENGINE} run` smoke gate of recipe {smoke.recipe}: "
            f"{smoke.steps_done} step(s), status {smoke.status}",
            "start": smoke.start,
            "end": smoke.end,
            "exit_code": smoke.exit_code,
            "object": train_data + model_config,
            "result": smoke_files,
        },
        {
            "name": "train",
            "command": f"{ENGINE} run",
            "start": run.start,
            "end": run.end,
            "exit_code": run.exit_code,
            "object": train_data + model_config + [RunDir(run_dir).recipe],
            "result": checkpoint_files(run_dir),
        },
    ]
    for n, export in enumerate(exports, start=1):
        report_path = _need(ExportDir(export).report, "export step")
        report = json.loads(report_path.read_text())
        structure = report.get("verification", {}).get("structure", {})
        sums = ExportDir(export).sums
        found.append(
            {
                "name": "export" if len(exports) == 1 else f"export-{n}",
                "command": f"{ENGINE} export",
                "description": f"`{ENGINE} export` of step {report.get('step')} ({report.get('method')}): "
                f"{structure.get('keys')} keys verified, dtype {structure.get('dtype')}"
                + (", logits verified" if "logits" in report.get("verification", {}) else ""),
                "end": mtime(sums if sums.is_file() else report_path),
                "object": checkpoint_files(run_dir),
                "result": files_of([export]),
            }
        )
    for position, step in enumerate(found, start=1):
        step["position"] = position
    hashed = [(snakefile, "workflow"), *((p, "data") for p in data), *((p, "smoke") for p in smoke_files)]
    return hashed, found
