"""Tiny offline assets for the CPU path: random-init Qwen3.5 models, a byte-level BPE tokenizer, math data.

Nothing here downloads anything. Every byte is a function of the seed, so two builds with the same seed
give identical safetensors and parquet files (tests check it). The BPE merges are learned by a small
pure-Python trainer with a fixed tie-break instead of the `tokenizers` trainer, whose tie-breaking on
equal pair counts is not specified.
"""

from __future__ import annotations

import itertools
import json
import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

from engine import fsutil
from engine.errors import ArgumentParser, UserError
from engine.recipes.models import TINY_MODELS, ModelSpec

VOCAB_SIZE = 512
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DATA_SOURCE = "synthetic/arith"
INSTRUCTION = "Give the final answer after ####."
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def make_problem(rng: random.Random) -> tuple[str, int]:
    """One arithmetic question with an exact integer answer."""
    op = rng.choice(sorted(OPS))
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    return f"What is {a} {op} {b}? {INSTRUCTION}", OPS[op](a, b)


def make_rows(seed: int, count: int, split: str) -> list[dict[str, Any]]:
    """Rows in verl's RL parquet layout (data_source, prompt, ability, reward_model, extra_info)."""
    rng = random.Random(f"{seed}-{split}")
    rows = []
    for index in range(count):
        question, answer = make_problem(rng)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": question}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": split, "index": index, "question": question, "answer": str(answer)},
            }
        )
    return rows


def write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    """Write rows with pyarrow (no pandas index metadata), atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows)
    with fsutil.atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def _corpus(seed: int) -> list[str]:
    rng = random.Random(f"{seed}-corpus")
    lines = []
    for _ in range(600):
        question, answer = make_problem(rng)
        lines.append(f"user\n{question}\nassistant\n{answer} #### {answer}\n")
    lines.append("system user assistant The answer is #### 0 1 2 3 4 5 6 7 8 9 - + * = ?")
    return lines


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map used by byte-level BPE."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


def train_bpe(lines: list[str], num_merges: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Learn merges greedily; ties go to the lexicographically smallest pair, so output is fixed."""
    from tokenizers import pre_tokenizers

    byte_map = _bytes_to_unicode()
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words: Counter[tuple[str, ...]] = Counter()
    for line in lines:
        for piece, _ in pre.pre_tokenize_str(line):
            words[tuple(piece)] += 1
    vocab_tokens = [byte_map[b] for b in range(256)]
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, freq in words.items():
            for pair in itertools.pairwise(word):
                pairs[pair] += freq
        if not pairs:
            break
        best = min(pairs.items(), key=lambda item: (-item[1], item[0]))[0]
        merges.append(best)
        vocab_tokens.append(best[0] + best[1])
        merged: Counter[tuple[str, ...]] = Counter()
        for word, freq in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += freq
        words = merged
    return {token: index for index, token in enumerate(vocab_tokens)}, merges


def build_tokenizer(seed: int, size: int = VOCAB_SIZE) -> Any:
    """A byte-level BPE with ChatML specials, wrapped as a transformers fast tokenizer.

    `size` above VOCAB_SIZE pads the vocabulary with entries no merge produces (tokenization is
    unchanged) so that `len(tokenizer)` covers a model's whole vocabulary, as Qwen3.5's own tokenizer
    nearly does: verl's vLLM rollout masks every id past `len(tokenizer)` before sampling while the
    actor normalises over all ids, so a short tokenizer shifts every rollout log-prob by the masked mass.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab, merges = train_bpe(_corpus(seed), VOCAB_SIZE - 256 - len(SPECIAL_TOKENS))
    for index in range(len(vocab), size - len(SPECIAL_TOKENS)):
        vocab[f"<|unused_{index}|>"] = index
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 1024
    return tokenizer


def _text_kwargs(tokenizer: Any, spec: Any) -> dict[str, Any]:
    """The text config of a tiny model from its registry facts (engine.recipes.models), which preflight
    also reads."""
    return {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "layer_types": ["linear_attention", "full_attention"],
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "linear_key_head_dim": spec.linear_head_dim,
        "linear_value_head_dim": spec.linear_head_dim,
        "linear_num_key_heads": spec.linear_key_heads,
        "linear_num_value_heads": spec.linear_value_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        **text_token_ids(tokenizer),
    }


def text_token_ids(tokenizer: Any) -> dict[str, Any]:
    """The text config's token ids (Qwen3.5 has no BOS), shared with bench-gpu's model."""
    return {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
    }


def _vision_kwargs() -> dict[str, Any]:
    return {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 64,
        "num_position_embeddings": 64,
    }


def vision_token_ids(tokenizer: Any) -> dict[str, int]:
    """The VL config's special-token ids, from the project's tokenizer (shared with bench-gpu's model)."""
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in SPECIAL_TOKENS}
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


