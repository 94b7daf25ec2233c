"""minitrain plot: a real PNG of several runs, run names from config.json, EMA by hand, one-line errors."""

from __future__ import annotations

import importlib
import json
import math
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def load_tool():
    mod = importlib.import_module("minitrain.commands.plot")
    return mod


plot = load_tool()


def make_run(folder: Path, model: str, lr: float, r: int, steps: int = 40, scale: float = 1.0) -> Path:
    """A run folder as the recipes leave it: config.json and metrics.jsonl with eval rows every 10 steps."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model": model, "lr": lr, "lora_r": r, "out": str(folder)}))
    rows = []
    for s in range(1, steps + 1):
        row = {"step": s, "loss": scale * (3.0 / math.sqrt(s) + 0.2 * math.sin(s)), "lr": lr * min(1.0, s / 5)}
        if s % 10 == 0:
            row.update({"eval/loss": scale * 2.5 / math.sqrt(s), "eval/rougeL": 0.1 + 0.004 * s / scale})
        rows.append(row)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def png_chunks(data: bytes) -> dict[bytes, bytes]:
    """The PNG's chunks by type (first of each), each CRC checked."""
    assert data[:8] == PNG_SIGNATURE
    chunks, pos = {}, 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, kind
        chunks.setdefault(kind, body)
        pos += 12 + length
    return chunks


def run_tool(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "minitrain", "plot", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True)


def test_png_of_three_runs_with_subplots(tmp_path):
    import matplotlib.image

    runs = [make_run(tmp_path / "a", "/models/flan-t5-small", 5e-5, 16),
            make_run(tmp_path / "b", "/models/flan-t5-base/", 5e-5, 16, scale=1.5),
            make_run(tmp_path / "c", "/models/t5-base", 1e-4, 8, scale=0.7)]
    out = tmp_path / "fig" / "curves.png"
    p = run_tool(*runs, "--metric", "loss,eval/rougeL", "--metric", "lr", "--smooth", "0.8", "--out", out)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"wrote {out}"

    data = out.read_bytes()
    chunks = png_chunks(data)
    width, height = struct.unpack(">II", chunks[b"IHDR"][:8])
    assert (width, height) == (round(plot.WIDTH_IN * 150), round(3 * plot.HEIGHT_PER_METRIC_IN * 150))
    ppm_x, ppm_y, unit = struct.unpack(">IIB", chunks[b"pHYs"])
    assert unit == 1 and ppm_x == ppm_y == round(150 / 0.0254)  # 150 dpi in pixels per metre

    img = matplotlib.image.imread(out)[..., :3]  # (H, W, RGB) floats in [0, 1]
    assert img.shape[:2] == (height, width)
    colors = {tuple(round(float(c) * 255) for c in px) for px in img.reshape(-1, 3)[::7]}
    assert len(colors) > 50, "a blank or near-blank image"
    for hex_color in ("#1f77b4", "#ff7f0e", "#2ca02c"):  # C0, C1, C2: one per run
        want = tuple(int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
        close = ((abs(img * 255 - want)).max(axis=-1) < 8).sum()
        assert close > 200, f"run colour {hex_color} is (almost) absent: {close} pixels"


def test_run_names_from_config(tmp_path):
    a = make_run(tmp_path / "a", "/models/flan-t5-base/", 5e-5, 16)
    b = make_run(tmp_path / "b", "/models/flan-t5-base", 5e-5, 16)
    c = tmp_path / "c"
    c.mkdir()
    assert plot.run_label(a) == "flan-t5-base lr=5e-05 r=16"
    assert plot.run_label(c) == "c"  # no config.json: the folder name
    assert plot.labels_for([a, b], None) == ["flan-t5-base lr=5e-05 r=16 (a)", "flan-t5-base lr=5e-05 r=16 (b)"]
    assert plot.labels_for([a, b], ["small", "base"]) == ["small", "base"]


def test_ema_by_hand():
    # debiased EMA = weighted mean with weights w**age: (x3 + w x2 + w^2 x1) / (1 + w + w^2)
    w = 0.5
    assert plot.ema([1.0, 2.0, 3.0], w) == pytest.approx([1.0, (2 + 0.5) / 1.5, (3 + 1 + 0.25) / 1.75])
    assert plot.ema([4.0, float("nan"), 2.0], 0.0) == [4.0, 4.0, 2.0]
    assert plot.ema([1.0, 5.0], 0.0) == [1.0, 5.0]  # weight 0: the raw curve


def test_series_keeps_rows_that_logged_the_metric(tmp_path):
    run = make_run(tmp_path / "a", "m", 1e-4, 4, steps=25)
    steps, values = plot.series(plot.read_metrics(run), "eval/rougeL", run)
    assert steps == [10, 20] and values == pytest.approx([0.14, 0.18])
    assert plot.split_metrics(["loss,eval/rougeL", "lr", "loss"]) == ["loss", "eval/rougeL", "lr"]
    assert plot.split_metrics(None) == ["loss"]


def one_error(p: subprocess.CompletedProcess, needle: str) -> None:
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in p.stderr, p.stderr
    assert needle in lines[0], lines[0]


def test_errors_are_one_line_and_write_nothing(tmp_path):
    good = make_run(tmp_path / "good", "m", 1e-4, 4)
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "x.png"
    one_error(run_tool(good, empty, "--out", out), f"{empty}: holds no metrics.jsonl")
    one_error(run_tool(good, tmp_path / "nowhere", "--out", out), "nowhere: is not a folder")
    one_error(run_tool(good, "--metric", "eval/bleu", "--out", out),
              f"{good}: metrics.jsonl has no 'eval/bleu' — choose among eval/loss, eval/rougeL, loss, lr")
    one_error(run_tool(good, good, "--label", "one", "--out", out), "--label: 1 labels for 2 runs")
    one_error(run_tool(good, "--smooth", "1", "--out", out), "--smooth 1: must be in [0, 1)")
    (empty / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": \n')
    one_error(run_tool(empty, "--out", out), f"{empty / 'metrics.jsonl'}:2: not JSON")
    assert not out.exists()


def test_missing_matplotlib_says_how_to_install(tmp_path, monkeypatch, capsys):
    run = make_run(tmp_path / "a", "m", 1e-4, 4)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert plot.main([str(run), "--out", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err == "error: matplotlib: not installed — pip install 'minitrain[plot]'\n"
    assert not (tmp_path / "x.png").exists()
