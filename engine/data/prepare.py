"""`python -m engine prepare-data`: raw geo3k / gsm8k / synthetic data to verl RL parquet + manifest.

verl's RL trainer reads rows of {data_source, prompt (chat messages), ability, reward_model{style,
ground_truth}, extra_info} and, for vision data, `images`. `data_source` picks verl's built-in scorer
(`hiyouga/geometry3k` -> geo3k via mathruler, `openai/gsm8k` -> strict `####`). Raw data comes from a
local copy (air-gapped clusters) or, online, from the Hub through the datasets library. Every output
is listed with its row count and sha256 in manifest.json, which is written last: a directory without
a manifest is never a finished one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from engine import fsutil
from engine.errors import ArgumentParser, UserError
from engine.hashing import sha256_file

SPLITS = ("train", "test")
MANIFEST = "manifest.json"  # written last: rows and sha256 of every output
GEO3K_SOURCE = "hiyouga/geometry3k"
GSM8K_SOURCE = "openai/gsm8k"
GEO3K_INSTRUCTION = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final "
    "answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST "
    "BE put in \\boxed{}."
)
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
IMAGE_TOKEN = "<image>"
_GSM8K_ANSWER = re.compile(r"####\s*(-?[0-9][0-9.,]*)")


def _image_struct(image: Any, raw_root: Path | None, where: str) -> dict[str, Any]:
    """Normalise one raw image (HF Image storage struct, path or PIL image) to {bytes, path}."""
    if isinstance(image, dict):
        data, path = image.get("bytes"), image.get("path")
        if data is None and path:
            candidate = Path(path) if Path(path).is_absolute() or raw_root is None else raw_root / path
            if not candidate.is_file():
                raise UserError(f"{where}: image has no bytes and {candidate} is missing; embed the bytes")
            data = candidate.read_bytes()
        if not data:
            raise UserError(f"{where}: image has neither bytes nor a path; check the raw `images` column")
        return {"bytes": bytes(data), "path": path}
    if hasattr(image, "save"):  # a PIL image (datasets decoded it)
        import io

        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return {"bytes": buffer.getvalue(), "path": None}
    raise UserError(f"{where}: unsupported image value of type {type(image).__name__}")


def _with_image_tokens(problem: str, n_images: int, where: str) -> str:
    """verl maps images to `<image>` placeholders in order, so their counts must agree."""
    found = problem.count(IMAGE_TOKEN)
    if found > n_images:
        raise UserError(f"{where}: problem has {found} {IMAGE_TOKEN} tokens but only {n_images} images")
    return IMAGE_TOKEN * (n_images - found) + problem


def _require(row: dict[str, Any], columns: Iterable[str], where: str) -> None:
    missing = [c for c in columns if c not in row or row[c] is None]
    if missing:
        raise UserError(f"{where}: raw row lacks column(s) {missing}; is this the right --dataset?")


def geo3k_row(raw: dict[str, Any], split: str, index: int, raw_root: Path | None = None) -> dict[str, Any]:
    """One `hiyouga/geometry3k` row (problem, answer, images) as a verl RL row."""
    where = f"geo3k {split}[{index}]"
    _require(raw, ("problem", "answer", "images"), where)
    images = [_image_struct(img, raw_root, where) for img in raw["images"]]
    problem = _with_image_tokens(str(raw["problem"]), len(images), where)
    answer = str(raw["answer"])
    return {
        "data_source": GEO3K_SOURCE,
        "prompt": [{"role": "user", "content": f"{problem} {GEO3K_INSTRUCTION}"}],
        "images": images,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": str(raw["problem"])},
    }


def gsm8k_answer(solution: str, where: str = "gsm8k") -> str:
    """The final number after `####`, commas removed (what verl's gsm8k scorer compares against)."""
    match = _GSM8K_ANSWER.search(solution)
    if match is None:
        raise UserError(f"{where}: answer has no '#### <number>' line; is this the gsm8k 'main' config?")
    return match.group(1).replace(",", "").rstrip(".")


def gsm8k_row(raw: dict[str, Any], split: str, index: int, raw_root: Path | None = None) -> dict[str, Any]:
    """One `openai/gsm8k` (config main) row (question, answer) as a verl RL row."""
    where = f"gsm8k {split}[{index}]"
    _require(raw, ("question", "answer"), where)
    question, solution = str(raw["question"]), str(raw["answer"])
    truth = gsm8k_answer(solution, where)
    return {
        "data_source": GSM8K_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, "answer": solution, "question": question},
    }


