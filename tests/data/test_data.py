"""prepare-data on small raw datasets built here in the Hub schemas (geo3k with real PNG images, gsm8k)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
from PIL import Image

from engine.data import prepare
from engine.errors import UserError
from tests.conftest import ROOT


def _png(color: tuple[int, int, int], size: tuple[int, int] = (12, 8)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def _geo3k_raw(root: Path) -> Path:
    """A `hiyouga/geometry3k` Hub snapshot: data/<split>-00000-of-00001.parquet, images as HF Images."""
    features = datasets.Features(
        {
            "images": datasets.List(datasets.Image()),
            "problem": datasets.Value("string"),
            "answer": datasets.Value("string"),
        }
    )
    splits = {
        "train": [
            ("<image>Find x. Round to the nearest tenth.", "12.5", [(255, 0, 0)]),
            ("Find the area of the figure.", "24", [(0, 255, 0)]),  # no token: prep must add it
            ("<image>Find y.", "3", [(0, 0, 255)]),
        ],
        "test": [("<image>Find z.", "7", [(9, 9, 9)])],
    }
    (root / "data").mkdir(parents=True)
    for split, rows in splits.items():
        table = {
            "images": [[{"bytes": _png(c), "path": None} for c in colors] for _, _, colors in rows],
            "problem": [p for p, _, _ in rows],
            "answer": [a for _, a, _ in rows],
        }
        ds = datasets.Dataset.from_dict(table, features=features)
        ds.to_parquet(str(root / "data" / f"{split}-00000-of-00001.parquet"))
    return root


def _gsm8k_raw(root: Path) -> Path:
    """An `openai/gsm8k` snapshot with both configs; only `main` must be read."""
    main = {
        "train": [
            ("Tom has 3 apples and buys 1,200 more. How many?", "3 + 1200 = 1203\n#### 1,203"),
            ("What is 10 - 12?", "10 - 12 = -2\n#### -2"),
        ],
        "test": [("Half of 9?", "9 / 2 = 4.5\n#### 4.5")],
    }
    socratic = {"train": [("Q?", "#### 1")], "test": []}
    for config, rows_by_split in {"main": main, "socratic": socratic}.items():
        (root / config).mkdir(parents=True)
        for split, rows in rows_by_split.items():
            if rows:
                columns = {"question": [q for q, _ in rows], "answer": [a for _, a in rows]}
                ds = datasets.Dataset.from_dict(columns)
                ds.to_parquet(str(root / config / f"{split}-00000-of-00001.parquet"))
    return root


def test_geo3k_conversion_matches_verl_schema_and_scores(tmp_path: Path) -> None:
    raw = _geo3k_raw(tmp_path / "raw")
    out = tmp_path / "geo3k"
    manifest = prepare.prepare("geo3k", out, raw=raw)
    assert {k: v["rows"] for k, v in manifest["files"].items()} == {"train.parquet": 3, "test.parquet": 1}
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == prepare.sha256_file(out / name)
    assert {f["path"] for f in manifest["source"]["files"]} == {
        "data/train-00000-of-00001.parquet",
        "data/test-00000-of-00001.parquet",
    }
    # Read back the way verl's RLHFDataset does (datasets parquet loader).
    train = datasets.load_dataset("parquet", data_files=str(out / "train.parquet"))["train"]
    expected = {"data_source", "prompt", "images", "ability", "reward_model", "extra_info"}
    assert set(train.column_names) == expected
    colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    for row, color in zip(train, colors, strict=True):
        content = row["prompt"][0]["content"]
        assert row["data_source"] == "hiyouga/geometry3k"
        assert content.count("<image>") == len(row["images"]) == 1
        assert content.startswith("<image>") and "\\boxed{}" in content
        image = row["images"][0]
        assert isinstance(image, Image.Image) and image.size == (12, 8)
        assert image.convert("RGB").getpixel((0, 0)) == color
    assert train[1]["extra_info"]["question"] == "Find the area of the figure."
    # verl's own geo3k scorer (needs mathruler) accepts the stored ground truth.
    from verl.utils.reward_score import default_compute_score

    truth = train[0]["reward_model"]["ground_truth"]
    good = default_compute_score("hiyouga/geometry3k", f"<think>x</think> \\boxed{{{truth}}}", truth)
    bad = default_compute_score("hiyouga/geometry3k", "<think>x</think> \\boxed{99}", truth)
    assert good == pytest.approx(1.0) and bad == pytest.approx(0.1)


def test_gsm8k_conversion_reads_main_config_and_scores(tmp_path: Path) -> None:
    raw = _gsm8k_raw(tmp_path / "raw")
    out = tmp_path / "gsm8k"
    manifest = prepare.prepare("gsm8k", out, raw=raw)
    assert manifest["files"]["train.parquet"]["rows"] == 2  # not the socratic row
    rows = datasets.load_dataset("parquet", data_files=str(out / "train.parquet"))["train"]
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["1203", "-2"]
    assert "images" not in rows.column_names
    assert rows[0]["prompt"][0]["content"].endswith('output the final answer after "####".')
    from verl.utils.reward_score import default_compute_score

    assert default_compute_score("openai/gsm8k", "so #### 1203", "1203") == 1.0
    assert default_compute_score("openai/gsm8k", "so #### 1202", "1203") == 0.0


def test_same_input_gives_same_bytes(tmp_path: Path) -> None:
    raw = _gsm8k_raw(tmp_path / "raw")
    first = prepare.prepare("gsm8k", tmp_path / "a", raw=raw)
    second = prepare.prepare("gsm8k", tmp_path / "b", raw=raw)
    assert first["files"] == second["files"]


def test_synthetic_set_and_rerun_replace_only_its_own_files(tmp_path: Path) -> None:
    out = tmp_path / "syn"
    (out).mkdir()
    (out / "unrelated.txt").write_text("theirs")
    prepare.prepare("synthetic", out, seed=3, sizes=(4, 2))
    manifest = prepare.prepare("synthetic", out, seed=3, sizes=(8, 2))  # a rerun replaces its own files
    assert manifest["files"]["train.parquet"]["rows"] == 8
    names = sorted(p.name for p in out.iterdir())
    assert names == ["manifest.json", "test.parquet", "train.parquet", "unrelated.txt"]
    assert (out / "unrelated.txt").read_text() == "theirs"
    assert not [p for p in (*tmp_path.iterdir(), *out.iterdir()) if p.name.startswith(".")]  # no temps


def test_bad_raw_rows_name_the_row(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    for split, answer in (("train", "no marker"), ("test", "#### 1")):
        datasets.Dataset.from_dict({"question": ["q"], "answer": [answer]}).to_parquet(
            str(raw / f"{split}.parquet")
        )
    with pytest.raises(UserError, match=r"gsm8k train\[0\]: answer has no '#### <number>'"):
        prepare.prepare("gsm8k", tmp_path / "out", raw=raw)
    with pytest.raises(UserError, match=r"geo3k train\[0\]: raw row lacks column\(s\) \['problem'"):
        prepare.prepare("geo3k", tmp_path / "out", raw=raw)
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="has 2 <image> tokens but only 0 images"):
        prepare.geo3k_row({"problem": "<image><image>", "answer": "1", "images": []}, "train", 0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dataset", "geo3k", "--out", "X"], "give one of --raw PATH"),
        (["--dataset", "gsm8k", "--raw", "/no/such/raw", "--out", "X"], "--raw /no/such/raw: no such file"),
        (["--dataset", "synthetic", "--hub", "--out", "X"], "synthetic is generated"),
    ],
)
def test_cli_bad_input_is_one_line(tmp_path: Path, argv: list[str], message: str) -> None:
    argv = [str(tmp_path / "out") if a == "X" else a for a in argv]
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "prepare-data", *argv], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and message in proc.stderr
    assert not (tmp_path / "out").exists()


def test_cli_writes_manifest(tmp_path: Path) -> None:
    out = tmp_path / "d"
    args = ["--dataset", "synthetic", "--train-size", "4", "--test-size", "2", "--out", str(out)]
    cmd = [sys.executable, "-m", "engine", "prepare-data", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "manifest.json").read_text())["files"]["test.parquet"]["rows"] == 2
