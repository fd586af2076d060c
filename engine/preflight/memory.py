"""Per-device memory estimate of a plan, by phase: what preflight compares with the device's memory.

Kept apart from preflight because it is a model to calibrate against measured peaks
(docs/reference/performance.md).
"""

from __future__ import annotations

from engine.recipes.plan import Plan

GIB = 1024**3
# Measured peak / modelled (activations + logits) on H200s through verl's FSDP2 engine (packed, fla
# kernels, chunked entropy and log-probs, no recompute). 1.8 kept the five settings of 2026-11-30 within
# +-15%. Since the backward peak of a one-micro-batch step holds no gradients (GRAD_BYTES), 1.9 keeps every
# kept record within -10.9% (the 0.8B padded) to +11.5% (bf16-sr on the MoE at 4/4/2048): the dense rows of
# 2026-12-01 and 2026-12-04, the MoE rows of 2026-12-01 and every lever row of 2026-12-04
# (tests/benchmarks/test_memory_check.py). The unmodelled part is the bf16 logits and their gradient
# next to the fp32 chunk, and autograd's saved gated-delta-net tensors.
ACTIVATION_CALIBRATION = 1.9
# torch's AdamW (foreach, what verl's FSDP engines use) computes its update in temporaries the size of
# the parameters (fp32): 4 bytes per parameter on top of the states at the optimizer step. Measured: the
# 35B-A3B shape at 6 layers peaks at 115.01 GiB = 20 B x 6.17 B parameters at every batch shape, above
# its backward peak (docs/reference/performance.md); for the dense 0.8B the activations peak higher.
OPTIMIZER_STEP_BYTES = 4
# The trainer levers (engine.recipes.levers; measured on one H200, docs/reference/trainer-levers.md):
# fused AdamW updates in place (no temporaries); torchao's compiled bf16 step reads and writes each tensor in
# one generated kernel (none either), traced per tensor or over all of them (`compiled`). bf16_sr keeps
# weights and gradients (2 B each) and both moments (2 B each) in bf16: 8 B per parameter instead of 16,
# 6 resident instead of 12.
STEP_BYTES = {"default": OPTIMIZER_STEP_BYTES, "foreach": OPTIMIZER_STEP_BYTES, "fused": 0}
STATE_BYTES = {"fp32": 16, "bf16_sr": 8}
# Between steps the gradients are freed (zero_grad sets them to None): what stays on the device while
# vLLM is awake is the fp32 weights and the AdamW moments. Measured 105.0 GiB in use during generation
# for the 35B-A3B shape (12 B x 6.17 B + vLLM's 0.25 x 141 GiB: 104.2 estimated).
RESIDENT_BYTES = 12
RESIDENT_BYTES_BF16 = 6
# Without reshard_after_forward FSDP keeps every layer's gathered bf16 parameters from its forward to
# its backward: at the start of backward the whole model is there unsharded, 2 B per parameter.
GATHERED_BYTES = 2
# With defer_gradient_sync FSDP2 accumulates a step's gradients unsharded, in the reduce dtype (fp32 by
# default, bf16 with actor.reduce_dtype=bf16), until its last micro-batch: 4 (2) B per parameter while a
# step has more than one micro-batch per device, in place of the sharded gradients (not allocated until
# the reduce): on one device it costs nothing (measured 2026-12-04: fast-bf16 with and without
# bf16-reduce+no-sync peak alike at 4/2 and 8/4).
DEFERRED_GRAD_BYTES = {"fp32": 4, "bf16": 2}
# The sharded gradients, part of STATE_BYTES. With one micro-batch per step they fill during the backward
# pass as its activations are freed, so the backward peak (all activations kept) holds none of them and
# the full gradients count at the optimizer step alone. Measured 2026-12-04 (35B-A3B at 6 layers, one
# H200): at 4/4/2048 fused peaks at 94.6 GiB where 4/2 and 8/4 (two micro-batches) peak at 104-114.
GRAD_BYTES = {"fp32": 4, "bf16_sr": 2}
# The weights alone. With model.text_only the vision tower is never run: it keeps its weights but gets no
# gradients, so AdamW never allocates its moments (measured 2026-12-06, the 0.8B on one H100: 0.92 GiB less
# peak, its 100.6 M tower parameters at 8-12 B each).
WEIGHT_BYTES = {"fp32": 4, "bf16_sr": 2}
# The project's token log-probs work through the logits in chunks of rows of at most 1 GiB of fp32
# (engine.runtime.kernels.CHUNK_BYTES). The eager chunk materialises its fp32 copy and the shifted
# exponentials (backward: the probabilities) beside it; the compiled kernels (actor.logprobs_kernel=compiled)
# keep neither. Measured 2026-12-06 on one H100 at 4/4/2048: 2.50 GiB less on the 0.8B, 3.18 GiB less on
# the MoE with text-only beside it (0.39 GiB of that the tower's moments).
LOGPROB_CHUNK_BYTES = 1 << 30
EAGER_LOGPROB_CHUNKS = 2


