"""The `text-only` lever: no placeholder pass through the vision tower on text batches.

verl 0.9.1's Qwen3.5 forward (`_get_input_embeds` in verl.models.transformers.qwen3_5, on the dense and
the MoE model) runs the vision tower on 16 zero patches whenever a micro-batch has no images, and adds
0 x its mean to the token embeddings. Every rank then gathers, runs and reduces the same FSDP units
whether its batch had images or not, so mixed text and image data cannot leave one rank waiting in a
collective. On data without images that pass only costs: every forward of the actor (and of the ref
and the log-prob recomputation) gathers the tower's parameters and runs its blocks, each attention
block reads its sequence offsets to the host (a sync on a GPU), the backward runs them again, and the
optimizer steps the tower's zero gradients (AdamW's decoupled weight decay still shrinks its weights).

With `ENGINE_TEXT_ONLY=1` (the recipe field `model.text_only`, which preflight allows only with
`data.image_key: null`) a text batch takes its token embeddings alone. The language model's inputs,
loss and gradients are verl's (x + 0.0 is x, up to the sign of a zero); the grad norm sums the same
squares without the tower's zeros, so it (and a clipped update) is verl's to fp32 rounding. The tower
gets no gradient, so the optimizer keeps no state for it and leaves it as loaded. A batch with images
is an error: one rank running the tower while the others skip it would wait forever in FSDP's gather.

The replacement is in place in every verl process (`engine.runtime.install`, item 11) and reads the
variable at each call, so one process can build engines with and without the lever (the benchmarks do).
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

from engine.recipes.levers import TEXT_ONLY_ENV as ENV
from engine.runtime.kernels import when_imported

QWEN3_5 = "verl.models.transformers.qwen3_5"
NAME = "_get_input_embeds"
VERL_FUNCTION: dict[str, Any] = {}  # verl's own, once replaced


def enabled() -> bool:
    """Whether text batches skip the tower: `ENGINE_TEXT_ONLY=1`; unset or 0 is verl's behaviour."""
    value = os.environ.get(ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV}={value!r}: set 1 (text-only data) or 0, or unset it")
    return value == "1"


def get_input_embeds(
    model: Any,
    input_ids: Any,
    attention_mask: Any = None,
    pixel_values: Any = None,
    pixel_values_videos: Any = None,
    image_grid_thw: Any = None,
    video_grid_thw: Any = None,
) -> dict[str, Any]:
    """verl's `_get_input_embeds` (same arguments, same result), without the tower's pass on a text batch
    when the lever is on."""
    if not enabled():
        images = (pixel_values, pixel_values_videos, image_grid_thw, video_grid_thw)
        return VERL_FUNCTION[NAME](model, input_ids, attention_mask, *images)
    if pixel_values is not None or pixel_values_videos is not None:
        raise RuntimeError(
            f"model.text_only ({ENV}=1) is set but a batch carries images: FSDP ranks would disagree on "
            "the vision tower; unset model.text_only for data with images"
        )
    inputs_embeds = model.get_input_embeddings()(input_ids)
    if attention_mask is not None:
        attention_mask = attention_mask.to(inputs_embeds.device)
    return {"inputs_embeds": inputs_embeds, "attention_mask": attention_mask}


def _replace(module: ModuleType) -> None:
    original = vars(module).get(NAME)
    if original is None or original is get_input_embeds:
        return
    VERL_FUNCTION.setdefault(NAME, original)
    module._get_input_embeds = get_input_embeds  # type: ignore[attr-defined]


def install() -> None:
    """The replacement in verl's Qwen3.5 module when it is imported (now, if it is); its forward looks
    the function up at each call."""
    enabled()  # a bad value fails at start, not at the first forward
    when_imported(QWEN3_5, _replace)
