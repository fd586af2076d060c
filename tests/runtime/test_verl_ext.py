"""The verl extension: each hook it relies on is checked against the installed verl, so an upgrade that
moves one fails here, loudly, instead of inside a Ray worker minutes into a run."""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

PYTHON = sys.executable


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ) | {"VERL_USE_EXTERNAL_MODULES": "engine.verl_ext", "PYTHONPATH": str(ROOT)} | env
    return subprocess.run(
        [PYTHON, "-c", code], env=full, cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_verl_still_imports_external_modules_from_env() -> None:
    import verl

    source = Path(verl.__file__).read_text()
    assert 'os.getenv("VERL_USE_EXTERNAL_MODULES"' in source
    assert "import_external_libs(modules)" in source


def test_platform_registered_and_complete() -> None:
    from verl.plugin.platform import PlatformBase, PlatformRegistry

    import engine.verl_ext  # noqa: F401

    cls = PlatformRegistry.get("cpu")
    assert cls is not None and issubclass(cls, PlatformBase)
    platform = cls()  # raises TypeError if verl added an abstract method we do not implement
    assert platform.device_name == "cpu"
    assert platform.communication_backend_name() == "gloo"
    assert platform.ray_resource_options(1) == {"num_gpus": 1}
    assert not platform.is_platform_available(use_smi_check=True)  # never auto-selected
    module = platform.device_module
    for name in ("empty_cache", "synchronize", "is_available", "current_stream", "mem_get_info", "Event"):
        assert callable(getattr(module, name)), name
    free, total = module.mem_get_info()
    assert 0 < free <= total


def test_platform_selected_by_env_in_a_fresh_process() -> None:
    done = _python(
        "from verl.utils.device import get_device_name, get_nccl_backend; "
        "print(get_device_name(), get_nccl_backend())",
        VERL_PLATFORM="cpu",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["cpu", "gloo"]


def test_rollout_registrations_resolve() -> None:
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    from engine import verl_ext  # noqa: F401  (the registrations happen on import)
    from engine.runtime import hf_rollout, rollout

    assert rollout.registrations_present() == []
    assert get_rollout_class("hf", "async") is hf_rollout.HFServerAdapter
    assert get_rollout_replica_class("hf") is hf_rollout.HFReplica


def test_gloo_fix_targets_the_backend_string_verl_builds() -> None:
    from verl.utils import distributed

    source = inspect.getsource(distributed.initialize_global_process_group_ray)
    assert 'f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"' in source, "verl changed the backend string"
    params = inspect.signature(distributed.initialize_global_process_group_ray).parameters
    assert list(params) == ["timeout_second", "backend"]


def test_gloo_fix_makes_a_process_group_on_cpu() -> None:
    code = (
        "import os, torch.distributed as d\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='29533', RANK='0', WORLD_SIZE='1')\n"
        "from verl.utils.distributed import initialize_global_process_group_ray as init\n"
        "init(timeout_second=60)\n"
        "print('backend', d.get_backend())\n"
    )
    fixed = _python(code, VERL_PLATFORM="cpu")
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert "backend gloo" in fixed.stdout
    # Without the extension's platform the fix is not applied (it only acts on VERL_PLATFORM=cpu).
    plain = _python(
        "import engine.verl_ext, verl.utils.distributed as m; "
        "print(m.initialize_global_process_group_ray.__defaults__)",
        VERL_PLATFORM="",
    )
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert "(None, None)" in plain.stdout


def test_turbo_check_reads_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.runtime import turbo_check

    main = [PYTHON, "-m", "verl.trainer.main_ppo"]
    turbo = "actor_rollout_ref.actor.strategy=fsdp_turbo"
    assert turbo_check.turbo_strategy_requested([*main, turbo])
    assert turbo_check.turbo_strategy_requested([*main, "actor_rollout_ref.ref.strategy='fsdp_turbo'"])
    assert not turbo_check.turbo_strategy_requested([*main, "actor_rollout_ref.actor.strategy=fsdp2"])
    config = tmp_path / "mine.yaml"
    config.write_text("actor_rollout_ref:\n  actor:\n    strategy: fsdp_turbo  # turbo\n")
    assert turbo_check.turbo_strategy_requested([*main, "--config-path", str(tmp_path), "--config-name=mine"])
    assert turbo_check.is_trainer_driver(main)
    ray_worker = [PYTHON, "/x/ray/_private/workers/default_worker.py", "--node-ip-address=1.2.3.4"]
    assert not turbo_check.is_trainer_driver(ray_worker)
    assert turbo_check.check_turbo([*ray_worker, turbo]) is None
    monkeypatch.setattr(turbo_check, "find_spec", lambda name: None)  # FSDPTurbo absent
    assert turbo_check.check_turbo([*main, turbo]) == turbo_check.TURBO_MISSING
    monkeypatch.setattr(turbo_check, "find_spec", lambda name: object())  # FSDPTurbo importable
    assert turbo_check.check_turbo([*main, turbo]) is None


@pytest.mark.slow
def test_main_ppo_fails_fast_without_fsdp_turbo() -> None:
    from importlib.util import find_spec

    if find_spec("fsdp_turbo") is not None:
        pytest.skip("fsdp_turbo is installed here; the failure path cannot be exercised")
    env = dict(os.environ) | {"VERL_USE_EXTERNAL_MODULES": "engine.verl_ext", "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    done = subprocess.run(
        [PYTHON, "-m", "verl.trainer.main_ppo", "actor_rollout_ref.actor.strategy=fsdp_turbo"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    elapsed = time.monotonic() - start
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: fsdp_turbo strategy selected but the FSDPTurbo library")
    assert "Traceback" not in done.stderr and "ray" not in done.stdout.lower()
    assert elapsed < 120  # only the import of verl itself; no Ray start, no worker


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.data import assets

    out = tmp_path_factory.mktemp("ext-assets")
    assets.build_all(out, seed=0, train_size=4, test_size=2)
    return out / "tiny-qwen35"


def _server(model: Path):
    from types import SimpleNamespace

    from engine.runtime.hf_rollout import HFRolloutServer

    return HFRolloutServer(
        SimpleNamespace(seed=7, response_length=12), SimpleNamespace(local_path=str(model)), replica_rank=0
    )


def test_hf_server_log_probs_match_a_full_forward(tiny_model: Path) -> None:
    import torch

    server = _server(tiny_model)
    prompt = [506, 274, 10, 282, 276, 301, 507, 10, 506, 271, 10]
    params = {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "logprobs": True}
    out = asyncio.run(server.generate(prompt_ids=prompt, sampling_params=params))
    assert 1 <= len(out.token_ids) <= 12 and len(out.log_probs) == len(out.token_ids)
    with torch.no_grad():
        logits = server.model(input_ids=torch.tensor([prompt + out.token_ids])).logits[0].float()
    logp = torch.log_softmax(logits / 0.7, dim=-1)
    ref = [float(logp[len(prompt) - 1 + i, tok]) for i, tok in enumerate(out.token_ids)]
    assert max(abs(a - b) for a, b in zip(ref, out.log_probs, strict=True)) < 1e-4


def test_hf_server_sampling_is_seeded_per_prompt_occurrence(tiny_model: Path) -> None:
    prompt = [506, 274, 10, 282, 507, 10, 506, 271, 10]
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}

    def round_of_four(server) -> list[list[int]]:
        return [
            asyncio.run(server.generate(prompt_ids=prompt, sampling_params=params)).token_ids
            for _ in range(4)
        ]

    first, second = round_of_four(_server(tiny_model)), round_of_four(_server(tiny_model))
    assert first == second  # same seed, same order of occurrence -> same samples
    assert len({tuple(x) for x in first}) > 1  # the n samples of a group differ


def test_hf_server_weight_sync_changes_outputs_and_rejects_unknown_names(tiny_model: Path) -> None:
    import torch

    server = _server(tiny_model)
    state = {name: tensor.clone() for name, tensor in server.model.state_dict().items()}
    with pytest.raises(KeyError, match="not in the model"):
        server.load_weights({"model.nope.weight": torch.zeros(1)})
    prompt = [506, 274, 10, 507, 10, 506, 271, 10]
    before = server.model(input_ids=torch.tensor([prompt])).logits.detach()
    state = {name: tensor + 0.05 if tensor.is_floating_point() else tensor for name, tensor in state.items()}
    assert server.load_weights(state, global_steps=3) == len(state)
    after = server.model(input_ids=torch.tensor([prompt])).logits.detach()
    assert not torch.allclose(before, after)
    out = asyncio.run(server.generate(prompt_ids=prompt, sampling_params={"temperature": 1.0}))
    assert out.extra_fields["global_steps"] == 3


def test_hf_server_fuses_per_expert_weights_from_verl(tiny_model: Path) -> None:
    """verl syncs MoE experts one by one; the transformers model keeps them fused (gate before up)."""
    import torch

    from engine.checkpoint.experts import fuse_experts

    server = _server(tiny_model.parent / "tiny-qwen35-moe")
    own = {name: tensor.clone() for name, tensor in server.model.state_dict().items()}
    split: dict[str, torch.Tensor] = {}
    for name, tensor in own.items():
        if name.endswith("experts.gate_up_proj"):
            prefix, half = name.removesuffix(".gate_up_proj"), tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                split[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :half] + 0.1
                split[f"{prefix}.{e}.up_proj.weight"] = tensor[e, half:] + 0.2
        elif name.endswith("experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(tensor.shape[0]):
                split[f"{prefix}.{e}.down_proj.weight"] = tensor[e] + 0.3
        else:
            split[name] = tensor
    assert any(".experts.0.gate_proj.weight" in name for name in split)
    server.load_weights(split)
    new = server.model.state_dict()
    fused = [name for name in new if name.endswith("experts.gate_up_proj")]
    assert fused
    for name in fused:
        half = new[name].shape[1] // 2
        assert torch.allclose(new[name][:, :half], own[name][:, :half] + 0.1)
        assert torch.allclose(new[name][:, half:], own[name][:, half:] + 0.2)
        down = name.replace("gate_up_proj", "down_proj")
        assert torch.allclose(new[down], own[down] + 0.3)
    incomplete = {k: v for k, v in split.items() if ".experts.3." not in k}
    with pytest.raises(KeyError, match="incomplete expert set"):
        fuse_experts(incomplete, new)


def test_verl_processes_get_chunked_logprobs_through_the_extension() -> None:
    code = (
        "import verl\n"
        "from verl.utils import torch_functional as F\n"
        "from verl.workers.engine.fsdp import transformer_impl as T\n"
        "print(F.logprobs_from_logits.__module__, T.logprobs_from_logits is F.logprobs_from_logits)"
    )
    out = _python(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["engine.runtime.kernels", "True"]


def test_verl_processes_get_rules_that_honour_packing() -> None:
    """engine.verl_ext in a fresh verl process, fla absent: both Qwen3.5 modules' chunk rules split."""
    code = (
        "import verl\n"
        "from transformers.models.qwen3_5 import modeling_qwen3_5 as a\n"
        "from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as b\n"
        "print(*(m.chunk_gated_delta_rule.__wrapped__ is m.torch_chunk_gated_delta_rule for m in (a, b)))"
    )
    out = _python(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["True", "True"]


def test_verl_processes_get_fewer_host_reads_unless_told_otherwise() -> None:
    """engine.verl_ext in a fresh verl process: ppo_loss (which imported the name), the padding module and
    the packed engine's temperature expansion call engine.runtime.syncs; `ENGINE_HOST_SYNCS=verl` keeps
    verl's own, and another value stops the process with one line."""
    code = (
        "import verl\n"
        "from verl.workers.utils import losses, padding\n"
        "from verl.utils import torch_functional as F\n"
        "print(*(f.__module__ for f in (losses.no_padding_2_padding, padding.no_padding_2_padding,"
        " F.expand_as_nested)))"
    )
    ours = ["engine.runtime.syncs"] * 3
    verls = ["verl.workers.utils.padding", "verl.workers.utils.padding", "verl.utils.torch_functional"]
    for value, expected in ((None, ours), ("lean", ours), ("verl", verls)):
        out = _python(code, **({} if value is None else {"ENGINE_HOST_SYNCS": value}))
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split()[-3:] == expected, value
    bad = _python("import verl", ENGINE_HOST_SYNCS="fast")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: ENGINE_HOST_SYNCS")
