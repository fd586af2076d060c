"""bench-gpu parts that run without a GPU: the 0.8B shape, the parameter count, input checks, tables."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import gpu_bench
from engine.data import random_model
from engine.errors import UserError
from engine.recipes import models
from engine.recipes.params import count_text_params
from engine.runtime import kernels


def test_flops_params_count_what_a_token_multiplies_by() -> None:
    """Dense: every text parameter (the tied embedding once, as the head); MoE: attention, router, shared
    expert, 8 of 256 routed experts and the head, not the embedding lookup."""
    import transformers

    text = models.lookup("Qwen3.5-0.8B").text_config()
    dense = transformers.AutoConfig.for_model("qwen3_5", text_config=text)
    assert gpu_bench.flops_params(dense) == 752_393_024  # the 0.8B's text parameters
    cut = models.lookup("Qwen3.5-35B-A3B-6L")
    moe = transformers.AutoConfig.for_model("qwen3_5_moe", text_config=cut.text_config())
    embedding = cut.vocab_size * cut.hidden_size
    assert gpu_bench.flops_params(moe) == cut.active_params - embedding == 877_469_120
    routed = 3 * cut.hidden_size * cut.expert_intermediate_size
    all_experts = gpu_bench.flops_params(moe) + 6 * (256 - 8) * routed  # every expert instead of 8
    assert all_experts == count_text_params(cut.text_config()).total - embedding


def test_conv1d_cpu_path_equals_torch_depthwise_conv() -> None:
    import torch
    import torch.nn.functional as F

    x, w, b = torch.randn(2, 6, 9), torch.randn(6, 4), torch.randn(6)
    conv = torch.nn.Conv1d(6, 6, 4, groups=6, padding=3)
    conv.weight.data, conv.bias.data = w.unsqueeze(1), b
    expected = F.silu(conv(x)[..., :9])
    assert torch.allclose(kernels.fla_conv1d_fn(x, w, b, activation="silu"), expected, atol=1e-6)


def _args(tmp_path: Path, **kw: object) -> argparse.Namespace:
    base = {"modes": ["plain"], "kernels": ["fla"], "gpus": 1, "batch": 4, "mbs": 4, "seq": 2048}
    base |= {"steps": 2, "warmup": 1, "model": tmp_path, "fill": 1.0, "repeats": 1, "levers": ["baseline"]}
    return argparse.Namespace(**(base | kw))


def test_validate_refuses_bad_matrix(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    gpu_bench.validate_args(_args(tmp_path))
    with pytest.raises(UserError, match="unknown"):
        gpu_bench.validate_args(_args(tmp_path, modes=["fast"]))
    with pytest.raises(UserError, match="multiple"):
        gpu_bench.validate_args(_args(tmp_path, batch=6))
    with pytest.raises(UserError, match="--fill"):
        gpu_bench.validate_args(_args(tmp_path, fill=0.0))
    with pytest.raises(UserError, match="make-model"):
        gpu_bench.validate_args(_args(tmp_path / "nope"))


def test_markdown_table_rows_and_failures() -> None:
    ok = {"mode": "plain", "kernels": "fla", "gpus": 1, "batch": 4, "mbs": 4, "seq": 2048}
    ok |= {"tokens_per_s": 31362.3, "tokens_per_s_per_gpu": 31362.3, "step_ms": 261.2, "mfu": 0.1431}
    ok |= {"peak_alloc_gib": 48.71}
    bad = {"mode": "verl-packed", "kernels": "torch", "gpus": 1, "batch": 4, "mbs": 4, "seq": 2048}
    bad["error"] = "timeout after 90 s"
    table = gpu_bench.markdown_table([ok, bad])
    assert "| plain | fla | 1 | 4/4/2048 | 31,362 | 31,362 | 261 | 14.3% | 48.71 |" in table
    assert "failed: timeout after 90 s" in table


@pytest.mark.parametrize("kernel", ["chunked", "compiled"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_token_logprobs_equal_log_softmax_in_value_and_gradient(
    dtype: str, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both kernels (the compiled one: the compiled-logprobs lever, Inductor's C++ on the CPU)."""
    import torch

    from engine.recipes.levers import LOGPROBS_ENV

    monkeypatch.setenv(LOGPROBS_ENV, kernel)
    vocab = 3000
    monkeypatch.setattr(kernels, "CHUNK_BYTES", 4 * vocab * 7)  # 7 rows per chunk: several + a ragged end
    generator = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(3, 11, vocab, generator=generator)).to(getattr(torch, dtype))
    logits = logits.transpose(0, 1).requires_grad_()  # non-contiguous, as verl's slices can be
    labels = torch.randint(0, vocab, (11, 3), generator=generator)
    weights = torch.randn(11, 3, generator=generator)

    ours = kernels.token_logprobs(logits, labels)
    (ours * weights).sum().backward()
    grad, logits.grad = logits.grad, None
    reference = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    (reference * weights).sum().backward()

    assert ours.dtype == torch.float32 and ours.shape == labels.shape
    assert torch.allclose(ours, reference, atol=1e-5)
    assert grad.dtype == logits.dtype
    tolerance = 1e-6 if dtype == "float32" else 1e-2  # bf16 rounding of the gradient itself
    assert torch.allclose(grad.float(), logits.grad.float(), atol=tolerance)


