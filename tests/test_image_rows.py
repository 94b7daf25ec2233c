"""Image rows (`minitrain/data/images.py`, `read_sft`) and SFT on them from the command line, on a tiny
Qwen2.5-VL folder (the model of tests/test_qwen2_5_vl.py with a Qwen-shaped tokenizer that knows the vision
tokens, ChatML, and a preprocessor_config.json with patches of 4 pixels); the rows, the collated loss, LoRA SFT
and full fine-tuning from the CLI also on the same folder with tests/test_qwen3_vl.py's Qwen3-VL model and
tests/test_qwen3_5_vl.py's multimodal Qwen3.5 model (whose loss falls over a few steps).

Rows in TRL's shape (content parts `{"type": "image", "image": path}`) and with an `images` column; paths
relative to the data file's folder. Checked: each image's placeholder expanded to its token count, image
tokens and the prompt masked, images decoded per batch; the loss of a collated batch equals transformers'
on the same ids and pixels; a LoRA SFT run from the CLI with the tower frozen (no adapter on it, the
audit quiet); one-line errors for a missing image and for images given to a text-only checkpoint. The token
store (`data_cache=`) keeps SFT, DPO and KTO image rows (paths and data row) equal to the readers' lists, built
by one worker or two, rebuilt when an image file changes; runs on it log the losses of the in-memory runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from _tok import add_special_tokens, make_bpe_tokenizer, make_qwen_tokenizer
from PIL import Image
from test_qwen2_5_vl import TEXT, VISION
from test_qwen3_5_vl import TEXT as TEXT35
from test_qwen3_5_vl import VISION as VISION35
from test_qwen3_vl import TEXT as TEXT3
from test_qwen3_vl import VISION as VISION3

import models
from minitrain.cli import run_cli
from minitrain.data.collate import IGNORE_INDEX, collate_causal
from minitrain.data import store_build
from minitrain.data.images import ImageRows, ImageSpec, collate_images
from minitrain.data.readers import read_preference, read_sft, read_unpaired
from minitrain.data.store import carries
from minitrain.errors import UserError
from minitrain.objectives.kto import add_kl_rows
from minitrain.run import with_images
from minitrain.text.tokenizer import Tokenizer
from minitrain.weights import load_pretrained

REPO = Path(__file__).resolve().parents[1]
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
          "{%- endif %}")
PRE = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 64, "max_pixels": 32 * 32,
       "image_processor_type": "Qwen2VLImageProcessor"}


# family -> transformers' config and model classes, the text and vision configs
FAMILIES = {"qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", TEXT, VISION),
            "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", TEXT3, VISION3),
            "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", TEXT35, VISION35),
            # Qwen3-VL's over a Qwen3-MoE language model: layer 0 dense, the others 4 experts of 24 (top 2)
            "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration",
                             dict(TEXT3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                  mlp_only_layers=[0]), VISION3)}


def hf_class(family: str):
    return getattr(transformers, FAMILIES[family][1])


def vl_folder(d: Path, family: str = "qwen2_5_vl", video: dict | None = None) -> Path:
    """A tiny Qwen2.5-VL (Qwen3-VL) checkpoint folder with its tokenizer, chat template and image processor config;
    `video`: with a `<|video_pad|>` token and this video_preprocessor_config.json."""
    make_qwen_tokenizer(d)
    ids = add_special_tokens(d, VISION_TOKENS + (["<|video_pad|>"] if video else []))
    if video:
        (d / "video_preprocessor_config.json").write_text(json.dumps(video))
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["chat_template"] = CHATML
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    (d / "preprocessor_config.json").write_text(json.dumps(PRE))
    config_class, _, text, vision = FAMILIES[family]
    cfg = getattr(transformers, config_class)(
        text_config={**text, "vocab_size": 320, "eos_token_id": Tokenizer.from_folder(d).token_to_id("<|im_end|>")},
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids.get("<|video_pad|>", 0),
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    hf_class(family)(cfg).save_pretrained(d)
    return d


def write_images(root: Path) -> None:
    """root/img/a.png (20 x 30), b.png (40 x 17), c.png (9 x 9): random RGB."""
    rng = np.random.default_rng(0)
    (root / "img").mkdir(parents=True)
    for name, (h, w) in {"a.png": (20, 30), "b.png": (40, 17), "c.png": (9, 9)}.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / "img" / name)


def part(path: str) -> dict:
    return {"type": "image", "image": path}


def text(s: str) -> dict:
    return {"type": "text", "text": s}


def write_rows(root: Path) -> Path:
    write_images(root)
    rows = [
        {"messages": [{"role": "user", "content": [part("img/a.png"), text("What colour is it?")]},
                      {"role": "assistant", "content": [text("It is red.")]}]},
        {"images": ["img/b.png"], "messages": [{"role": "user", "content": "Describe the picture."},
                                               {"role": "assistant", "content": "A blue square."}]},
        {"messages": [{"role": "user", "content": [text("Compare "), part("img/c.png"), text(" and "),
                                                   part("img/a.png")]},
                      {"role": "assistant", "content": "The first is smaller."}]},
        {"messages": [{"role": "user", "content": "No picture here."}, {"role": "assistant", "content": "Fine."}]},
    ]
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("image_rows")
    return {"root": root, "model": vl_folder(root / "model"), "data": write_rows(root / "data"), "family": "qwen2_5_vl"}


@pytest.fixture(scope="module")
def vlm3(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("image_rows_qwen3_vl")
    return {"root": root, "model": vl_folder(root / "model", "qwen3_vl"), "data": write_rows(root / "data"),
            "family": "qwen3_vl"}


@pytest.fixture(scope="module")
def vlm35(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("image_rows_qwen3_5")
    return {"root": root, "model": vl_folder(root / "model", "qwen3_5"), "data": write_rows(root / "data"),
            "family": "qwen3_5"}


@pytest.fixture(scope="module")
def vlm3moe(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("image_rows_qwen3_vl_moe")
    return {"root": root, "model": vl_folder(root / "model", "qwen3_vl_moe"), "data": write_rows(root / "data"),
            "family": "qwen3_vl_moe"}


@pytest.fixture(params=list(FAMILIES))
def any_vlm(request) -> dict[str, Path]:
    """The Qwen2.5-VL folder, then the Qwen3-VL one, the multimodal Qwen3.5 one and the Qwen3-VL-MoE one."""
    return request.getfixturevalue({"qwen2_5_vl": "vlm", "qwen3_vl": "vlm3", "qwen3_5": "vlm35",
                                    "qwen3_vl_moe": "vlm3moe"}[request.param])


def rows_of(vlm) -> tuple[list[dict], ImageRows, Tokenizer]:
    tok = Tokenizer.from_folder(vlm["model"])
    config = json.loads((vlm["model"] / "config.json").read_text())
    images = ImageRows.from_checkpoint(config, PRE, lambda i: tok.decode([i], skip_special=False))
    return read_sft(vlm["data"], tok, max_len=256, images=images), images, tok


def test_rows_expand_placeholders_and_mask_images(any_vlm):
    vlm = any_vlm
    examples, images, tok = rows_of(vlm)
    assert images.placeholder == "".join(VISION_TOKENS)
    pad = images.token_id
    # a.png 20 x 30 -> 16 x 32 pixels (round half to even) -> 4 x 8 patches -> 8 tokens; b.png 40 x 17 -> 40 x 16
    # -> 10; c.png 9 x 9 -> 8 x 8 -> 1
    assert [ex["input_ids"].count(pad) for ex in examples] == [8, 10, 1 + 8, 0]
    data = vlm["data"].parent
    assert examples[2]["images"] == [str(data / "img/c.png"), str(data / "img/a.png")]
    assert "images" not in examples[3]
    for ex in examples:
        ids, labels = ex["input_ids"], ex["labels"]
        assert all(label == IGNORE_INDEX for i, label in zip(ids, labels) if i == pad)
        target = tok.decode([i for i, label in zip(ids, labels) if label != IGNORE_INDEX], skip_special=False)
        assert target.replace("<|im_end|>", "").strip() in ("It is red.", "A blue square.", "The first is smaller.",
                                                            "Fine.")
    # the images column goes before the first user message's text
    assert tok.decode(examples[1]["input_ids"], skip_special=False).startswith(
        "<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 10 + "<|vision_end|>Describe")


def test_collated_loss_equals_transformers(any_vlm):
    vlm = any_vlm
    examples, images, tok = rows_of(vlm)
    batch = collate_images(examples, lambda ex: collate_causal(ex, tok.pad_id), images.spec)
    assert batch["pixel_values"].shape == (32 + 40 + 4 + 32, 3 * 2 * 4 * 4)
    assert batch["image_grid_thw"].tolist() == [[1, 4, 8], [1, 10, 4], [1, 2, 2], [1, 4, 8]]
    from minitrain.objectives.sft import sft

    ours = load_pretrained(vlm["model"], models.from_hf_config).eval()
    hf = hf_class(vlm["family"]).from_pretrained(vlm["model"], dtype=torch.float32).eval()
    with torch.no_grad():
        loss_sum, count, _ = sft(ours, batch)
        ref = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                 pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                 mm_token_type_ids=(batch["input_ids"] == images.token_id).long()).loss
    assert abs(float(loss_sum / count) - float(ref)) <= 1e-5 * float(ref)


def test_lora_sft_from_the_cli_with_the_tower_frozen(any_vlm, capsys):
    vlm = any_vlm
    out = vlm["root"] / "out"
    code = run_cli([str(REPO / "recipes" / "sft.py"), f"model={vlm['model']}", f"data={vlm['data']}", f"out={out}",
                    "max_steps=2", "batch_size=2", "lora_r=4", "lora_alpha=8", "device=cpu", "max_len=256"])
    log, err = capsys.readouterr()
    assert code == 0, err
    assert "audit: healthy" in log + err and "visual" not in log + err  # nothing of the frozen tower
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
    from safetensors import safe_open

    adapter = next(out.rglob("adapter_model.safetensors"))
    with safe_open(adapter, "pt") as f:
        keys = list(f.keys())
    assert keys and not [k for k in keys if "visual" in k]
    assert any("layers.0.mlp.gate_proj" in k for k in keys)


def test_qwen3_5_sft_from_the_cli_lowers_the_loss(vlm35, capsys):
    """A multimodal Qwen3.5 folder (Gated DeltaNet and attention layers) trains on image rows from the command line:
    LoRA on the language model, the tower frozen, the loss of the same two batches falling over the epochs."""
    out = vlm35["root"] / "falls"
    code = run_cli([str(REPO / "recipes" / "sft.py"), f"model={vlm35['model']}", f"data={vlm35['data']}",
                    f"out={out}", "max_steps=8", "batch_size=2", "lora_r=8", "lora_alpha=16", "lr=1e-2",
                    "schedule=constant", "device=cpu", "max_len=256"])
    log, err = capsys.readouterr()
    assert code == 0, err
    assert "audit: healthy" in log + err
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 8 and losses[-2] + losses[-1] < 0.8 * (losses[0] + losses[1]), losses


def test_missing_image_names_file_and_row(vlm, tmp_path):
    bad = tmp_path / "rows.jsonl"
    bad.write_text(json.dumps({"images": ["nope.png"], "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}) + "\n")
    tok = Tokenizer.from_folder(vlm["model"])
    config = json.loads((vlm["model"] / "config.json").read_text())
    images = ImageRows.from_checkpoint(config, PRE, lambda i: tok.decode([i], skip_special=False))
    with pytest.raises(UserError, match=rf"{bad}:1: image {tmp_path / 'nope.png'} does not exist"):
        read_sft(bad, tok, max_len=256, images=images)


def test_processor_config_read_where_transformers_reads_it(vlm, tmp_path):
    """transformers 5's `save_pretrained` writes the image (and video) processor's config nested in
    processor_config.json, without preprocessor_config.json: it is read from there, and ahead of a
    preprocessor_config.json beside it, as `AutoImageProcessor` / `AutoVideoProcessor` read them (here: another
    max_pixels and min_pixels, which change every image's size; before, the processor's defaults were used)."""
    from minitrain.run import image_rows

    folder = tmp_path / "model"
    shutil.copytree(vlm["model"], folder)
    nested = {**PRE, "max_pixels": 16 * 16, "min_pixels": 32}
    video = {**nested, "max_pixels": 24 * 24, "video_processor_type": "Qwen2VLVideoProcessor"}
    tok = Tokenizer.from_folder(folder)
    cfg = type("Cfg", (), {"model": str(folder)})
    for layout in ("nested only", "nested beside preprocessor_config.json"):
        if layout == "nested only":
            (folder / "preprocessor_config.json").unlink()
        else:
            (folder / "preprocessor_config.json").write_text(json.dumps(PRE))
        (folder / "processor_config.json").write_text(json.dumps(
            {"image_processor": nested, "video_processor": video, "processor_class": "Qwen2_5_VLProcessor"}))
        rows = image_rows(cfg, tok)
        hf = transformers.AutoImageProcessor.from_pretrained(folder)
        assert (rows.spec.min_pixels, rows.spec.max_pixels) == (hf.size["shortest_edge"], hf.size["longest_edge"]) == (32, 256)
        assert rows.videos.spec.max_pixels == 24 * 24 != rows.spec.max_pixels, layout
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}))
    assert image_rows(cfg, tok).spec.max_pixels == PRE["max_pixels"]  # the Hub's layout: nothing nested
    (folder / "processor_config.json").write_text("{oops")
    with pytest.raises(UserError, match=r"processor_config\.json: cannot be read .* restore the checkpoint's file"):
        image_rows(cfg, tok)


@pytest.mark.parametrize("family", ["llama", "qwen3_5_text"])
def test_images_for_a_text_only_checkpoint_is_one_line(vlm, hf_causal, tmp_path, capsys, family):
    import shutil

    from test_qwen3_5 import QWEN35

    model = tmp_path / family
    shutil.copytree(hf_causal("image_rows_llama") if family == "llama" else hf_causal("qwen3_5", **QWEN35), model)
    make_bpe_tokenizer(model)
    capsys.readouterr()
    code = run_cli([str(REPO / "recipes" / "sft.py"), f"model={model}", f"data={vlm['data']}",
                    f"out={tmp_path / 'out'}", "max_steps=1", "chat_format=mistral", "device=cpu"])
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "text-only" in lines[0] and "rows.jsonl:1" in lines[0], err
    assert not (tmp_path / "out").exists()
    assert ImageSpec().tokens((1, 4, 6)) == 6


def test_a_missing_image_from_the_cli_is_one_line(vlm, tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})
                    + "\n" + json.dumps({"messages": [
                        {"role": "user", "content": [{"type": "image", "image": "gone.jpg"}, {"type": "text", "text": "?"}]},
                        {"role": "assistant", "content": "Yo"}]}) + "\n")
    capsys.readouterr()
    code = run_cli([str(REPO / "recipes" / "sft.py"), f"model={vlm['model']}", f"data={data}", f"out={tmp_path / 'out'}",
                    "max_steps=1", "device=cpu"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and f"{data}:2: image {tmp_path / 'gone.jpg'} does not exist" in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_text_parts_suit_a_text_only_checkpoint(tmp_path):
    """Content lists of text parts alone (TRL's shape without images) read for any checkpoint: the parts joined."""
    make_bpe_tokenizer(tmp_path)
    tok = Tokenizer.from_folder(tmp_path, chat_format="mistral")
    data = tmp_path / "rows.jsonl"
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    data.write_text(json.dumps({"messages": [{"role": "user", "content": parts},
                                             {"role": "assistant", "content": "Hi"}]}) + "\n")
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"messages": [{"role": "user", "content": "Hello there"},
                                              {"role": "assistant", "content": "Hi"}]}) + "\n")
    assert read_sft(data, tok, max_len=64) == read_sft(plain, tok, max_len=64)


