"""`python -m benchmarks.export`: our export and its verification against `verl.model_merger merge` alone,
on a synthetic fp32 checkpoint (benchmarks.synthetic_checkpoints) of a Qwen3.5 text model of --params.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.synthetic_checkpoints import write_synthetic_checkpoints
from engine import fsutil, procs
from engine.checkpoint import layout as ckpt_layout
from engine.errors import ArgumentParser, UserError, entry


# --- synthetic sharded checkpoints (tests and the export benchmark) -------------------------------
def bench_config(params: float) -> Any:
    """A Qwen3.5 text config (hybrid linear/full attention) with about `params` parameters."""
    import torch
    import transformers

    def build(layers: int) -> Any:
        return transformers.Qwen3_5TextConfig(
            vocab_size=65536,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=layers,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
            tie_word_embeddings=False,
            architectures=["Qwen3_5ForCausalLM"],
        )

    layers = 4
    while True:
        with torch.device("meta"):
            n = sum(p.numel() for p in transformers.Qwen3_5ForCausalLM(build(layers)).parameters())
        if n >= params:
            return build(layers), n
        layers += 4


def _measure(cmd: list[str]) -> tuple[float, float, int]:
    """Wall seconds and peak RSS (GiB) of one child process, from its own rusage."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=procs.dies_with_this_process()
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        err = proc.stderr.read().decode(errors="replace").strip().splitlines()[-1:] if proc.stderr else []
        raise UserError(f"benchmark command failed ({proc.returncode}): {' '.join(cmd[:4])}: {err}")
    return wall, usage.ru_maxrss / (1 << 20), proc.returncode


def _foreign(directory: Path, own: tuple[str, ...]) -> str | None:
    others = sorted(p.name for p in directory.iterdir() if p.name not in own)
    return f"it holds {', '.join(others[:3])}, which the export bench did not write" if others else None


def bench_main(argv: list[str]) -> int:
    """`python -m benchmarks.export`: our export+verify vs `verl.model_merger merge` alone."""
    from rich.console import Console
    from rich.table import Table

    parser = ArgumentParser(prog="python -m benchmarks.export")
    parser.add_argument("--params", type=float, default=1.0e9, help="minimum parameter count")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--workdir", help="where the checkpoint and outputs go (default: a temp dir)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--keep", action="store_true", help="keep the workdir")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    own = ("model", "ckpt", "merger", "export")  # it clears merger/ and export/ between runs
    if args.workdir:
        fsutil.check_out_dir(args.workdir, "--workdir", reuse=lambda d: _foreign(d, own))
    if args.json:
        fsutil.check_out_file(args.json, "--json", reuse=lambda _: None)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="export-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        config, n_params = bench_config(args.params)
        model_dir = work / "model"
        config.save_pretrained(model_dir)
        import torch
        import transformers
        from tokenizers import Tokenizer, models

        vocab = {"<unk>": 0, "<|endoftext|>": 1}
        fast = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))  # the merger saves a tokenizer too
        transformers.PreTrainedTokenizerFast(tokenizer_object=fast, unk_token="<unk>").save_pretrained(
            model_dir
        )

        with torch.device("meta"):
            specs = {
                k: tuple(v.shape) for k, v in transformers.Qwen3_5ForCausalLM(config).state_dict().items()
            }
        ckpt = work / "ckpt"
        with console.status(
            f"writing a {n_params / 1e9:.2f}B-parameter fp32 checkpoint, {args.world_size} ranks"
        ):
            t0 = time.perf_counter()
            if not ckpt_layout.tracker(ckpt).exists():
                job = {
                    "layout": "fsdp",
                    "out": str(ckpt),
                    "step": 1,
                    "model_dir": str(model_dir),
                    "specs": specs,
                }
                write_synthetic_checkpoints([job], args.world_size)
            written = time.perf_counter() - t0
        actor = ckpt_layout.actor_dir(ckpt, 1)
        rows = {}
        for name, cmd in (
            (
                "verl.model_merger merge",
                [
                    sys.executable,
                    "-m",
                    "verl.model_merger",
                    "merge",
                    "--backend",
                    "fsdp",
                    "--local_dir",
                    str(actor),
                    "--target_dir",
                    str(work / "merger"),
                ],
            ),
            (
                "engine export (+verify, hashes)",
                [
                    sys.executable,
                    "-m",
                    "engine",
                    "export",
                    str(actor),
                    "--out",
                    str(work / "export"),
                    "--method",
                    "dtensor",
                ],
            ),
        ):
            for out in ("merger", "export"):
                shutil.rmtree(work / out, ignore_errors=True)
            with console.status(f"running {name}"):
                rows[name] = _measure(cmd)
        merger, ours = rows["verl.model_merger merge"], rows["engine export (+verify, hashes)"]
        table = Table(title=f"export of {n_params / 1e9:.2f}B params, fp32 shards x{args.world_size} -> bf16")
        for col in ("command", "wall s", "peak RSS GiB"):
            table.add_column(col)
        for name, (wall, rss, _) in rows.items():
            table.add_row(name, f"{wall:.1f}", f"{rss:.2f}")
        table.add_row("ratio ours/merger", f"{ours[0] / merger[0]:.2f}", f"{ours[1] / merger[1]:.2f}")
        Console().print(table)
        figures = {
            "params": n_params,
            "world_size": args.world_size,
            "checkpoint_write_s": round(written, 1),
            "merger": {"wall_s": round(merger[0], 2), "peak_rss_gib": round(merger[1], 3)},
            "export": {"wall_s": round(ours[0], 2), "peak_rss_gib": round(ours[1], 3)},
            "time_ratio": round(ours[0] / merger[0], 3),
            "rss_ratio": round(ours[1] / merger[1], 3),
        }
        if args.json:
            fsutil.atomic_write(args.json, json.dumps(figures, indent=2) + "\n")
        return 0 if figures["time_ratio"] <= 1.0 and figures["rss_ratio"] <= 0.6 else 1
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    entry(bench_main)
