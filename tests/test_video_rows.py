"""Video rows (`minitrain/data/videos.py`, `read_sft`) and SFT on them from the command line, on tiny Qwen2.5-VL
and Qwen3-VL folders (tests/test_image_rows.py's, with a `<|video_pad|>` token and a video_preprocessor_config.json).

Rows in TRL's shape (content parts `{"type": "video", "video": [frame paths]}`, an animated GIF) and with a
`videos` column; paths relative to the data file's folder; a video beside an image. Checked: each video's
placeholder expanded to its tokens (Qwen3-VL: with its timestamps), video tokens and the prompt masked, the
examples keeping the frame paths; the loss of a collated batch equals transformers' on the same ids, pixels,
grids and seconds; LoRA SFT from the CLI with the tower frozen; one line and exit 2, nothing written, for a missing
frame (file and row), a video for a checkpoint without a video token, more placeholders than videos, an .mp4.
Packed video rows train as padded ones.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_image_rows import REPO, hf_class, vl_folder

import models
from minitrain.cli import run_cli
from minitrain.data.collate import IGNORE_INDEX, collate_causal
from minitrain.data.images import collate_images
from minitrain.data.readers import read_sft
from minitrain.data.videos import VideoRows
from minitrain.errors import UserError
from minitrain.objectives.sft import sft
from minitrain.run import image_rows
from minitrain.text.tokenizer import Tokenizer
from minitrain.weights import load_pretrained

# patches of 4 pixels, merge 2: frames resized to multiples of 8 pixels within the bounds (Qwen3-VL's over all frames)
VIDEO = {"Qwen2.5-VL": {"size": {"shortest_edge": 64, "longest_edge": 32 * 32}, "patch_size": 4},
         "Qwen3-VL": {"size": {"shortest_edge": 64, "longest_edge": 32 * 32 * 4}, "patch_size": 4,
                      "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}}
FAMILY = {"qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL"}


def video(path) -> dict:
    return {"type": "video", "video": path}


def text(s: str) -> dict:
    return {"type": "text", "text": s}


def write_rows(root: Path) -> Path:
    """root/clip/f0..f2.png (3 frames of 20 x 28), root/clip/g0..g3.png (4 of 16 x 16), root/clip/spin.gif (2 frames
    of 12 x 20), root/img/a.png; the rows name them relative to root."""
    rng = np.random.default_rng(0)
    (root / "clip").mkdir(parents=True)
    (root / "img").mkdir()
    for name, n, (h, w) in (("f", 3, (20, 28)), ("g", 4, (16, 16))):
        for k in range(n):
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / "clip" / f"{name}{k}.png")
    spin = [Image.fromarray((rng.integers(0, 4, (12, 20, 3)) * 80).astype(np.uint8)) for _ in range(2)]
    spin[0].save(root / "clip" / "spin.gif", save_all=True, append_images=spin[1:], duration=500)
    Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)).save(root / "img" / "a.png")
    frames = [f"clip/f{k}.png" for k in range(3)]
    rows = [
        {"messages": [{"role": "user", "content": [video(frames), text("What moves?")]},
                      {"role": "assistant", "content": "The ball."}]},
        {"videos": [[f"clip/g{k}.png" for k in range(4)]],
         "messages": [{"role": "user", "content": "Describe the clip."}, {"role": "assistant", "content": "Snow."}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "img/a.png"}, text("Is it in "),
                                                   {**video("clip/spin.gif"), "fps": 1}, text("?")]},
                      {"role": "assistant", "content": "Yes."}]},
        {"messages": [{"role": "user", "content": "No clip here."}, {"role": "assistant", "content": "Fine."}]},
    ]
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module", params=list(FAMILY))
def vlm(request, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp(f"video_rows_{request.param}")
    return {"root": root, "model": vl_folder(root / "model", request.param, VIDEO[FAMILY[request.param]]),
            "data": write_rows(root / "data"), "family": request.param}


class Cfg:
    def __init__(self, model):
        self.model = model


def rows_of(vlm):
    tok = Tokenizer.from_folder(vlm["model"])
    images = image_rows(Cfg(vlm["model"]), tok)
    return read_sft(vlm["data"], tok, max_len=512, images=images), images, tok


def test_rows_expand_videos_and_mask_them(vlm):
    examples, images, tok = rows_of(vlm)
    videos = images.videos
    assert isinstance(videos, VideoRows) and videos.placeholder == "<|vision_start|><|video_pad|><|vision_end|>"
    qwen3 = vlm["family"] == "qwen3_vl"
    # 3 frames of 20 x 28 -> 16 x 32 (multiples of 8, halves to even): 2 temporal patches of 4 x 8 patches, 8 tokens
    # each; 4 frames of 16 x 16: 2 of 4 x 4; the GIF's 2 frames of 12 x 20 -> 16 x 16: 1 of 4 x 4
    counts = [ex["input_ids"].count(videos.pad) for ex in examples]
    assert counts == [2 * 8, 2 * 4, 4, 0]
    data = vlm["data"].parent
    assert [VideoRows.files(e) for e in examples[0]["videos"]] == [([data / f"clip/f{k}.png" for k in range(3)], 2.0)]
    assert VideoRows.files(examples[2]["videos"][0]) == (data / "clip/spin.gif", 1.0)
    assert examples[2]["images"] == [str(data / "img/a.png")] and "videos" not in examples[3]
    for ex in examples:
        ids, labels = ex["input_ids"], ex["labels"]
        target = tok.decode([i for i, label in zip(ids, labels) if label != IGNORE_INDEX], skip_special=False)
        assert target.replace("<|im_end|>", "").strip() in ("The ball.", "Snow.", "Yes.", "Fine.")
    shown = tok.decode(examples[1]["input_ids"], skip_special=False)
    if qwen3:  # each temporal patch after its time (frames 0, 1 and 2, 3 at 2 a second: 0.25 s and 1.25 s)
        pads = "<|video_pad|>" * 4
        assert ("<|im_start|>user\n<|vision_start|><0.2 seconds><|vision_start|>" + pads + "<|vision_end|><1.2 seconds>"
                "<|vision_start|>" + pads + "<|vision_end|><|vision_end|>Describe") in shown
    else:  # the videos column goes before the first user message's text
        assert shown.startswith("<|im_start|>user\n<|vision_start|>" + "<|video_pad|>" * 8 + "<|vision_end|>Describe")


def test_collated_loss_equals_transformers(vlm):
    examples, images, tok = rows_of(vlm)
    batch = collate_images(examples, lambda ex: collate_causal(ex, tok.pad_id), images.spec, videos=images.videos)
    assert batch["video_grid_thw"].tolist() == [[2, 4, 8], [2, 4, 4], [1, 4, 4]]
    assert batch["second_per_grid_ts"].tolist() == [1.0, 1.0, 2.0]
    ours = load_pretrained(vlm["model"], models.from_hf_config).eval()
    hf = hf_class(vlm["family"]).from_pretrained(vlm["model"], dtype=torch.float32).eval()
    ids = batch["input_ids"]
    with torch.no_grad():
        loss_sum, count, _ = sft(ours, batch)
        ref = hf(input_ids=ids, attention_mask=batch["attention_mask"], labels=batch["labels"],
                 pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                 pixel_values_videos=batch["pixel_values_videos"], video_grid_thw=batch["video_grid_thw"],
                 second_per_grid_ts=batch["second_per_grid_ts"],
                 mm_token_type_ids=(ids == images.token_id).long() + 2 * (ids == images.videos.pad).long()).loss
    assert abs(float(loss_sum / count) - float(ref)) <= 1e-5 * float(ref)


def test_the_token_store_keeps_video_rows_as_the_reader_makes_them(vlm, tmp_path):
    """The store keeps each video as its frame paths and fps (never pixels), equal to the reader's rows; it records
    the frame files as it does images (a changed frame is a new build)."""
    from minitrain.data import store_build
    from minitrain.data.store import read_image_files

    tok = Tokenizer.from_folder(vlm["model"])
    images = image_rows(Cfg(vlm["model"]), tok)
    data = str(vlm["data"])
    ref = read_sft(data, tok, max_len=512, images=images)
    store = store_build.open_or_build(tmp_path / "cache", [data], "sft", read_sft, tok,
                                      {"max_len": 512, "images": images}, workers=1)
    assert list(store) == list(ref) and store.carries("videos").tolist() == [True, True, True, False]
    root = vlm["data"].parent
    assert {str(root / "clip" / f"f{k}.png") for k in range(3)} | {str(root / "clip/spin.gif")} <= set(
        read_image_files(store.folder))


def test_lora_sft_from_the_cli_with_the_tower_frozen(vlm, capsys):
    out = vlm["root"] / "out"
    code = run_cli([str(REPO / "recipes" / "sft.py"), f"model={vlm['model']}", f"data={vlm['data']}", f"out={out}",
                    "max_steps=2", "batch_size=2", "lora_r=4", "lora_alpha=8", "device=cpu", "max_len=512"])
    log, err = capsys.readouterr()
    assert code == 0, err
    assert "audit: healthy" in log + err and "visual" not in log + err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
    from safetensors import safe_open

    with safe_open(next(out.rglob("adapter_model.safetensors")), "pt") as f:
        keys = list(f.keys())
    assert keys and not [k for k in keys if "visual" in k]


def test_rows_with_videos_and_no_image_train_from_the_cli(vlm, tmp_path, capsys):
    """Video rows beside text rows (no image anywhere): the audit's short example keeps its video whole, and the
    frames are decoded ahead of the step (`data_wait` logged)."""
    rows = [json.loads(line) for line in vlm["data"].read_text().splitlines()]
    data = vlm["data"].parent / "no_images.jsonl"
    data.write_text("".join(json.dumps(rows[i]) + "\n" for i in (0, 1, 3)))
    out = tmp_path / "out"
    code = run_cli([str(REPO / "recipes" / "sft.py"), f"model={vlm['model']}", f"data={data}", f"out={out}",
                    "max_steps=2", "batch_size=1", "lora_r=4", "device=cpu", "max_len=512"])
    log, err = capsys.readouterr()
    assert code == 0, err
    assert "audit: healthy" in log + err
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all("data_wait" in m for m in metrics)


def test_full_finetuning_on_video_rows_trains_the_tower(vlm, tmp_path, capsys):
    """finetune=full on video rows with no image: the audit reaches the tower through a video, one step changes it,
    and the written folder keeps the video processor's config."""
    rows = [json.loads(line) for line in vlm["data"].read_text().splitlines()]
    data = vlm["data"].parent / "videos_only.jsonl"
    data.write_text("".join(json.dumps(rows[i]) + "\n" for i in (0, 1)))
    out = tmp_path / "full"
    code = run_cli([str(REPO / "recipes" / "sft.py"), f"model={vlm['model']}", f"data={data}", f"out={out}",
                    "max_steps=1", "batch_size=2", "finetune=full", "device=cpu", "max_len=512"])
    log, err = capsys.readouterr()
    assert code == 0, err
    n = len(list(hf_class(vlm["family"]).from_pretrained(vlm["model"], dtype=torch.float32).parameters()))
    assert f"audit: healthy — {n} of {n} trainable tensors" in log + err
    folder = out / "model"
    assert json.loads((folder / "video_preprocessor_config.json").read_text()) == VIDEO[FAMILY[vlm["family"]]]
    ours, base = (load_pretrained(d, models.from_hf_config) for d in (folder, vlm["model"]))
    assert not torch.equal(ours.model.visual.patch_embed.proj.weight, base.model.visual.patch_embed.proj.weight)


