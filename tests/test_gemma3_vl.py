"""Multimodal Gemma 3 (`models/gemma3_vl.py`) against transformers' `Gemma3ForConditionalGeneration`.

A tiny random checkpoint saved once per session by transformers 5 (fp32; the norms perturbed so that they
matter; the projection, which transformers starts at zeros, drawn): a 2-layer SigLIP tower (32 wide, 2 heads, 32-pixel images in patches of 4: an 8 x 8 grid pooled to
mm_tokens_per_image 4) and a 3-layer Gemma 3 language model (sliding, global, sliding; a window of 3 tokens,
shorter than an image's 4 soft tokens, so that the window and the images' two-way attention meet). Compared:
logits with images in the batch (two images in one row, one in another, a padded text-only row), text-only
logits, greedy generation after image prompts, the layouts transformers saves and the Hub holds, the config's
round trip, a LoRA adapter in peft, a saved folder in transformers (`minitrain merge`, LoRA on the tower and the
audit of a detached projector: tests/test_vl_lora.py, with the Qwen families).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

import models
from minitrain.weights import load_pretrained

BOI, EOI, SOFT = 150, 151, 152
TEXT = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=3, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"])
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=32,
              patch_size=4, vision_use_head=False)


def tiny_config():
    return transformers.Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4,
                                     boi_token_index=BOI, eoi_token_index=EOI, image_token_index=SOFT)


@pytest.fixture(scope="session")
def g3(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(tiny_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif "mm_input_projection" in name:  # transformers starts it at zeros: every image would read as 0
                p.normal_(0, 0.1)
    d = tmp_path_factory.mktemp("gemma3_vl")
    model.save_pretrained(d)
    return d


def image_row(g: torch.Generator, n_images: int, T: int) -> list[int]:
    """Random text around each image's `\\n\\n <start_of_image> <image_soft_token> x 4 <end_of_image> \\n\\n`."""
    ids: list[int] = []
    for _ in range(n_images):
        ids += torch.randint(3, 140, (3,), generator=g).tolist() + [10, BOI] + [SOFT] * 4 + [EOI, 10]
    return ids + torch.randint(3, 140, (T - len(ids),), generator=g).tolist()


def batch():
    """Row 0: two images; row 1: one image; row 2: text, right-padded. Three images' pixels."""
    g = torch.Generator().manual_seed(0)
    T = 30
    ids = torch.tensor([image_row(g, 2, T), image_row(g, 1, T), torch.randint(3, 140, (T,), generator=g).tolist()])
    mask = torch.ones_like(ids)
    mask[2, 20:] = 0
    ids[2, 20:] = 0
    return ids, mask, torch.randn(3, 3, 32, 32, generator=g)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def hf_logits(hf, ids, mask, pixels, soft: int = SOFT):
    """transformers' training forward: `token_type_ids` (1 at the soft tokens), as its processor returns."""
    return hf(input_ids=ids, attention_mask=mask, pixel_values=pixels, token_type_ids=(ids == soft).long()).logits


def test_logits_with_images_equal_transformers(g3):
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(g3, dtype=torch.float32).eval()
    ours = load_pretrained(g3, models.from_hf_config).eval()
    ids, mask, pixels = batch()
    real = mask.bool()
    with torch.no_grad():
        ref = hf_logits(hf, ids, mask, pixels)
        got = ours.lm_head(ours(ids, mask, pixel_values=pixels))
        assert rel(got[real], ref[real]) <= 1e-4
        # the images' two-way attention matters (transformers without token_type_ids: causal everywhere)
        causal = hf(input_ids=ids, attention_mask=mask, pixel_values=pixels).logits
        assert rel(causal[real], ref[real]) > 1e-3
        # text alone
        text = ids[2:, :20]
        assert rel(ours.lm_head(ours(text)), hf(input_ids=text).logits) <= 1e-4
        # the images matter: other pixels, other logits
        other = ours.lm_head(ours(ids, mask, pixel_values=pixels.flip(0)))
        assert rel(other[:2], got[:2]) > 1e-3


