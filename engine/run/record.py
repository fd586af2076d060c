"""run.json: what one `engine run` launch saw and what it concludes, as one typed record.

The launcher writes it last, after the attempt's other files; provenance, the workflow, the verification
cards and the tests read it through `RunRecord.read`, which refuses a file of another kind or version
with one line. The verdict is decided here too, because verl's exit code alone says little: verl exits 0
after resuming a finished checkpoint without training, after training whose metrics went elsewhere, and
after a loop that ran but learned nothing the gates would accept.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine import fsutil
from engine.errors import FAILED, UserError
from engine.run import gates, rundir

SCHEMA = "qwen35-grpo-engine/run/1"
THIS_LAUNCH, EARLIER_ATTEMPT = "this launch", "the attempt that trained the checkpoint"


class Gate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    status: Literal["pass", "fail", "skip"]
    detail: str
    first_failed_step: int | None = None


class Control(BaseModel):
    """`engine run --control FAULT`: the loop broken on purpose, and whether the gate that must fail did."""

    model_config = ConfigDict(extra="forbid")
    fault: str
    must_fail: str
    caught: bool


class Rerun(BaseModel):
    """`engine rerun`: the record this run repeats, its sha256, and what of it no longer verified."""

    model_config = ConfigDict(extra="forbid")
    record: str
    sha256: str | None
    changed: list[str]


class RunRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    schema_id: Literal["qwen35-grpo-engine/run/1"] = Field(SCHEMA, alias="schema")
    recipe: str
    device: str
    command: list[str]
    command_line: str
    sets: list[str]  # recipe changes made at launch (e.g. fsdp2 in place of fsdp_turbo), visible
    env: dict[str, str]
    fault: str | None = None  # the loop was broken on purpose (engine.runtime.mutations): not a healthy run
    control: Control | None = None
    start: str
    end: str
    wall_s: float
    exit_code: int | None  # verl's
    steps_done: int  # steps this launch logged
    last_step: int
    checkpoint_step: int
    target_steps: int | None
    status: Literal["ok", "failed"]
    gates: list[Gate]
    gates_over: str = THIS_LAUNCH  # whose steps the gates judged
    rerun: Rerun | None = None
    error: str | None = None
    # the machine the launch ran on (engine.run.devices.hardware); None in records older than the field
    hardware: dict[str, Any] | None = None
    # verl launches of this attempt that failed at startup, before any step or checkpoint, and were
    # started again (engine.run.watch.STARTUP_FAILURES): exit code and why, one entry each
    restarts: list[str] = Field(default_factory=list)

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, indent=2) + "\n"

    @classmethod
    def read(cls, path: Path, what: str = "run record", unversioned: bool = False) -> RunRecord:
        """The record at `path`, or one UserError line. `unversioned`: also a run.json written before
        the record had a schema (the records kept in docs/records), read as this version."""
        fix = "pass the run.json of a directory `python -m engine run` wrote"
        data = fsutil.read_json(path, what, fix)
        found = data.get("schema")
        if found is None and not unversioned:
            raise UserError(
                f"{what} {path}: written by an engine older than its schema ({SCHEMA}): launch the run again "
                "with this engine, or read it with the engine that wrote it"
            )
        if found not in (None, SCHEMA):
            raise UserError(f"{what} {path}: schema {found!r} is not {SCHEMA}; {fix}")
        try:
            return cls.model_validate(data | {"schema": SCHEMA})
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise UserError(f"{what} {path}: {where}: {first['msg']}; {fix}") from None


@dataclass(frozen=True)
class Verdict:
    """What a launch achieved: the exit code, whether it trained, the gates and over whose steps."""

    code: int
    status: Literal["ok", "failed"]  # the run's own health; a control's code says whether it was caught
    trained: bool
    checks: list[gates.GateResult]
    gates_over: str
    control: Control | None
    error: str | None


def judge(
    code: int,
    rows: list[dict[str, Any]],
    earlier: list[dict[str, Any]],
    total: int | None,
    saved: tuple[int, int],
    problem: str | None,
    kind: tuple[str, str, bool],
    fault: str | None = None,
) -> Verdict:
    """The verdict of one launch from verl's exit `code`, the steps it logged (`rows`), the steps of the
    attempt whose files the run directory holds (`earlier`), the target, the checkpoint step before and
    after (`saved`), why the metrics file holds no step (`problem`), the (device, recipe, moe) the gates
    are keyed by, and a `--control` fault.

    A launch that found the checkpoint complete trains nothing: the gates then judge the attempt that
    trained it, so a failed gate is not forgotten by rerunning (Snakemake removes a failed job's run.json,
    not its metrics). A checkpoint that moved on while no step reached the metrics file fails: the
    metrics went elsewhere (a Ray worker that did not get VERL_FILE_LOGGER_PATH).
    """
    before, after = saved
    last = max((int(row["step"]) for row in rows), default=0)
    trained = bool(rows) and (total is None or last >= total)
    done = trained or (total is not None and after >= total)
    result = code if code != 0 else (0 if done else FAILED)
    error = None
    if not rows and after > before:
        error = (
            f"verl trained to step {after} (checkpoint; step {before} before this launch) but this launch's "
            f"{rundir.METRICS} {problem or 'holds no step row'}: verl's file logger writes to the "
            "VERL_FILE_LOGGER_PATH of its TaskRunner's Ray worker, which did not get it (a Ray cluster "
            "started without the job's runtime env?)"
        )
    judged, over = rows, THIS_LAUNCH
    if not rows and result == 0 and after == before:
        judged, over = earlier, EARLIER_ATTEMPT
        if not earlier:
            error = (
                f"the checkpoint held step {after} before this launch and no metrics of the attempt that "
                f"trained it are left in the run directory: nothing for the gates to judge; train it again "
                "in a new directory"
            )
    if error:
        result = FAILED if result == 0 else result
    checks = gates.evaluate(judged, *kind)
    if result == 0 and gates.failed(checks):
        result = gates.EXIT_GATE_FAILED
    status: Literal["ok", "failed"] = "ok" if result == 0 else "failed"
    control = None
    if fault is not None:
        control = Control(fault=fault, must_fail=gates.CONTROLS[fault], caught=gates.caught(checks, fault))
        if result in (0, gates.EXIT_GATE_FAILED):  # it trained: the control's verdict is the exit code
            result = 0 if control.caught else gates.EXIT_GATE_FAILED
    return Verdict(result, status, trained, checks, over, control, error)
