"""verl's `cpu` platform (chosen by `VERL_PLATFORM=cpu`) and its one runtime fix: verl builds the
process-group backend as `cpu:gloo,{device}:{ccl}`, which on CPU is `cpu:gloo,cpu:gloo` ("Duplicate device
type cpu"); the default of `initialize_global_process_group_ray(backend=None)` is set to plain `gloo`.
"""

from __future__ import annotations

import os
import types
from contextlib import contextmanager
from typing import Any


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


def register_platform() -> type:
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