def test_packed_video_rows_train_as_padded_ones(vlm, tmp_path, capsys):
    """packing=true on video rows: the four rows in one micro-batch (packed into one row, its sequences' 3-D positions
    starting again, the videos in the order the packer lays them out) give the first step's loss of the padded run."""
    losses = {}
    for packing in ("false", "true"):
        out = tmp_path / f"out-{packing}"
        code = run_cli([str(REPO / "recipes" / "sft.py"), f"model={vlm['model']}", f"data={vlm['data']}", f"out={out}",
                        "max_steps=1", "batch_size=4", "lora_r=4", "device=cpu", "max_len=512", f"packing={packing}"])
        assert code == 0, capsys.readouterr().err
        losses[packing] = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-6), losses


def bad_run(vlm, tmp_path, capsys, rows: list[dict], *extra: str, model=None) -> str:
    """The CLI on `rows` (written beside the fixture's frames): exit 2, one line, nothing written; the line."""
    data = vlm["data"].parent / f"bad_{tmp_path.name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    code = run_cli([str(REPO / "recipes" / "sft.py"), f"model={model or vlm['model']}", f"data={data}", f"out={out}",
                    "max_steps=1", "device=cpu", "max_len=512", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and not out.exists(), err
    return err


def chat(*content) -> dict:
    return {"messages": [{"role": "user", "content": list(content)}, {"role": "assistant", "content": "Ok."}]}


