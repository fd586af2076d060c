"""What every export is checked against, whichever method merged it: the model's meta-device skeleton.

The skeleton (a meta-device instance of `config.architectures[0]`) names every tensor save_pretrained
writes, with its shape and whether it is floating. The checkpoint is held to it before anything is
merged (`check_checkpoint`: a float stored as int16 is corruption no cast repairs), and the exported
files after (`verify_structure`: key set, shape and dtype of every tensor, the per-expert MoE layout);
`verify_logits` then runs both models. Each check is the same for `--method verl` and `dtensor`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine import bounds
from engine.checkpoint import experts, merge
from engine.errors import UserError

LOGITS_ATOL_SAME_WEIGHTS = 1e-4  # exported weights vs the checkpoint's rounded to the export dtype
LOGITS_RTOL_FULL_PRECISION = 5e-2  # exported vs fp32 checkpoint, relative to the largest |logit|


def model_class(config: Any) -> Any:
    import transformers

    arch = (getattr(config, "architectures", None) or [None])[0]
    if not arch or not hasattr(transformers, arch):
        raise UserError(
            f"config.json architectures={arch!r} is not a transformers class: fix huggingface/config.json"
        )
    return getattr(transformers, arch)


def skeleton(config: Any, dtype: Any) -> tuple[dict[str, tuple[tuple[int, ...], Any]], set[str]]:
    """key -> (shape, torch dtype) of every tensor the model saves, and the tied keys it drops."""
    import torch

    cls = model_class(config)
    with torch.device("meta"):
        model = cls._from_config(config, dtype=dtype)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    tensors = {k: (tuple(t.shape), t.dtype) for k, t in model.state_dict().items() if k not in tied}
    return tensors, tied


def expected_layout(config: Any, dtype: Any) -> tuple[dict[str, tuple[tuple[int, ...], str]], set[str]]:
    """key -> (shape, safetensors dtype) save_pretrained would write in `dtype`, experts per expert."""
    tensors, tied = skeleton(config, dtype)
    layout: dict[str, tuple[tuple[int, ...], str]] = {}
    for key, (shape, model_dtype) in tensors.items():
        written = merge.SAFETENSORS_DTYPES[str(merge.written_dtype(model_dtype, dtype))]
        layout.update({k: (s, written) for k, s in experts.split_expert_specs(key, shape)})
    return layout, tied


def check_checkpoint(plans: dict[str, merge.KeyPlan], config: Any, dtype: Any) -> None:
    """Each checkpoint tensor the model has: the model's shape, floating exactly where the model's is
    (and the model's own dtype where it is not). Keys the model lacks are left to verify_structure."""
    tensors, _ = skeleton(config, dtype)
    problems = []
    for key in sorted(set(plans) & set(tensors)):
        plan, (shape, want) = plans[key], tensors[key]
        if plan.shape != shape:
            problems.append(f"{key} shape {plan.shape} != {shape}")
        if plan.dtype.is_floating_point != want.is_floating_point or (
            not want.is_floating_point and plan.dtype != want
        ):
            kind = "a floating tensor" if want.is_floating_point else str(want)
            problems.append(f"{key} is stored as {plan.dtype} where the model has {kind}")
    if problems:
        raise UserError(
            f"checkpoint does not fit {model_class(config).__name__} ({len(problems)} tensor(s)): "
            f"{'; '.join(problems[:3])}; it is corrupt or of another model: re-copy it from the trainer"
        )


def read_exported(out: Path) -> dict[str, tuple[tuple[int, ...], str, str]]:
    """key -> (shape, safetensors dtype, file) from the headers of the exported files."""
    from safetensors import SafetensorError, safe_open

    found: dict[str, tuple[tuple[int, ...], str, str]] = {}
    for f in sorted(out.glob("*.safetensors")):
        try:
            with safe_open(f, framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118  (a safe_open handle is not iterable)
                    if key in found:
                        raise UserError(f"export verification failed: {key} is in two files")
                    piece = handle.get_slice(key)
                    found[key] = (tuple(piece.get_shape()), piece.get_dtype(), f.name)
        except SafetensorError as err:
            raise UserError(
                f"export verification failed: {f.name} is not readable safetensors ({err})"
            ) from None
    index = out / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        if weight_map != {k: v[2] for k, v in found.items()}:
            raise UserError(
                "export verification failed: model.safetensors.index.json disagrees with the shards"
            )
    return found


def verify_structure(out: Path, config: Any, dtype: Any) -> dict[str, Any]:
    """Key set, shape and dtype of every tensor and the MoE layout of the export against the skeleton."""
    expected, tied = expected_layout(config, dtype)
    found = read_exported(out)
    fused = [k for k in found if experts.is_fused(k)]
    per_expert = [k for k in found if experts.is_expert_key(k)]
    problems = (
        [f"fused expert tensors {fused[:2]}: transformers saves and loads per-expert keys"] if fused else []
    )
    problems += [f"missing {k}" for k in sorted(set(expected) - set(found))]
    problems += [f"unexpected {k}" for k in sorted(set(found) - set(expected))]
    for key in sorted(set(expected) & set(found)):
        (shape, dt, _), (want_shape, want_dtype) = found[key], expected[key]
        if shape != want_shape:
            problems.append(f"{key} shape {shape} != {want_shape}")
        if dt != want_dtype:
            problems.append(f"{key} dtype {dt} != {want_dtype}")
    if problems:
        raise UserError(f"export verification failed ({len(problems)} problems): {'; '.join(problems[:5])}")
    return {
        "keys": len(found),
        "tied_dropped": sorted(tied),
        "expert_keys": len(per_expert),
        "dtype": merge.SAFETENSORS_DTYPES[str(dtype)],
    }


def _non_finite(model: Any) -> list[str]:
    """Tensors of a loaded model holding NaN or infinity: no logit comparison may hide them (a tensor
    the fixed batch does not reach, a vision tower, would pass it)."""
    import torch

    state = model.state_dict()
    return [k for k, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def verify_logits(
    out: Path, files: list[Path], plans: dict[str, merge.KeyPlan], config: Any, dtype: Any
) -> dict:
    """Logits of the exported model on a fixed batch against the checkpoint's own tensors."""
    import torch

    cls = model_class(config)
    # on the GPU where there is one: with flash-linear-attention installed, transformers runs the
    # gated-delta-net layers with its Triton kernels, which take no CPU tensors. Each model moves there
    # before the next is built, so the host holds one fp32 copy at a time (24 GB at 6 B parameters).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    state = dict(merge.iter_merged(files, [plans[k] for k in sorted(plans)], dtype=torch.float32))
    reference = cls._from_config(config, dtype=torch.float32).eval()
    missing, unexpected = reference.load_state_dict(state, strict=False)
    del state
    if missing or unexpected:
        raise UserError(
            f"checkpoint keys do not fit {cls.__name__}: missing {missing[:3]} unexpected {unexpected[:3]}"
        )
    reference = reference.to(device)
    exported, info = cls.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    if info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]:
        raise UserError(f"export verification failed: transformers reload reports {info}")
    exported = exported.to(device)
    non_finite = _non_finite(exported)
    if non_finite:
        raise UserError(
            f"export verification failed: {len(non_finite)} tensor(s) hold NaN or infinity "
            f"({', '.join(non_finite[:3])}); the checkpoint's weights are not finite"
        )
    vocab = getattr(config, "text_config", config).vocab_size
    batch = ((torch.arange(2 * 16).reshape(2, 16) * 7919 + 13) % vocab).to(device)
    choices: list[Any] = []
    hooks = [
        module.register_forward_hook(lambda _m, _i, out: choices.append(out[2].sort(-1).values))
        for module in reference.modules()
        if type(module).__name__.endswith("TopKRouter")  # transformers' MoE routers: (logits, scores, ids)
    ]
    with torch.no_grad():
        full = reference(input_ids=batch, use_cache=False).logits
        routed_full, choices[:] = list(choices), []
        got = exported.eval()(input_ids=batch, use_cache=False).logits
        for p in reference.parameters():
            p.data = p.data.to(dtype).to(torch.float32)
        rounded = reference(input_ids=batch, use_cache=False).logits
    for hook in hooks:
        hook.remove()
    same = (got - rounded).abs().max().item()
    rel = ((got - full).abs().max() / full.abs().max().clamp_min(1e-6)).item()
    moe = bool(hooks)
    result = {
        "max_abs_diff_same_weights": same,
        "max_rel_diff_full_precision": rel,
        "batch": list(batch.shape),
        "atol_same_weights": LOGITS_ATOL_SAME_WEIGHTS,
        "rtol_full_precision": LOGITS_RTOL_FULL_PRECISION,
        # MoE: rounding the weights to the export dtype moves router logits across the top-k boundary for
        # some tokens, and a token routed to other experts has other logits: the full-precision
        # comparison measures that, not the export, so it is reported, and the same-weights check
        # (exported = checkpoint rounded, every expert in its place) is the gate
        "full_precision_gated": not moe,
    }
    if moe:
        changed = [(a != b).any(-1) for a, b in zip(routed_full, choices, strict=True)]
        result["routing_changed_share"] = torch.cat(changed).float().mean().item()
    same_ok = bounds.at_most(same, LOGITS_ATOL_SAME_WEIGHTS)
    if not same_ok or (not moe and not bounds.at_most(rel, LOGITS_RTOL_FULL_PRECISION)):
        raise UserError(f"export verification failed: logits differ from the checkpoint's: {result}")
    return result