def test_a_soft_token_outside_the_vocabulary(g3, tmp_path):
    """image_token_index >= vocab_size: the soft tokens embed as token 0 before the features replace them, as
    transformers does (with images and without)."""
    import shutil

    shutil.copytree(g3, tmp_path / "oov")
    config = json.loads((g3 / "config.json").read_text())
    (tmp_path / "oov" / "config.json").write_text(json.dumps({**config, "image_token_index": 170}))
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "oov", dtype=torch.float32).eval()
    ours = load_pretrained(tmp_path / "oov", models.from_hf_config).eval()
    ids, mask, pixels = batch()
    ids = ids.masked_fill(ids == SOFT, 170)
    real = mask.bool()
    with torch.no_grad():
        ref = hf_logits(hf, ids, mask, pixels, 170)
        assert rel(ours.lm_head(ours(ids, mask, pixel_values=pixels))[real], ref[real]) <= 1e-4
        assert rel(ours.lm_head(ours(ids[:1])), hf(input_ids=ids[:1]).logits) <= 1e-4


def test_image_count_mismatch_is_refused(g3):
    ours = load_pretrained(g3, models.from_hf_config).eval()
    ids, mask, pixels = batch()
    with pytest.raises(ValueError, match="8 image soft tokens for 12 image features"):
        ours(ids[:1], mask[:1], pixel_values=pixels)


def test_every_layout_loads_key_for_key(g3, tmp_path):
    """transformers 5 saves `language_model.model.*` / `vision_tower.*`; the Hub's checkpoints hold
    `vision_tower.vision_model.*`; a minitrain save writes the module tree (`model.language_model.*`, ...)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(g3 / "model.safetensors")
    assert any(k.startswith("vision_tower.encoder.") for k in tensors)  # what this transformers writes
    hub = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in tensors.items()}
    tree = {("model." + k[len("language_model."):].replace("model.", "language_model.", 1)
             if k.startswith("language_model.") else "model." + k): v for k, v in tensors.items()}
    ours = load_pretrained(g3, models.from_hf_config).state_dict()
    assert torch.equal(ours["model.vision_tower.embeddings.patch_embedding.weight"],
                       tensors["vision_tower.embeddings.patch_embedding.weight"])
    for name, layout in (("hub", hub), ("tree", tree)):
        (tmp_path / name).mkdir()
        save_file(layout, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
        (tmp_path / name / "config.json").write_text((g3 / "config.json").read_text())
        again = load_pretrained(tmp_path / name, models.from_hf_config).state_dict()
        assert again.keys() == ours.keys() and all(torch.equal(again[k], ours[k]) for k in ours), name


def test_config_round_trip(g3):
    d = json.loads((g3 / "config.json").read_text())
    cfg = models.config_from_hf(d)
    assert (cfg.mm_tokens_per_image, cfg.image_token_index, cfg.vision.image_size, cfg.sliding_window) == (4, SOFT, 32, 3)
    again = cfg.to_hf()
    assert models.config_from_hf(again) == cfg
    assert transformers.Gemma3Config(**again).text_config.sliding_window == 3
    assert models.config_from_hf({**d, "eos_token_id": [1, 106]}).eos_token_id == [1, 106]  # the Hub's outer ids
    with pytest.raises(ValueError, match="mm_tokens_per_image=9"):
        models.config_from_hf({**d, "mm_tokens_per_image": 9})
    with pytest.raises(ValueError, match="vision_use_head"):
        models.config_from_hf({**d, "vision_config": {**d["vision_config"], "vision_use_head": True}})


def test_greedy_generation_after_images_equals_transformers(g3):
    """Prompts with images (row 1 left-padded): the prompt's image tokens attend both ways, the decoded tokens
    causally, as transformers' generation; two steps through the cache equal a forward over the whole."""
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(g3, dtype=torch.float32).eval()
    ours = load_pretrained(g3, models.from_hf_config).eval()
    ids, _, pixels = batch()
    ids, mask = ids[:2, :26].clone(), torch.ones(2, 26, dtype=torch.long)
    ids[1] = torch.cat([torch.zeros(6, dtype=torch.long), ids[1, :20]])
    mask[1, :6] = 0
    ref = hf.generate(input_ids=ids, attention_mask=mask, pixel_values=pixels, token_type_ids=(ids == SOFT).long(),
                      max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = models.family(ours).generate(ours, ids, mask, max_new_tokens=8, eos_token_id=[], pixel_values=pixels)
    assert torch.equal(got, ref)
    nxt = torch.tensor([[5, 6], [7, 8]])
    full_ids, full_mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
    with torch.no_grad():
        whole = hf(input_ids=full_ids, attention_mask=full_mask, position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0),
                   pixel_values=pixels, token_type_ids=(full_ids == SOFT).long()).logits[:, -2:]
        cache = models.family(ours).KVCache(40)
        ours(ids, mask, cache=cache, pixel_values=pixels)
        stepped = ours.lm_head(ours(nxt, torch.ones_like(nxt), cache=cache))
    assert rel(stepped, whole) <= 1e-4