CONVERTERS: dict[str, tuple[str, str | None, Callable[..., dict[str, Any]]]] = {
    # dataset -> (hub name, hub config, row converter)
    "geo3k": (GEO3K_SOURCE, None, geo3k_row),
    "gsm8k": (GSM8K_SOURCE, "main", gsm8k_row),
}


def _split_files(root: Path, split: str, config: str | None) -> list[Path]:
    """Parquet/JSONL files of one split in a Hub snapshot or a plain folder (`<split>*.parquet`)."""
    found: list[Path] = []
    for pattern in (f"{split}.parquet", f"{split}-*.parquet", f"{split}.jsonl", f"{split}-*.jsonl"):
        found.extend(p for p in root.rglob(pattern) if p.is_file())
    if config is not None and any(config in p.relative_to(root).parts for p in found):
        found = [p for p in found if config in p.relative_to(root).parts]
    return sorted(set(found))


def _read_files(files: list[Path]) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    for path in files:
        if path.suffix == ".parquet":
            try:
                rows.extend(pq.read_table(path).to_pylist())
            except (pa.ArrowException, OSError) as err:
                first = str(err).splitlines()[0] if str(err) else type(err).__name__
                raise UserError(
                    f"--raw {path}: not a readable parquet file ({first}); re-download it"
                ) from None
            continue
        text = fsutil.read_text(path, "--raw", "JSONL means one UTF-8 JSON object per line")
        for number, line in enumerate(text.splitlines(), 1):
            try:
                row = json.loads(line) if line.strip() else None
            except json.JSONDecodeError as err:
                raise UserError(
                    f"--raw {path}:{number}: not JSON ({err.msg}); JSONL is one object per line"
                ) from None
            if row is not None and not isinstance(row, dict):
                raise UserError(f"--raw {path}:{number}: a {type(row).__name__}, not a JSON object per line")
            if row is not None:
                rows.append(row)
    return rows


def load_raw_local(root: Path, config: str | None) -> dict[str, list[dict[str, Any]]]:
    """Raw splits from a `save_to_disk` folder or a folder of per-split parquet/jsonl files."""
    if not root.exists():
        raise UserError(f"--raw {root}: no such file or directory; point it at the downloaded raw dataset")
    if (root / "dataset_dict.json").is_file():
        import datasets

        try:
            loaded = datasets.load_from_disk(str(root))
        except Exception as err:  # a damaged save_to_disk folder, whatever datasets raises for it
            raise UserError(
                f"--raw {root}: datasets cannot load it ({type(err).__name__}); re-save it"
            ) from None
        return {s: loaded[s].with_format("arrow")[:].to_pylist() for s in SPLITS if s in loaded}
    splits = {s: _read_files(_split_files(root, s, config)) for s in SPLITS}
    missing = [s for s, rows in splits.items() if not rows]
    if missing:
        raise UserError(f"--raw {root}: no rows for split(s) {missing} (expected {missing[0]}*.parquet)")
    return splits


def load_raw_hub(name: str, config: str | None) -> dict[str, list[dict[str, Any]]]:
    """Raw splits from the Hub (online only), kept in Arrow storage so images stay undecoded bytes."""
    import datasets

    try:
        loaded = datasets.load_dataset(name, config)
    except Exception as err:  # network, auth or name problems all end the same way for the user
        raise UserError(f"--hub: cannot load {name} ({type(err).__name__}); use --raw PATH offline") from err
    return {s: loaded[s].with_format("arrow")[:].to_pylist() for s in SPLITS}


def _write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    """Rows to parquet with datasets' features metadata, so `images` load back as HF Images."""
    import datasets

    datasets.disable_progress_bars()
    table = datasets.Dataset.from_list(rows)
    if "images" in table.column_names:
        table = table.cast_column("images", datasets.List(datasets.Image()))
    table.to_parquet(str(path))


OUT_FILES = (*(f"{split}.parquet" for split in SPLITS), MANIFEST)


def check_out(out: Path) -> Path:
    """`--out` may hold other files (left alone); files of ours only when a manifest says they are."""
    return fsutil.check_out_dir(out, reuse=lambda d: fsutil.foreign_files(d, OUT_FILES, MANIFEST))