def test_timeout_kills_the_workers_a_launcher_started(tmp_path: Path) -> None:
    import os
    import time

    log = tmp_path / "run.log"
    with log.open("w") as handle:  # the launcher starts a worker and waits, as torch.distributed.run does
        code = gpu_bench.run_group(["bash", "-c", "sleep 60 & echo $!; wait"], handle, timeout=2.0)
    worker = int(log.read_text().split()[0])
    time.sleep(0.2)
    assert code == "timeout after 2 s"
    stat = Path(f"/proc/{worker}/stat")
    state = stat.read_text().split()[2] if os.path.exists(stat) else "gone"
    assert state in ("gone", "Z"), f"worker {worker} survived the timeout (state {state})"


def test_a_killed_bench_takes_its_launcher_and_workers_with_it(tmp_path: Path) -> None:
    """SIGKILL of the bench itself (no timeout reached): nothing it started keeps the GPU."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT

    log = tmp_path / "run.log"
    code = (
        "import sys; from benchmarks import gpu_bench\n"
        "with open(sys.argv[1], 'w') as log:\n"
        "    gpu_bench.run_group(['bash', '-c', 'echo $$; sleep 60 & echo $!; wait'], log, timeout=300)\n"
    )
    bench = subprocess.Popen(
        [sys.executable, "-c", code, str(log)], cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)}
    )
    deadline = time.monotonic() + 60
    while len(log.read_text().split() if log.exists() else []) < 2:
        assert time.monotonic() < deadline and bench.poll() is None
        time.sleep(0.1)
    launcher, worker = (int(pid) for pid in log.read_text().split())
    bench.send_signal(signal.SIGKILL)
    bench.wait()

    def alive(pid: int) -> bool:
        stat = Path(f"/proc/{pid}/stat")
        return stat.exists() and stat.read_text().rpartition(")")[2].split()[0] != "Z"

    deadline = time.monotonic() + 10
    while (left := [pid for pid in (launcher, worker) if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"outlived the bench: {left}"


def test_parse_shapes_and_bad_shapes(tmp_path: Path) -> None:
    assert gpu_bench.parse_shapes("4/4/2048, 2/1/4096") == [(4, 4, 2048), (2, 1, 4096)]
    with pytest.raises(argparse.ArgumentTypeError, match="BATCH/MBS/SEQ"):
        gpu_bench.parse_shapes("4x4x2048")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="batch 6 is not a multiple of mbs 4"):
        gpu_bench.validate_args(_args(tmp_path, shapes=[(4, 4, 64), (6, 4, 64)]))


@pytest.mark.slow
def test_one_process_group_measures_each_shape_and_profiles_a_step(tmp_path: Path) -> None:
    """The real worker on the CPU (gloo): the plain FSDP2 row of the small MoE at two shapes, one row each,
    then a profiled step; MFU's N is the MoE's active count."""
    import gzip

    import transformers

    model = random_model.make_model(tmp_path / "moe", small=True, model="Qwen3.5-35B-A3B-6L")
    out = tmp_path / "rows.jsonl"
    code = gpu_bench.cli_main(
        [
            *("run", "--model", str(model), "--modes", "plain", "--kernels", "torch"),
            *("--shapes", "2/1/32,2/2/32", "--steps", "1", "--warmup", "0", "--out", str(out)),
            *("--profile", str(tmp_path / "prof")),
        ]
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert code == 0 and [(r["batch"], r["mbs"], r["seq"]) for r in rows] == [(2, 1, 32), (2, 2, 32)]
    assert all(r["tokens_per_s"] > 0 and r["step_ms"] > 0 for r in rows)
    assert rows[0]["flops_params"] == gpu_bench.flops_params(transformers.AutoConfig.from_pretrained(model))
    # the timed step's phases, clocked on the host (a CPU has no device clock): one micro-batch of the
    # first shape is two forwards, and the phases cover the step
    for row in rows:
        assert list(row["phases"]) == ["prepare", "forward", "loss", "backward", "optimizer", "finish"]
        assert all(list(figures) == ["host_ms"] for figures in row["phases"].values())
        covered = sum(figures["host_ms"] for figures in row["phases"].values())
        assert 0.8 * row["step_ms"] <= covered <= 1.01 * row["step_ms"], (covered, row["step_ms"])
    profile = next((tmp_path / "prof").glob("plain.torch.*.b2.m2.s32.*.txt")).read_text()
    assert "operator calls" in profile.splitlines()[0]
    assert "# host reads of tensor data (syncs where the data is on a GPU): " in profile  # on a CPU
    # the timeline of a step profiled without stacks, for a trace viewer
    [trace] = (tmp_path / "prof").glob("plain.torch.*.b2.m2.s32.*.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any(e.get("cat") == "cpu_op" and e.get("name") == "aten::mm" for e in events)


def test_levers_multiply_the_verl_rows_only(tmp_path: Path) -> None:
    args = _args(tmp_path, modes=["plain", "verl-packed"], kernels=["fla"], levers=["baseline", "fast"])
    assert gpu_bench.configurations(args) == [
        ("fla", "plain", "baseline"),
        ("fla", "verl-packed", "baseline"),
        ("fla", "verl-packed", "fast"),
    ]


def test_summary_takes_medians_spread_and_the_largest_peak() -> None:
    row = {"model": "m", "mode": "verl-packed", "kernels": "fla", "levers": "fast", "logprobs": "chunked"}
    row |= {"gpus": 1, "batch": 4, "mbs": 4, "seq": 2048, "fill": 1.0}
    reps = [
        row | {"tokens_per_s": t, "step_ms": 8192e3 / t, "mfu": t / 1e5, "peak_alloc_gib": p}
        for t, p in ((20000.0, 40.0), (25000.0, 40.5), (21000.0, 40.0))
    ]
    failed = row | {"error": "timeout after 900 s"}
    [summary] = gpu_bench.summarize([*reps, failed])
    assert (summary["repeats"], summary["failed"]) == (3, 1)
    assert summary["tokens_per_s"] == 21000.0 and summary["spread"] == round(5000 / 21000, 4)
    assert summary["peak_alloc_gib"] == 40.5 and summary["mfu"] == 0.21
    table = gpu_bench.summary_table([summary])
    assert "| verl-packed +fast | fla | 4/4/2048 | 3 ok, 1 failed | 21,000 | 20,000-25,000 | 23.8% |" in table


@pytest.mark.slow
def test_lever_rows_run_verl_engine_with_the_lever_applied(tmp_path: Path) -> None:
    """verl's engine on the CPU (gloo, the cpu profile's environment), the small MoE: one process group per
    lever, each row reading back what the engine ran with, and the summary over them."""

    model = random_model.make_model(tmp_path / "moe", small=True, model="Qwen3.5-35B-A3B-6L")
    out = tmp_path / "rows.jsonl"
    code = gpu_bench.cli_main(
        [
            *("run", "--model", str(model), "--modes", "verl-padded", "--kernels", "torch"),
            *("--levers", "fast,fast-bf16-reduce", "--shapes", "2/1/32", "--steps", "1", "--warmup", "1"),
            *("--out", str(out)),
        ]
    )
    rows = {r["levers"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert code == 0 and sorted(rows) == ["fast", "fast-bf16-reduce"]
    assert rows["fast"]["optimizer_kernel"] == "fused" and rows["fast"]["param_dtype"] == "float32"
    assert rows["fast"]["grad_reduce_dtype"] == "float32"  # verl's default: bf16 gradients cast to fp32
    bf16 = rows["fast-bf16-reduce"]
    assert bf16["optimizer"] == "torchao.optim.adam._AdamW" and bf16["state_dtype"] == "bfloat16"
    assert bf16["grad_reduce_dtype"] == "bfloat16"  # FSDP2 reduces the gradients as computed
    assert all(
        r["reshard_after_forward"] is False and r["model"] == "qwen3_5_moe_text 4L h64 8e"
        for r in rows.values()
    )
    summary = out.with_suffix(".md").read_text()
    assert "| verl-padded +fast-bf16-reduce | torch | 2/1/32 | 1 ok, 0 failed |" in summary
    # verl's train_batch clocked by the model's, the loss's and the optimizer's hooks: the optimizer
    # phase (its step) and backward (backward and the clip) are there, and the phases cover the step
    for row in rows.values():
        phases = row["phases"]
        assert list(phases) == ["prepare", "forward", "loss", "backward", "optimizer", "finish"], phases
        covered = sum(figures["host_ms"] for figures in phases.values())
        assert 0.8 * row["step_ms"] <= covered <= 1.01 * row["step_ms"], (covered, row["step_ms"])
        assert phases["backward"]["host_ms"] > phases["finish"]["host_ms"]
    assert "| run | prepare | forward | loss | backward | optimizer | finish |" in summary
    assert "| verl-padded +fast 2/1/32 #1 | " in summary


def test_deferred_rows_step_verls_engine_with_its_reads_at_the_end(tmp_path: Path) -> None:
    """`--host-syncs deferred`: the worker steps verl's engine with engine.runtime.reads in place (it
    refuses to run otherwise), the row and its file name say so, and the phase clock still covers the
    step (its optimizer phase: fused AdamW told of a non-finite norm on the device)."""

    model = random_model.make_model(tmp_path / "moe", small=True, model="Qwen3.5-35B-A3B-6L")
    out = tmp_path / "rows.jsonl"
    code = gpu_bench.cli_main(
        [
            *("run", "--model", str(model), "--modes", "verl-packed", "--kernels", "torch"),
            *("--levers", "fast", "--shapes", "2/1/32", "--steps", "1", "--warmup", "1"),
            *("--host-syncs", "deferred", "--out", str(out)),
        ]
    )
    (row,) = map(json.loads, out.read_text().splitlines())
    assert code == 0 and row["host_syncs"] == "deferred" and row["optimizer_kernel"] == "fused"
    covered = sum(figures["host_ms"] for figures in row["phases"].values())
    assert 0.8 * row["step_ms"] <= covered <= 1.01 * row["step_ms"], (covered, row["step_ms"])
    assert list(tmp_path.glob("rows.*.syncs-deferred.r1.log"))
    assert "| verl-packed +fast (deferred host syncs) | torch |" in out.with_suffix(".md").read_text()


def _site_a(x: object) -> object:
    import torch

    return torch.mul(x, 2)


def _site_b(x: object) -> object:
    import torch

    return torch.mul(x, 3)


def test_sync_sites_groups_calls_by_where_they_come_from() -> None:
    """On a GPU the calls are cudaStreamSynchronize and kin; on the CPU aten::mul stands in for them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.host_syncs import sync_sites

    x = torch.ones(4)
    verbose = torch._C._profiler._ExperimentalConfig(verbose=True)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True, experimental_config=verbose) as profiler:
        for _ in range(3):
            _site_a(x)
        _site_b(x)
    text = sync_sites(profiler, calls=("aten::mul",))
    assert text.startswith("# host syncs: 4 calls")
    counts = {line.split(" x ")[0].strip() for line in text.splitlines()[1:] if "aten::mul" in line}
    assert counts == {"3", "1"}  # two call sites, not one row of four
    assert "_site_a" in text and "_site_b" in text
    assert sync_sites(profiler).startswith("# host syncs: 0 calls")  # no device: nothing waited
    with profile(activities=[ProfilerActivity.CPU], with_stack=True, experimental_config=verbose) as profiler:
        x.sum().item()  # aten::item runs aten::_local_scalar_dense
    nested = sync_sites(
        profiler, calls=("aten::item", "aten::_local_scalar_dense"), title="reads", waits=False
    )
    assert nested.splitlines()[:2] == ["# reads: 1 calls, by call site", "     1 x aten::item"]