# --------------------------------------------------------------------------------------------
# A checkpoint folder with its tokenizer, chat template and image processor: rows, processor, CLI
# --------------------------------------------------------------------------------------------

IMAGE_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
PRE = {"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
       "size": {"height": 32, "width": 32}, "resample": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
       "rescale_factor": 1 / 255, "do_pan_and_scan": None, "do_convert_rgb": None, "do_resize": True,
       "do_rescale": True, "do_normalize": True, "image_seq_length": 4}


def g3_folder(d: Path) -> Path:
    """A tiny Gemma 3 folder: a Gemma-shaped tokenizer with the three image tokens (the processor finds them as
    `extra_special_tokens`), Gemma 3's chat template, preprocessor_config.json / processor_config.json."""
    from _tok import add_special_tokens, make_gemma_tokenizer

    make_gemma_tokenizer(d)
    (d / "tokenizer.model").unlink()  # tokenizer.json alone holds the added tokens
    ids = add_special_tokens(d, IMAGE_TOKENS)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["extra_special_tokens"] = dict(zip(("boi_token", "eoi_token", "image_token"), IMAGE_TOKENS))
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    # as the checkpoints hold it: a file the tokenizer and the processor both read
    (d / "chat_template.jinja").write_text((Path(__file__).parent / "fixtures" / "chat_templates" / "gemma3.jinja").read_text())
    (d / "preprocessor_config.json").write_text(json.dumps(PRE))
    (d / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma3Processor", "image_seq_length": 4}))
    cfg = transformers.Gemma3Config(
        text_config={**TEXT, "vocab_size": 424, "eos_token_id": [1, 6]},  # <eos>, <end_of_turn>
        vision_config=VISION, mm_tokens_per_image=4, boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<image_soft_token>"])
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.1)
    model.save_pretrained(d)
    return d


def write_rows(root: Path) -> Path:
    """Rows in TRL's shape and with an `images` column; no text part begins or ends with a space (Gemma 3's
    template trims each text part, where minitrain joins the parts and the template trims the whole)."""
    from test_image_rows import part, text, write_images

    write_images(root)
    rows = [
        {"messages": [{"role": "user", "content": [part("img/a.png"), text("What colour is it?")]},
                      {"role": "assistant", "content": [text("It is red.")]}]},
        {"images": ["img/b.png"], "messages": [{"role": "user", "content": "Describe the picture."},
                                               {"role": "assistant", "content": "A blue square."}]},
        {"messages": [{"role": "user", "content": [text("Compare"), part("img/c.png"), text("and"),
                                                   part("img/a.png"), part("img/b.png")]},
                      {"role": "assistant", "content": "The first is smaller."}]},
        {"messages": [{"role": "user", "content": "No picture here."}, {"role": "assistant", "content": "Fine."}]},
    ]
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def g3dir(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma3_rows")
    return {"root": root, "model": g3_folder(root / "model"), "data": write_rows(root / "data")}


def rows_of(g3dir):
    from minitrain.data.images import ImageRows
    from minitrain.data.readers import read_sft
    from minitrain.text.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(g3dir["model"])
    config = json.loads((g3dir["model"] / "config.json").read_text())
    images = ImageRows.from_checkpoint(config, PRE, lambda i: tok.decode([i], skip_special=False))
    return read_sft(g3dir["data"], tok, max_len=256, images=images), images, tok


def trl_messages(row: dict, base: Path) -> list[dict]:
    """A row as the processor's chat takes it: content parts, image paths absolute, the images column as
    image parts before the first user message's text."""
    out = []
    for m in row["messages"]:
        content = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
        content = [{**p, "image": str(base / p["image"])} if p["type"] == "image" else p for p in content]
        if m["role"] == "user" and row.get("images") and not out:
            content = [{"type": "image", "image": str(base / p)} for p in row["images"]] + content
        out.append({"role": m["role"], "content": content})
    return out


def test_pixel_values_equal_the_processor(g3dir, tmp_path):
    """The awkward images of tests/test_images.py through the processor `AutoProcessor` gives for the folder
    (its image processor's Pillow path here, without torchvision: bilinear to 32 x 32, mean and std 0.5), to
    the bit."""
    from test_images import awkward

    from minitrain.data.images import SquareSpec, load_image, processor_spec

    processor = transformers.AutoProcessor.from_pretrained(g3dir["model"])
    assert type(processor.image_processor).__name__ == "Gemma3ImageProcessorPil"
    spec = processor_spec(PRE, json.loads((g3dir["model"] / "config.json").read_text()))
    assert spec == SquareSpec(height=32, width=32, tokens_per_image=4)
    for name, path in awkward(tmp_path).items():
        with Image.open(path) as im:
            # the whole processor: it converts to RGB (the image processor alone reads do_convert_rgb null as no)
            ref = processor(text=["<start_of_image>"], images=[[im]], return_tensors="np")["pixel_values"][0]
        pixels, _ = load_image(path, spec)
        assert pixels.dtype == np.float32 and np.array_equal(pixels, ref), name


def test_rows_equal_the_processor(g3dir):
    """Each row's ids (the chat with every `<start_of_image>` expanded, the newlines around it tokenized with
    the text) equal the Gemma 3 processor's on the same chat; image tokens and the prompt take no loss; the
    collated pixel values equal the processor's."""
    from minitrain.data.collate import IGNORE_INDEX, collate_causal
    from minitrain.data.images import collate_images

    examples, images, tok = rows_of(g3dir)
    assert images.placeholder == "<start_of_image>" and images.spec.tokens_per_image == 4
    processor = transformers.AutoProcessor.from_pretrained(g3dir["model"])
    rows = [json.loads(line) for line in g3dir["data"].read_text().splitlines()]
    base = g3dir["data"].parent
    for ex, row in zip(examples, rows):
        ref = processor.apply_chat_template(trl_messages(row, base), tokenize=True, return_dict=True,
                                            return_tensors="np")
        assert ex["input_ids"] == ref["input_ids"][0].tolist()
        batch = collate_images([ex], lambda e: collate_causal(e, tok.pad_id), images.spec)
        if "pixel_values" in ref:
            assert np.array_equal(batch["pixel_values"].numpy(), ref["pixel_values"])
        else:
            assert "pixel_values" not in batch
        assert all(label == IGNORE_INDEX for i, label in zip(ex["input_ids"], ex["labels"])
                   if i in (images.token_id, images.boi, images.eoi))
        target = tok.decode([i for i, label in zip(ex["input_ids"], ex["labels"]) if label != IGNORE_INDEX])
        assert target.strip() in ("It is red.", "A blue square.", "The first is smaller.", "Fine.")
    assert [ex["input_ids"].count(images.token_id) for ex in examples] == [4, 4, 12, 0]


def test_the_token_store_keeps_gemma3_image_rows(g3dir, tmp_path, monkeypatch):
    """Gemma 3's image rows (each `<start_of_image>` expanded, its frame's newlines tokenized with the text) read
    back from the token store, built by 2 workers over chunks of one row, equal to the reader's lists; Gemma 3's
    processing (`SquareSpec`: size, soft tokens) is in the store's fingerprint."""
    from minitrain.data import store_build
    from minitrain.data.readers import read_sft

    monkeypatch.setattr(store_build, "CHUNK", 1)
    examples, images, tok = rows_of(g3dir)
    store = store_build.open_or_build(tmp_path, [str(g3dir["data"])], "sft", read_sft, tok,
                                      {"max_len": 256, "images": images}, workers=2)
    assert list(store) == list(examples) and store.carries("images").tolist() == [True, True, True, False]
    assert store.header["fingerprint"]["options"]["images"]["spec"]["tokens_per_image"] == 4


def test_collated_loss_equals_transformers(g3dir):
    from minitrain.data.collate import collate_causal
    from minitrain.data.images import collate_images
    from minitrain.objectives.sft import sft

    examples, images, tok = rows_of(g3dir)
    batch = collate_images(examples, lambda ex: collate_causal(ex, tok.pad_id), images.spec)
    assert batch["pixel_values"].shape == (5, 3, 32, 32) and "image_grid_thw" not in batch
    ours = load_pretrained(g3dir["model"], models.from_hf_config).eval()
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(g3dir["model"], dtype=torch.float32).eval()
    with torch.no_grad():
        loss_sum, count, _ = sft(ours, batch)
        ref = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                 pixel_values=batch["pixel_values"], token_type_ids=(batch["input_ids"] == images.token_id).long()).loss
    assert abs(float(loss_sum / count) - float(ref)) <= 1e-5 * float(ref)


def test_pan_and_scan_and_other_processors_are_one_line():
    from minitrain.data.images import processor_spec
    from minitrain.errors import UserError

    with pytest.raises(UserError, match="do_pan_and_scan=true"):
        processor_spec({**PRE, "do_pan_and_scan": True}, {"model_type": "gemma3", "vision_config": VISION})
    with pytest.raises(UserError, match="image_processor_type 'SiglipImageProcessor' is not supported"):
        processor_spec({**PRE, "image_processor_type": "SiglipImageProcessor"}, {"model_type": "gemma3"})
    with pytest.raises(UserError, match="not the tower's image_size 32"):
        processor_spec({**PRE, "size": {"height": 64, "width": 64}}, {"model_type": "gemma3", "vision_config": VISION})


def lora_saved(folder: Path, targets: tuple[str, ...], adapter: Path):
    """Our model of `folder` with LoRA on `targets` (r 4, its B drawn at random), saved in peft's format."""
    from minitrain.adapters.lora import LoRAConfig, apply_lora
    from minitrain.adapters.peft_format import save_adapter

    ours = load_pretrained(folder, models.from_hf_config).eval()
    cfg = LoRAConfig(r=4, alpha=8, targets=targets)
    apply_lora(ours, cfg)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    save_adapter(ours, adapter, cfg)
    return ours


def test_lora_adapter_loads_in_peft_with_images(g3, tmp_path):
    """LoRA on the language model's projections (B drawn at random), saved in peft's format: peft puts it on
    transformers' class (the same module names) with our logits on a batch with images; none on the tower,
    whose attention has the same leaf names (`q_proj`, `v_proj`): the adapter names full paths."""
    peft = pytest.importorskip("peft")
    ours = lora_saved(g3, ("q_proj", "v_proj", "gate_proj", "down_proj"), tmp_path)
    assert not [n for n, _ in ours.named_parameters() if "lora_" in n and "language_model" not in n]
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(g3, dtype=torch.float32)
    ref = peft.PeftModel.from_pretrained(hf, tmp_path).eval()
    assert not [n for n, _ in ref.named_parameters() if "lora_" in n and "language_model" not in n]
    ids, mask, pixels = batch()
    real = mask.bool()
    with torch.no_grad():
        a = hf_logits(ref, ids, mask, pixels)
        b = ours.lm_head(ours(ids, mask, pixel_values=pixels))
        with ref.disable_adapter():
            plain = hf_logits(ref, ids, mask, pixels)
    assert rel(b[real], a[real]) <= 1e-5 and rel(plain[real], a[real]) > 1e-3


def test_lora_step_gradients_match_peft_with_images(g3, tmp_path):
    """A LoRA step on a batch with images: our adapter, put on transformers' model by peft, gets the same loss
    and the same gradient on every LoRA factor (the backward through the images' two-way attention)."""
    peft = pytest.importorskip("peft")
    ours = lora_saved(g3, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), tmp_path)
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(g3, dtype=torch.float32)
    ref = peft.PeftModel.from_pretrained(hf, tmp_path, is_trainable=True).train()
    ours.train()
    ids, mask, pixels = batch()
    labels = ids.masked_fill((mask == 0) | (ids == SOFT), -100)
    loss_ref = ref(input_ids=ids, attention_mask=mask, pixel_values=pixels, token_type_ids=(ids == SOFT).long(),
                   labels=labels).loss
    loss_ref.backward()
    logits = ours.output_projection(ours(ids, mask, pixel_values=pixels))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    loss.backward()
    assert float(loss.detach()) == pytest.approx(float(loss_ref.detach()), rel=1e-5)
    theirs = {n.removeprefix("base_model.model.").replace(".default", ""): p.grad
              for n, p in ref.named_parameters() if "lora_" in n}
    mine = {n: p.grad for n, p in ours.named_parameters() if "lora_" in n}
    assert set(mine) == set(theirs) and len(mine) == 2 * 7 * 3
    for n, g in mine.items():
        assert (g - theirs[n]).abs().max() <= 1e-5 * theirs[n].abs().max() + 1e-9, n