def test_a_regex_target_trains_the_merger_from_the_cli(any_vlm, capsys):
    """lora_targets as one regular expression naming the language model's q / v and the merger: the merger's
    linears get adapters (its norm, matched too, is skipped), the audit reaches them, the adapter holds them."""
    vlm = any_vlm
    out = vlm["root"] / "merger"
    capsys.readouterr()
    code = run_cli([str(REPO / "recipes" / "sft.py"), f"model={vlm['model']}", f"data={vlm['data']}", f"out={out}",
                    "max_steps=1", "batch_size=2", "lora_r=4", "device=cpu", "max_len=256",
                    r"lora_targets=.*\.(q_proj|v_proj)|model\.visual\.merger\..*"])
    log, err = capsys.readouterr()
    assert code == 0, err
    assert "audit: healthy" in log + err
    from safetensors import safe_open

    with safe_open(next(out.rglob("adapter_model.safetensors")), "pt") as f:
        keys = list(f.keys())
    merger = [k for k in keys if ".visual.merger." in k]
    assert len(merger) == 4 and all("lora_" in k for k in merger) and not [k for k in keys if ".visual.blocks." in k]


def test_full_finetuning_trains_the_tower_and_writes_a_folder_transformers_loads(any_vlm, capsys):
    """finetune=full: the audit runs on an image row (kept whole) and reaches the tower (every tensor
    transformers' class has); the written folder (with the image processor's config) loads in transformers with
    our logits, its tower changed."""
    vlm = any_vlm
    out = vlm["root"] / "full"
    capsys.readouterr()
    code = run_cli([str(REPO / "recipes" / "sft.py"), f"model={vlm['model']}", f"data={vlm['data']}", f"out={out}",
                    "max_steps=1", "batch_size=2", "finetune=full", "device=cpu", "max_len=256"])
    log, err = capsys.readouterr()
    assert code == 0, err
    hf = hf_class(vlm["family"]).from_pretrained(vlm["model"], dtype=torch.float32)
    n = len(list(hf.parameters()))
    assert f"audit: healthy — {n} of {n} trainable tensors" in log + err
    folder = out / "model"
    assert json.loads((folder / "preprocessor_config.json").read_text()) == PRE
    ours, base = (load_pretrained(d, models.from_hf_config).eval() for d in (folder, vlm["model"]))
    assert not torch.equal(ours.model.visual.patch_embed.proj.weight, base.model.visual.patch_embed.proj.weight)
    hf = hf_class(vlm["family"]).from_pretrained(folder, dtype=torch.float32).eval()
    examples, images, tok = rows_of(vlm)
    batch = collate_images(examples[:2], lambda ex: collate_causal(ex, tok.pad_id), images.spec)
    with torch.no_grad():
        a = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], pixel_values=batch["pixel_values"],
               image_grid_thw=batch["image_grid_thw"], mm_token_type_ids=(batch["input_ids"] == images.token_id).long())
        b = ours.lm_head(ours(batch["input_ids"], batch["attention_mask"], pixel_values=batch["pixel_values"],
                              image_grid_thw=batch["image_grid_thw"]))
    real = batch["attention_mask"].bool()
    assert float((b[real] - a.logits[real]).norm() / a.logits[real].norm()) <= 1e-4