def test_host_syncs_switch_names_only_rows_off_the_default(tmp_path: Path) -> None:
    """`--host-syncs verl` rows carry it in their file names, table names and configuration key; `lean`
    rows (the default) and rows from before the switch look as they did."""
    args = _args(tmp_path, logprobs="chunked", host_syncs="lean")
    slug = "verl-packed.torch.chunked.g1.b4.m4.s64.f1.fast"
    assert gpu_bench.run_slug("verl-packed", "torch", args, (4, 4, 64), "fast") == slug
    args.host_syncs = "verl"
    assert gpu_bench.run_slug("verl-packed", "torch", args, (4, 4, 64), "fast") == slug + ".syncs-verl"
    assert ".syncs" not in gpu_bench.run_slug("plain", "torch", args, (4, 4, 64))
    assert gpu_bench.build_parser().parse_args(["run", "--model", "m"]).host_syncs == "lean"
    row = {"model": "m", "mode": "verl-packed", "kernels": "torch", "levers": "fast", "logprobs": "chunked"}
    row |= {"gpus": 1, "batch": 4, "mbs": 4, "seq": 64, "fill": 1.0, "tokens_per_s": 10.0, "step_ms": 1.0}
    row |= {"mfu": None, "peak_alloc_gib": 0.0}
    old, lean, verl = row, row | {"host_syncs": "lean"}, row | {"host_syncs": "verl"}
    assert gpu_bench.config_key(old) == gpu_bench.config_key(lean) != gpu_bench.config_key(verl)
    summary = gpu_bench.summarize([old, lean, verl])
    assert [(s["repeats"], s.get("host_syncs")) for s in summary] == [(2, None), (1, "verl")]
    table = gpu_bench.summary_table(summary)
    assert "| verl-packed +fast | torch |" in table
    assert "| verl-packed +fast (verl host syncs) | torch |" in table


def test_gpu_workers_allocate_as_verls_trainer_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the workers get the expandable segments verl's trainer turns on at its first weight sync
    (without them an 80 GB card re-allocated every step); a caller's own allocator setting wins; a host
    without a GPU gets the cpu profile instead and no allocator setting."""
    import torch

    from benchmarks.gpu_bench import worker_env

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in worker_env()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert worker_env()["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    assert worker_env()["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"