def test_a_saved_folder_loads_in_transformers(g3, tmp_path):
    """`save_pretrained` (full fine-tuning, merge) writes a folder transformers loads, with the same logits."""
    from minitrain.weights import save_pretrained

    ours = load_pretrained(g3, models.from_hf_config).eval()
    with torch.no_grad():
        ours.model.vision_tower.post_layernorm.bias.add_(0.1)  # a changed tower must arrive too
    config = dict(json.loads((g3 / "config.json").read_text()), vocab_size=160)  # as a full fine-tuning run writes it
    save_pretrained(ours, tmp_path / "saved", config)
    again = load_pretrained(tmp_path / "saved", models.from_hf_config)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in ours.state_dict().items())
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
    ids, mask, pixels = batch()
    with torch.no_grad():
        a = hf_logits(hf, ids, mask, pixels)
        b = ours.lm_head(ours(ids, mask, pixel_values=pixels))
    assert rel(b[mask.bool()], a[mask.bool()]) <= 1e-4


REPO = Path(__file__).resolve().parents[1]


def test_lora_sft_on_image_rows_from_the_cli_with_the_tower_frozen(g3dir, capsys):
    from safetensors import safe_open

    from minitrain.cli import run_cli

    out = g3dir["root"] / "out"
    code = run_cli([str(REPO / "recipes" / "sft.py"), f"model={g3dir['model']}", f"data={g3dir['data']}",
                    f"out={out}", "max_steps=2", "batch_size=2", "lora_r=4", "lora_alpha=8", "device=cpu",
                    "max_len=256"])
    log, err = capsys.readouterr()
    assert code == 0, err
    assert "audit: healthy" in log + err and "vision_tower" not in log + err  # nothing of the frozen tower
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
    with safe_open(next(out.rglob("adapter_model.safetensors")), "pt") as f:
        keys = list(f.keys())
    assert keys and all("language_model" in k for k in keys)