def write_dataset(
    splits: dict[str, list[dict[str, Any]]], out: Path, dataset: str, source: dict[str, Any]
) -> dict[str, Any]:
    """Write train/test parquet and the manifest into `out`, the manifest last; returns the manifest.

    Only those three files are replaced: anything else in `out` stays.
    """
    for split in SPLITS:
        if not splits[split]:
            raise UserError(f"{dataset}: split {split!r} is empty; raw data needs train and test rows")
    with fsutil.staged(out, last=(MANIFEST,)) as tmp:
        files: dict[str, Any] = {}
        for split in SPLITS:
            rows = splits[split]
            target = tmp / f"{split}.parquet"
            _write_parquet(rows, target)
            size = target.stat().st_size
            files[target.name] = {"rows": len(rows), "sha256": sha256_file(target), "bytes": size}
        manifest = {
            "dataset": dataset,
            "data_source": rows[0]["data_source"],
            "source": source,
            "columns": sorted(rows[0]),
            "files": files,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def _convert(dataset: str, raw: dict[str, list[dict[str, Any]]], raw_root: Path | None) -> dict[str, list]:
    from rich.progress import Progress

    convert = CONVERTERS[dataset][2]
    out: dict[str, list[dict[str, Any]]] = {}
    with Progress(transient=True) as progress:
        for split in SPLITS:
            task = progress.add_task(f"{dataset} {split}", total=len(raw[split]))
            rows = []
            for index, row in enumerate(raw[split]):
                rows.append(convert(row, split, index, raw_root))
                progress.advance(task)
            out[split] = rows
    return out


def _raw_fingerprint(root: Path) -> list[dict[str, str]]:
    """sha256 of every raw file, so the manifest pins exactly which raw copy was converted."""
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    names = [str(p.relative_to(root)) if p != root else p.name for p in files]
    return [{"path": name, "sha256": sha256_file(p)} for name, p in zip(names, files, strict=True)]


def _synthetic(out: Path, seed: int, train_size: int, test_size: int) -> dict[str, Any]:
    """The tiny recipes' arithmetic set, from the same generator as `python -m engine assets`."""
    from engine.data import assets

    sizes = {"train": train_size, "test": test_size}
    splits = {split: assets.make_rows(seed, sizes[split], split) for split in SPLITS}
    return write_dataset(splits, out, "synthetic", {"kind": "synthetic", "seed": seed, "rows": sizes})


def prepare(
    dataset: str,
    out: Path,
    raw: Path | None = None,
    hub: bool = False,
    seed: int = 0,
    sizes: tuple[int, int] = (256, 32),
) -> dict[str, Any]:
    """Convert one dataset into `out`; exactly one of `raw`/`hub` for geo3k and gsm8k."""
    check_out(out)
    if dataset == "synthetic":
        if raw is not None or hub:
            raise UserError("--dataset synthetic is generated; drop --raw/--hub")
        if min(sizes) < 1:
            raise UserError("--train-size and --test-size must be positive integers")
        return _synthetic(out, seed, *sizes)
    if dataset not in CONVERTERS:
        raise UserError(f"--dataset {dataset!r}: unknown; choose geo3k, gsm8k or synthetic")
    if (raw is None) == (not hub):
        raise UserError(f"--dataset {dataset}: give one of --raw PATH (offline copy) or --hub (online)")
    name, config, _ = CONVERTERS[dataset]
    if raw is not None:
        raw_splits = load_raw_local(raw, config)
        source: dict[str, Any] = {"kind": "local", "path": str(raw.resolve()), "files": _raw_fingerprint(raw)}
    else:
        raw_splits = load_raw_hub(name, config)
        source = {"kind": "hub", "name": name, "config": config}
    converted = _convert(dataset, raw_splits, raw if raw is not None and raw.is_dir() else None)
    return write_dataset(converted, out, dataset, source)


def cli_main(argv: list[str]) -> int:
    summary = __doc__.splitlines()[0]
    parser = ArgumentParser(prog="python -m engine prepare-data", description=summary)
    parser.add_argument("--dataset", required=True, choices=["geo3k", "gsm8k", "synthetic"])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--raw", type=Path, help="local raw dataset (Hub snapshot, save_to_disk, or parquet)")
    where.add_argument("--hub", action="store_true", help="download the raw dataset with `datasets` (online)")
    parser.add_argument("--out", type=Path, required=True, help="folder for train/test parquet + manifest")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic set")
    parser.add_argument("--train-size", type=int, default=256, help="synthetic train rows")
    parser.add_argument("--test-size", type=int, default=32, help="synthetic test rows")
    args = parser.parse_args(argv)
    sizes = (args.train_size, args.test_size)
    manifest = prepare(args.dataset, args.out, raw=args.raw, hub=args.hub, seed=args.seed, sizes=sizes)
    counts = ", ".join(f"{k} {v['rows']} rows" for k, v in manifest["files"].items())
    print(f"prepare-data: {args.dataset} -> {args.out} ({counts})")
    return 0
