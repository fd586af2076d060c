"""Refuse a training run that exited 0 without a checkpoint of its last step (cf. verl issue #7401).

`engine run` already fails a launch that logged no steps up to its target. This adds the checkpoint
side: export reads the latest checkpoint, so it must exist and be the last step the run logged (or the
step count verl announced, `Total training steps: N`, when the log has it). Exit 1 with one line.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from engine.checkpoint.layout import saved_step


def main(run_dir: str) -> int:
    run = Path(run_dir)
    saved = saved_step(run / "checkpoints")
    if not saved:
        print(f"error: {run}/checkpoints has no finished checkpoint; set trainer.save_freq", file=sys.stderr)
        return 1
    record = json.loads((run / "run.json").read_text())
    want = record.get("target_steps") or record.get("last_step")
    log = run / "train.log"
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