def test_a_multimodal_folder_trains_on_text_rows(g3dir, tmp_path, capsys):
    """A Gemma 3 multimodal folder without its image processor's files, text rows only: its language model
    trains (LoRA) and the adapter loads in peft on transformers' class with our logits."""
    import shutil

    from minitrain.cli import run_cli

    peft = pytest.importorskip("peft")
    model = tmp_path / "model"
    shutil.copytree(g3dir["model"], model)
    for name in ("preprocessor_config.json", "processor_config.json"):
        (model / name).unlink()
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w}."},
                                                     {"role": "assistant", "content": w}]}) + "\n"
                            for w in ("one", "two", "three", "four")))
    out = tmp_path / "out"
    code = run_cli([str(REPO / "recipes" / "sft.py"), f"model={model}", f"data={data}", f"out={out}", "max_steps=2",
                    "batch_size=2", "lora_r=4", "device=cpu", "lr=1e-2"])
    log, err = capsys.readouterr()
    assert code == 0, err
    assert "audit: healthy" in log + err
    adapter = next(out.rglob("adapter_model.safetensors")).parent
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(model, dtype=torch.float32)
    ref = peft.PeftModel.from_pretrained(hf, adapter).eval()
    ids = torch.randint(3, 400, (2, 12), generator=torch.Generator().manual_seed(0))
    from minitrain.adapters.peft_format import load_adapter

    ours = load_pretrained(model, models.from_hf_config).eval()
    load_adapter(ours, adapter)
    with torch.no_grad():
        a = ref(input_ids=ids).logits
        b = ours.lm_head(ours(ids))
        with ref.disable_adapter():
            plain = ref(input_ids=ids).logits
    assert rel(b, a) <= 1e-5 and rel(plain, a) > 1e-4