def test_bad_video_rows_are_one_line(vlm, tmp_path, capsys):
    err = bad_run(vlm, tmp_path, capsys, [chat(video(["clip/f0.png", "clip/gone.png"]), text("?"))])
    assert "bad_" in err and ":1: image " in err and "clip/gone.png does not exist" in err
    err = bad_run(vlm, tmp_path, capsys, [chat(video(["clip/f0.png", "clip/g0.png"]))])
    assert ":1: video frame " in err and "g0.png is 16x16, the first frame 28x20 — give frames of one size" in err
    err = bad_run(vlm, tmp_path, capsys, [chat(video("clip/movie.mp4"))])
    assert "video clip/movie.mp4: minitrain reads a video as its frames — give" in err
    err = bad_run(vlm, tmp_path, capsys, [chat(text("<|vision_start|><|video_pad|><|vision_end|>"),
                                                video(["clip/f0.png", "clip/f1.png"]))])
    assert "2 video placeholder(s) in the text for 1 video(s)" in err
    # a checkpoint without a video token
    plain = tmp_path / "plain"
    shutil.copytree(vlm["model"], plain)
    config = json.loads((plain / "config.json").read_text())
    del config["video_token_id"]
    (plain / "config.json").write_text(json.dumps(config))
    err = bad_run(vlm, tmp_path, capsys, [chat(video(["clip/f0.png", "clip/f1.png"]))], model=plain)
    assert "has a video, which is not read here: the checkpoint reads no videos" in err


def test_videos_in_a_preference_prompt_are_refused(vlm):
    tok = Tokenizer.from_folder(vlm["model"])
    from minitrain.data.readers import read_preference

    path = vlm["data"].parent / "pairs.jsonl"
    path.write_text(json.dumps({"videos": [["clip/f0.png", "clip/f1.png"]],
                                "prompt": [{"role": "user", "content": "What moves?"}],
                                "chosen": [{"role": "assistant", "content": "A."}],
                                "rejected": [{"role": "assistant", "content": "B."}]}) + "\n")
    with pytest.raises(UserError, match="pairs.jsonl:1: the row has \"videos\", which this recipe does not read yet"):
        read_preference(path, tok, max_len=256, images=image_rows(Cfg(vlm["model"]), tok))