def layer_activation_bytes(plan: Plan, tokens: float) -> float:
    """What one decoder layer keeps for backward: 34 bytes per token and hidden unit (bf16, no attention
    scores kept: flash/sdpa); an MoE layer also keeps, per token and routed expert, the gathered input,
    the gate/up output, the activation and the expert's output (bf16)."""
    m = plan.model
    kept = 34 * tokens * m.hidden_size
    if m.moe:
        kept += 2 * tokens * m.experts_per_token * (2 * m.hidden_size + 3 * m.expert_intermediate_size)
    return kept


def memory_estimate(plan: Plan) -> dict[str, float]:
    """Per-device peak in GiB by phase. Deliberately simple: sharded states + activations + logits.

    Training states: fp32 master weights, fp32 grads and AdamW moments (16 bytes/param; 8 with
    actor.optim.precision=bf16_sr), sharded over the FSDP group (experts over the EP group); on the host
    when offloaded. The training peak is the larger of backward (states + activations + logits, less
    the gradients with one micro-batch per step, + the gathered model without reshard_after_forward, +
    unsharded gradients beyond the sharded ones with defer_gradient_sync; with model.text_only the
    vision tower holds its weights alone) and
    the optimizer step (states + AdamW's temporaries,
    none when fused). Rollout: vLLM takes `gpu_memory_utilization` of the device while the resident
    training states (weights and moments, no gradients) stay.
    """
    r, m = plan.recipe, plan.model
    p, a = r.parallel, r.actor
    expert = m.expert_params if m.moe else 0.0
    dense = m.total_params - expert
    per_device_params = dense / p.fsdp + expert / max(p.ep, 1)
    offloaded = a.offload_policy if a.strategy == "fsdp_turbo" else a.param_offload and a.optimizer_offload
    layer_bf16 = 2 * 2 * m.total_params / max(m.num_layers, 1)  # one unsharded layer, prefetched twice
    optim = a.optim
    frozen = m.vision_params / p.fsdp if r.model.text_only else 0.0  # weights without grads or moments
    trained = per_device_params - frozen
    weights = WEIGHT_BYTES[optim.precision]
    states = layer_bf16 if offloaded else STATE_BYTES[optim.precision] * trained + weights * frozen
    # FSDP/FSDP2 only: fsdp_turbo's reshard is its own (not modelled)
    held = 0.0  # unsharded parameters or gradients kept through backward
    unsharded = dense + expert / max(p.ep, 1)
    if not a.reshard_after_forward and a.strategy != "fsdp_turbo":
        held = GATHERED_BYTES * unsharded
    micro_batches = (
        a.ppo_mini_batch_size * r.rollout.n / plan.data_parallel_size / a.ppo_micro_batch_size_per_device
    )
    accumulates = micro_batches > 1 or a.use_dynamic_bsz
    grads = 0.0 if offloaded else GRAD_BYTES[optim.precision] * trained
    if a.defer_gradient_sync and a.strategy != "fsdp_turbo" and accumulates:
        held += max(0.0, DEFERRED_GRAD_BYTES[a.reduce_dtype] * unsharded - grads)
    ref = (
        0.0
        if (r.ref.offload_policy or not (a.use_kl_loss or r.algorithm.use_kl_in_reward))
        else (2 * per_device_params)
    )
    seq = (r.data.max_prompt_length + r.data.max_response_length) / p.cp
    mbs = a.ppo_micro_batch_size_per_device
    recompute = r.turbo.recompute if a.strategy == "fsdp_turbo" else r.model.gradient_checkpointing
    per_layer = layer_activation_bytes(plan, mbs * seq)
    activations = (
        (2 * mbs * seq * m.hidden_size * m.num_layers + per_layer) if recompute else per_layer * m.num_layers
    )
    logits = 4 * mbs * seq * m.vocab_size * (1 if a.entropy_from_logits_with_chunking else 2)
    compiled = a.logprobs_kernel == "compiled"  # measured directly: outside the calibration
    unchunked = (
        EAGER_LOGPROB_CHUNKS * min(LOGPROB_CHUNK_BYTES, 4 * mbs * seq * m.vocab_size) if compiled else 0
    )
    # calibrated where measured (verl's FSDP/FSDP2 engine); fsdp_turbo's recompute path is unmeasured
    scale = ACTIVATION_CALIBRATION if a.strategy in ("fsdp", "fsdp2") else 1.0
    backward = (
        states - (0.0 if accumulates else grads) + ref + held + scale * (activations + logits) - unchunked
    )
    temporaries = 0 if optim.precision == "bf16_sr" else STEP_BYTES[optim.implementation]
    step = 0.0 if offloaded else states + ref + temporaries * trained
    train = max(backward, step) / GIB
    rollout = 0.0
    if r.rollout.name == "vllm":
        kept = RESIDENT_BYTES_BF16 if optim.precision == "bf16_sr" else RESIDENT_BYTES
        resident = 0.0 if offloaded else kept * trained + weights * frozen
        rollout = r.rollout.gpu_memory_utilization * r.cluster.device_memory_gib + resident / GIB
    return {"train_gib": round(train, 2), "rollout_gib": round(rollout, 2)}