def test_packed_image_rows_train_as_padded_ones_and_qwen3_5_refuses_them(vlm, vlm35, tmp_path, capsys):
    """packing=true on image rows (Qwen2.5-VL; Qwen3-VL and Qwen3-VL-MoE run the same forward, whose packed
    logits tests/test_qwen2_5_vl.py compares): the four rows in one micro-batch give the first step's loss of the
    padded run; a multimodal Qwen3.5 folder, whose forward does not pack images yet, refuses in one line, exit
    2, nothing written; text rows pack on a vision-language folder."""
    losses = {}
    for packing in ("false", "true"):
        out = tmp_path / f"out-{packing}"
        capsys.readouterr()
        code = run_cli([str(REPO / "recipes" / "sft.py"), f"model={vlm['model']}", f"data={vlm['data']}", f"out={out}",
                        "max_steps=1", "batch_size=4", "lora_r=4", "device=cpu", "max_len=256", f"packing={packing}"])
        assert code == 0, capsys.readouterr().err
        losses[packing] = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-6), losses
    capsys.readouterr()
    code = run_cli([str(REPO / "recipes" / "sft.py"), f"model={vlm35['model']}", f"data={vlm35['data']}",
                    f"out={tmp_path / 'out'}", "max_steps=1", "device=cpu", "packing=true"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "qwen3_5 does not pack yet" in lines[0], lines
    assert not (tmp_path / "out").exists()
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w}."},
                                                     {"role": "assistant", "content": w}]}) + "\n"
                            for w in ("one", "two", "three", "four")))
    code = run_cli([str(REPO / "recipes" / "sft.py"), f"model={vlm['model']}", f"data={text}", f"out={tmp_path / 'out'}",
                    "max_steps=1", "device=cpu", "packing=true", "batch_size=2", "lora_r=4"])
    assert code == 0, capsys.readouterr().err