def build_model(tokenizer: Any, seed: int, spec: ModelSpec) -> Any:
    """Random-init Qwen3.5 (or Qwen3.5-MoE) in the VL layout from a tiny registry entry, seeded."""
    import torch
    from transformers.models import qwen3_5, qwen3_5_moe

    top = vision_token_ids(tokenizer) | {"tie_word_embeddings": False}
    text = _text_kwargs(tokenizer, spec)
    if spec.moe:
        text |= {
            "intermediate_size": 128,
            "moe_intermediate_size": spec.expert_intermediate_size,
            "shared_expert_intermediate_size": 32,
            "num_experts": spec.num_experts,
            "num_experts_per_tok": spec.experts_per_token,
        }
        config = qwen3_5_moe.Qwen3_5MoeConfig(text_config=text, vision_config=_vision_kwargs(), **top)
        model_cls = qwen3_5_moe.Qwen3_5MoeForConditionalGeneration
    else:
        config = qwen3_5.Qwen3_5Config(
            text_config=text | {"intermediate_size": 128}, vision_config=_vision_kwargs(), **top
        )
        model_cls = qwen3_5.Qwen3_5ForConditionalGeneration
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(config).to(getattr(torch, spec.asset_dtype))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.do_sample = True
    return model


def save_model(model: Any, tokenizer: Any, target: Path) -> None:
    """Model + tokenizer into a temp directory beside `target`, renamed over it only when complete."""
    with fsutil.publish_dir(target, replace=True) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)


MANIFEST = "assets.json"  # written last: the seed and where each asset is
OUT_NAMES = ("tiny-qwen35", "tiny-qwen35-moe", "data", MANIFEST)


ASSET_KEYS = {"tiny-qwen35": "dense", "tiny-qwen35-moe": "moe"}  # manifest keys; the rest are named


def build_all(out: Path, seed: int = 0, train_size: int = 256, test_size: int = 32) -> dict[str, str]:
    """Write DIR/<tiny model> for every tiny registry entry and DIR/data/synthetic/{train,test}.parquet."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(seed)
    paths = {}
    for spec in TINY_MODELS:
        key = ASSET_KEYS.get(spec.name, spec.name)
        paths[key] = out / spec.name
        save_model(build_model(tokenizer, seed, spec), tokenizer, paths[key])
    data = out / "data" / "synthetic"
    data.mkdir(parents=True, exist_ok=True)
    write_parquet(make_rows(seed, train_size, "train"), data / "train.parquet")
    write_parquet(make_rows(seed, test_size, "test"), data / "test.parquet")
    written = {key: str(path) for key, path in paths.items()}
    written |= {"train": str(data / "train.parquet"), "test": str(data / "test.parquet")}
    relative = {key: os.path.relpath(path, out) for key, path in written.items()}
    fsutil.atomic_write(
        out / MANIFEST, json.dumps({"seed": seed, "paths": relative}, indent=2, sort_keys=True) + "\n"
    )
    return written


def recipe_sets(out: Path, model: str = "tiny-qwen35") -> list[str]:
    """`--set` items that point a tiny recipe at assets `build_all` wrote into `out`."""
    data = out / "data" / "synthetic"
    return [
        f"model.path={out / model}",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
    ]


def ensure(out: Path, seed: int = 0) -> dict[str, str]:
    """Build the assets unless a manifest with the same seed is already there (used by `run`)."""
    manifest = out / MANIFEST
    if manifest.exists():
        recorded = fsutil.read_json(manifest, "assets manifest", "remove it to rebuild the assets")
        paths = {key: str(out / rel) for key, rel in recorded.get("paths", {}).items()}
        if recorded.get("seed") == seed and paths and all(Path(p).exists() for p in paths.values()):
            return paths
    return build_all(out, seed)


def cli_main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m engine assets", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory to write the assets into")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights, tokenizer and data")
    parser.add_argument("--train-size", type=int, default=256)
    parser.add_argument("--test-size", type=int, default=32)
    args = parser.parse_args(argv)
    if args.train_size < 1 or args.test_size < 1:
        raise UserError("--train-size and --test-size must be positive integers")
    out = fsutil.check_out_dir(args.out, reuse=lambda d: fsutil.foreign_files(d, OUT_NAMES, MANIFEST))
    written = build_all(out.resolve(), args.seed, args.train_size, args.test_size)
    for key, path in written.items():
        print(f"{key:<6} {path}")
    return 0
