"""`python -m engine make-model`: a random-init Qwen3.5 in a registry shape, for runs without weights.

The GPU rehearsal recipes (`model.init: random`) train the real architecture at full width with weights
nobody has to download: the workflow builds the model with this command (seeded, so two builds are
byte-identical) and the benchmarks measure the same one. The tokenizer is the project's tiny BPE padded
to the model's vocabulary: verl's vLLM rollout masks ids past `len(tokenizer)`, which would shift the
rollout's log-probs by a constant. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine import fsutil
from engine.errors import ArgumentParser, UserError
from engine.recipes import models

RANDOM_MODELS = ("Qwen3.5-0.8B", "Qwen3.5-35B-A3B-6L")  # registry entries with every width known
# vision tower kept small-but-real like the release's (not a registry fact: the GPU runs are text only)
VISION: dict[str, Any] = {"depth": 12, "hidden_size": 768, "intermediate_size": 3072, "num_heads": 12}
# CPU tests: the same layer pattern, vocabulary handling and expert layout at tiny widths
SMALL_TEXT: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "head_dim": 16,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
}
SMALL_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
SMALL_MOE |= {"shared_expert_intermediate_size": 32}
SMALL_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}


def make_model(
    out: Path,
    seed: int = 0,
    device: str = "cpu",
    small: bool = False,
    model: str = RANDOM_MODELS[0],
    layers: int | None = None,
    dtype: str = "bfloat16",
) -> Path:
    """Random-init Qwen3.5 or Qwen3.5-MoE (VL layout) in a registry shape, safetensors (bf16 unless asked),
    plus the tiny tokenizer padded to the model's vocabulary. `layers` keeps only the first layers of the
    shape (every width kept: a full-width check that fits a small host)."""
    import torch
    from transformers.models import qwen3_5, qwen3_5_moe

    from engine.data import assets

    spec = models.lookup(model)
    text = spec.text_config()
    vision = dict(VISION)
    if small:
        text |= SMALL_TEXT | (SMALL_MOE if spec.moe else {})
        vision = dict(SMALL_VISION)
    if layers is not None:
        text |= {"num_hidden_layers": layers, "layer_types": text["layer_types"][:layers]}
    vision["out_hidden_size"] = text["hidden_size"]
    tokenizer = assets.build_tokenizer(seed, size=text["vocab_size"])  # covers the whole vocabulary
    family = qwen3_5_moe if spec.moe else qwen3_5
    config_cls = family.Qwen3_5MoeConfig if spec.moe else family.Qwen3_5Config
    model_cls = (
        family.Qwen3_5MoeForConditionalGeneration if spec.moe else family.Qwen3_5ForConditionalGeneration
    )
    config = config_cls(
        text_config=text | assets.text_token_ids(tokenizer),
        vision_config=vision,
        tie_word_embeddings=text["tie_word_embeddings"],
        **assets.vision_token_ids(tokenizer),
    )
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    with torch.device(device):
        built = model_cls(config).to(getattr(torch, dtype))
    built.generation_config.eos_token_id = tokenizer.eos_token_id
    built.generation_config.pad_token_id = tokenizer.pad_token_id
    out.parent.mkdir(parents=True, exist_ok=True)
    assets.save_model(built, tokenizer, out)
    return out


def cli_main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m engine make-model", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="new (or empty) model directory")
    parser.add_argument(
        "--model",
        choices=RANDOM_MODELS,
        default=RANDOM_MODELS[0],
        help="registry shape (engine.recipes.models)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N layers of the shape")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--small", action="store_true", help="tiny widths, same layout (tests on a CPU)")
    args = parser.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        raise UserError(f"--layers {args.layers}: give a positive number of layers")
    out = fsutil.check_out_dir(args.out)  # a model directory is written whole, never merged into
    import torch

    # the 35B-A3B cut has 6 B parameters: initialising them on the GPU takes seconds, on a host minutes
    device = "cuda" if torch.cuda.is_available() and not args.small else "cpu"
    path = make_model(out, args.seed, device, args.small, args.model, layers=args.layers, dtype=args.dtype)
    print(f"model {path}")
    return 0