# --------------------------------------------------------------------------- the token store (data_cache=)


def pair_rows(data: Path) -> Path:
    """data/pairs.jsonl (DPO) and data/kto.jsonl (KTO) beside rows.jsonl: prompts with images (a part with a path, an
    images column) and one without; returns the folder."""
    ask = [{"role": "user", "content": [part("img/a.png"), text("What is it?")]}]
    two = [{"role": "user", "content": "Compare them."}]
    plain = [{"role": "user", "content": "Say hi."}]
    pairs = [{"prompt": ask, "chosen": "A red cat.", "rejected": "Nothing."},
             {"images": ["img/c.png", "img/b.png"], "prompt": two, "chosen": "The same.", "rejected": "Unlike."},
             {"prompt": plain, "chosen": "Hi.", "rejected": "No."}]
    (data / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    kto = [{"prompt": p["prompt"], "completion": p[k], "label": k == "chosen", **({"images": p["images"]}
                                                                               if "images" in p else {})}
           for p in pairs for k in ("chosen", "rejected")]
    (data / "kto.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kto))
    return data


@pytest.fixture
def own_data(vlm, tmp_path) -> Path:
    """A copy of the rows and images (rows.jsonl, pairs.jsonl, kto.jsonl, img/) that a test may change."""
    shutil.copytree(vlm["data"].parent, tmp_path / "data")
    return pair_rows(tmp_path / "data")


def image_reading(vlm) -> tuple[Tokenizer, ImageRows]:
    tok = Tokenizer.from_folder(vlm["model"])
    config = json.loads((vlm["model"] / "config.json").read_text())
    return tok, ImageRows.from_checkpoint(config, PRE, lambda i: tok.decode([i], skip_special=False))


STORE_READERS = {"sft": ("rows.jsonl", read_sft), "preference": ("pairs.jsonl", read_preference),
                 "unpaired": ("kto.jsonl", read_unpaired)}


@pytest.mark.parametrize("kind", list(STORE_READERS))
def test_the_token_store_keeps_image_rows_as_the_readers_make_them(vlm, own_data, tmp_path, monkeypatch, kind):
    """SFT, DPO and KTO rows with images (and one without) read back from the store equal to the readers' lists,
    every key (`images` and `where` only on rows with images, as in memory); 2 workers write the same arrays as
    1 (chunks of one row: each worker takes every other row)."""
    monkeypatch.setattr(store_build, "CHUNK", 1)
    tok, images = image_reading(vlm)
    name, read = STORE_READERS[kind]
    data = str(own_data / name)
    ref = read(data, tok, max_len=256, images=images)
    stores = [store_build.open_or_build(tmp_path / f"cache{w}", [data], kind, read, tok,
                                        {"max_len": 256, "images": images}, workers=w) for w in (1, 2)]
    for store in stores:
        assert list(store) == list(ref) and store[-1] == ref[-1]
        assert store.carries("images").tolist() == [bool(ex.get("images")) for ex in ref]
        assert [store[i].get("where") for i in range(len(ref))] == [ex.get("where") for ex in ref]
    assert any("images" in ex for ex in ref) and not all("images" in ex for ex in ref)
    assert stores[0].header["sums"] == stores[1].header["sums"]  # the same bytes in every array
    assert sorted(stores[0].header["sums"]) == sorted(
        [f"{k}.{s}" for k in stores[0].lists for s in ("ids", "off")] + [f"{k}.val" for k in stores[0].values]
        + [f"{k}.{s}" for k in ("images", "videos", "where") for s in ("txt", "off")]
        + ["image_files.txt", "image_files.stat"])
    if kind == "unpaired":  # KTO's KL rows: the prompt's images with the row
        kl_store, kl_ref = add_kl_rows(stores[1], 2), add_kl_rows(ref, 2)
        assert list(kl_store) == list(kl_ref) and kl_store.carries("images").tolist() == carries(kl_ref).tolist()


def test_a_changed_or_removed_image_rebuilds_the_store(vlm, own_data, tmp_path, capsys):
    """The store records each image file's size and mtime: one changed (another size: another token count), or
    only touched, is a new build, with a note, equal to the in-memory rows again; one removed is the reader's one
    line (file and row); other processing settings (max_pixels) are another store."""
    tok, images = image_reading(vlm)
    data, cache = str(own_data / "rows.jsonl"), tmp_path / "cache"

    def opened(reading=images):
        return store_build.open_or_build(cache, [data], "sft", read_sft, tok, {"max_len": 256, "images": reading},
                                         workers=1)

    first = opened()
    assert "token store built" in capsys.readouterr().out
    assert opened().folder == first.folder and "token store built" not in capsys.readouterr().out  # a cache hit
    pad = images.token_id
    assert first[1]["input_ids"].count(pad) == 10
    Image.fromarray(np.zeros((40, 40, 3), dtype=np.uint8)).save(own_data / "img" / "b.png")  # 40 x 17 before
    again = opened()
    out = capsys.readouterr().out
    changed = f"image {own_data / 'img' / 'b.png'} changed since the build"
    assert f"note: data_cache: {first.folder}: out of date ({changed}) — rebuilding it" in out
    assert "token store built" in out
    assert again.folder == first.folder and again[1]["input_ids"].count(pad) == 16
    assert list(again) == list(read_sft(data, tok, max_len=256, images=images))
    a = own_data / "img" / "a.png"
    os.utime(a, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns + 10**9))  # the same bytes, touched: rebuilt too
    capsys.readouterr()
    opened()
    assert f"out of date (image {a} changed since the build)" in capsys.readouterr().out
    other = dataclasses.replace(images, spec=dataclasses.replace(images.spec, max_pixels=16 * 16))
    assert opened(other).folder != first.folder
    (own_data / "img" / "c.png").unlink()
    with pytest.raises(UserError, match=rf"^{data}:3: image {own_data / 'img' / 'c.png'} does not exist"):
        opened()


def test_an_image_gone_after_the_store_opened_is_one_line_naming_file_and_row(vlm, own_data, tmp_path, capsys):
    """An image removed once the run has opened the store: the batch that decodes it is one line naming the file
    and the data row (kept in the store); from the command line, a store whose image is gone is rebuilt and the
    row is named the same way, exit 2, nothing written."""
    tok, images = image_reading(vlm)
    data = own_data / "rows.jsonl"
    store = store_build.open_or_build(tmp_path / "cache", [str(data)], "sft", read_sft, tok,
                                      {"max_len": 256, "images": images}, workers=2)
    (own_data / "img" / "b.png").unlink()
    collate = with_images(lambda ex: collate_causal(ex, tok.pad_id), images)
    assert collate([store[0]])["image_grid_thw"].tolist() == [[1, 4, 8]]
    with pytest.raises(UserError, match=rf"^{data}:2: image {own_data / 'img' / 'b.png'} does not exist"):
        collate([store[0], store[1]])
    capsys.readouterr()
    code = run_cli([str(REPO / "recipes" / "sft.py"), f"model={vlm['model']}", f"data={data}",
                    f"out={tmp_path / 'out'}", "max_steps=1", "device=cpu", "max_len=256",
                    f"data_cache={tmp_path / 'cache'}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and f"{data}:2: image {own_data / 'img' / 'b.png'} does not exist" in lines[0]
    assert not (tmp_path / "out").exists()


CLI_RUNS = {"sft": ("sft.py", "rows.jsonl", "batch_size=2"), "dpo": ("dpo_mistral.py", "pairs.jsonl", "batch_size=2"),
            "kto": ("kto_mistral.py", "kto.jsonl", "batch_size=3")}


@pytest.mark.parametrize("method", list(CLI_RUNS))
def test_a_run_on_the_store_logs_the_losses_of_the_in_memory_run(vlm, own_data, tmp_path, capsys, method):
    """SFT, DPO and KTO on image rows from the command line: data_cache=<folder> (2 workers; eval_data in a store
    too) logs the same loss and evaluation lines, bit for bit, as data_cache=false."""
    recipe, name, batch = CLI_RUNS[method]
    runs = {}
    for cache in ("false", str(tmp_path / "cache")):
        out = tmp_path / f"out-{len(runs)}"
        capsys.readouterr()
        code = run_cli([str(REPO / "recipes" / recipe), f"model={vlm['model']}", f"data={own_data / name}",
                        f"out={out}", "max_steps=2", batch, "lora_r=4", "lora_alpha=8", "device=cpu",
                        "max_len=256", "log_every=1", f"eval_data={own_data / name}", "eval_every=2",
                        f"data_cache={cache}", "data_workers=2"])
        log, err = capsys.readouterr()
        assert code == 0, err
        assert ("token store built" in log + err) == (cache != "false")
        keep = ("step", "loss", "grad_norm", "lr", "tokens", "kl", "rewards/chosen", "rewards/margins")
        runs[cache] = ([{k: v for k, v in json.loads(line).items() if k in keep}
                        for line in (out / "metrics.jsonl").read_text().splitlines()],
                       (out / "eval.jsonl").read_text())
    (lists, evals), (stored, stored_evals) = runs.values()
    assert [r["step"] for r in lists if "loss" in r] == [1, 2] and lists == stored and evals == stored_evals
