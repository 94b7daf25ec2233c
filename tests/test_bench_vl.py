"""tools/bench_vl.py's plumbing on a tiny shape: setup, one run per side, the report. No timing asserts.

Checked: the cached checkpoint, images and rows are made once; both sides read the rows into the same
batch (TRL's vision-language collator and minitrain's `read_sft` + `collate_images`: the same ids, labels,
pixels and grids), so they train the same tokens; a run of each side goes through a fresh subprocess and the
parent reads its step lines, peak RSS and the decoding share.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("minitrain_tools_bench_vl", ROOT / "tools" / "bench_vl.py")
bench_vl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_vl)

TINY = ["--steps", "3", "--batch", "2", "--accum", "1", "--repeats", "1", "--layers", "1", "--dim", "64",
        "--vision-depth", "2", "--vision-dim", "32", "--vocab", "500", "--side", "56"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    a = bench_vl.parse([*TINY, "--cache", str(tmp_path_factory.mktemp("bench_vl"))])
    return a, bench_vl.prepare(a)


def test_prepare_is_cached_and_both_sides_collate_the_same_batch(tiny):
    a, root = tiny
    stamp = (root / "model" / "model.safetensors").stat().st_mtime_ns
    assert bench_vl.prepare(a) == root and (root / "model" / "model.safetensors").stat().st_mtime_ns == stamp
    rows = [json.loads(line) for line in (root / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == a.steps * a.batch * a.accum

    from PIL import Image
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from minitrain.config import SFTConfig
    from minitrain.data.collate import collate_causal
    from minitrain.data.images import collate_images
    from minitrain.data.readers import read_sft
    from minitrain.run import image_rows, load_tokenizer

    trl = DataCollatorForVisionLanguageModeling(bench_vl.processor(root / "model"), assistant_only_loss=True)
    theirs = trl([{**r, "images": [Image.open(p) for p in r["images"]]} for r in rows[:2]])
    cfg = SFTConfig(model=str(root / "model"), data=str(root / "rows.jsonl"), chat_template=str(root / "template.jinja"))
    tok = load_tokenizer(cfg)
    images = image_rows(cfg, tok)
    examples = read_sft(root / "rows.jsonl", tok, max_len=4096, images=images)
    ours = collate_images(list(examples[:2]), lambda ex: collate_causal(ex, tok.pad_id), images.spec)
    for key in ("input_ids", "attention_mask", "labels", "image_grid_thw"):
        assert torch.equal(ours[key], theirs[key]), key
    torch.testing.assert_close(ours["pixel_values"], theirs["pixel_values"], rtol=0, atol=1e-6)
    assert int((ours["labels"] != -100).sum()) > 0


def reported(s: dict) -> bool:
    """Positive figures, or NaN where the tiny run's steps fell in one tick of the CPU clock."""
    rate = s["images_per_cpu_s"]
    return s["peak_rss_mb"] > 50 and (rate > 0 or math.isnan(rate) or math.isinf(rate)) and \
        (0 <= s["decode_share"] <= 1 or not math.isfinite(s["decode_share"]))


def test_a_minitrain_run_is_timed_with_its_decoding(tiny):
    a, root = tiny
    s = bench_vl.run("mt", a, root, rep=0)
    assert s["side"] == "mt" and reported(s) and 0 <= s["wait_share"] < 1  # the loop's wait (data_wait)
    calls = json.loads((Path(a.cache) / "mt-0" / "out" / "decode.json").read_text())
    assert len(calls) >= a.steps * a.batch  # every image of every step decoded through the timed function


@pytest.mark.slow
def test_a_trl_run_is_timed_with_its_decoding(tiny):
    a, root = tiny
    s = bench_vl.run("hf", a, root, rep=1)
    assert s["side"] == "hf" and reported(s)
    assert json.loads((Path(a.cache) / "hf-1" / "out" / "decode.json").read_text())