def test_full_finetuning_trains_the_tower_and_writes_a_folder_transformers_loads(g3dir, capsys):
    """finetune=full: the audit runs on an image row and reaches the tower and the projector; the written
    folder (with the processor's files) loads in transformers with our logits on an image batch."""
    from minitrain.cli import run_cli
    from minitrain.data.collate import collate_causal
    from minitrain.data.images import collate_images

    out = g3dir["root"] / "full"
    capsys.readouterr()
    code = run_cli([str(REPO / "recipes" / "sft.py"), f"model={g3dir['model']}", f"data={g3dir['data']}", f"out={out}",
                    "max_steps=1", "batch_size=2", "finetune=full", "device=cpu", "max_len=256"])
    log, err = capsys.readouterr()
    assert code == 0, err
    assert "audit: healthy — 80 of 80 trainable tensors" in log + err
    folder = out / "model"
    assert json.loads((folder / "preprocessor_config.json").read_text()) == PRE
    ours, base = (load_pretrained(d, models.from_hf_config).eval() for d in (folder, g3dir["model"]))
    for name in ("vision_tower.embeddings.patch_embedding.weight", "multi_modal_projector.mm_input_projection_weight"):
        assert not torch.equal(ours.model.get_parameter(name), base.model.get_parameter(name)), name
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    examples, images, tok = rows_of(g3dir)
    b = collate_images(examples[:3], lambda ex: collate_causal(ex, tok.pad_id), images.spec)
    with torch.no_grad():
        a = hf_logits(hf, b["input_ids"], b["attention_mask"], b["pixel_values"], images.token_id)
        o = ours.lm_head(ours(b["input_ids"], b["attention_mask"], pixel_values=b["pixel_values"]))
    real = b["attention_mask"].bool()
    assert rel(o[real], a[real]) <= 1e-4
