"""Refuse a training run that exited 0 without a checkpoint of its last step (cf. verl issue #7401).

`engine run` already fails a launch that logged no steps up to its target. This adds the checkpoint
side: export reads the latest checkpoint, so it must exist and be the last step the run logged (or the
step count verl announced, `Total training steps: N`, when the log has it). Exit 1 with one line.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from engine.errors import UserError
from engine.run.record import RunRecord
from engine.run.rundir import RunDir


def main(run_dir: str) -> int:
    run = Path(run_dir)
    files = RunDir(run)
    saved = files.saved_step()
    if not saved:
        print(f"error: {run}/checkpoints has no finished checkpoint; set trainer.save_freq", file=sys.stderr)
        return 1
    try:
        record = RunRecord.read(files.record)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    want = record.target_steps or record.last_step
    log = files.log
    text = log.read_text(errors="replace") if log.exists() else ""
    announced = re.findall(r"Total training steps: (\d+)", text)
    if announced:
        want = int(announced[-1])
    if want and saved < int(want):
        print(f"error: {run}: latest checkpoint is step {saved} of {want}; rerun to resume", file=sys.stderr)
        return 1
    print(f"check_trained: {run} has a checkpoint of step {saved}" + (f" of {want}" if want else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
