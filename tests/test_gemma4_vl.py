"""Multimodal Gemma 4 (`models/gemma4_vl.py`) against transformers' `Gemma4ForConditionalGeneration`.

A tiny random checkpoint saved once per module by transformers 5 (fp32; norms and layer scalars perturbed so that
they matter): a 2-layer vision tower (32 wide, 2 heads of 16, patches of 4 pixels, pooled 2 x 2), a one-layer
audio tower (carried, never built) and a 3-layer Gemma 4 language model with per-layer inputs, a shared layer,
proportional RoPE, a window of 5 tokens and `use_bidirectional_attention: "vision"`. The images come from
transformers' own image processor (`Gemma4ImageProcessorPil`, unresized: 6 and 2 soft tokens, the second
padded). Compared: logits with images in a padded batch (the sliding layers' two-way attention within an image,
the global layers causal), the causal variant without "vision", text-only logits, every gradient (the tower's
included), a tower with clipped linears and standardized features, greedy generation after image prompts, a
LoRA adapter in peft with images, a saved folder in transformers. Then a folder with a Gemma-shaped tokenizer,
Gemma 4's chat template and image processor config: image rows equal `Gemma4Processor.apply_chat_template`'s,
the collated loss transformers', LoRA SFT and full fine-tuning on image rows from the command line, the memory
plan's one-line refusal. The awkward images: tests/test_images.py; DPO / KTO / GRPO with images:
tests/test_vl_families_rl.py; LoRA on the tower: tests/test_vl_lora.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

import models
from minitrain.weights import load_pretrained

IMAGE, BOI, EOI = 120, 123, 124
TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, global_head_dim=32, sliding_window=5, max_position_embeddings=256, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, num_hidden_layers=3, hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=128, num_kv_shared_layers=1, final_logit_softcapping=5.0,
            layer_types=["sliding_attention", "full_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                "rope_theta": 100.0}},
            use_bidirectional_attention="vision")
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
              head_dim=16, patch_size=4, position_embedding_size=64, pooling_kernel_size=2)
AUDIO = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
             output_proj_dims=32)
TOKENS = dict(image_token_id=IMAGE, video_token_id=121, audio_token_id=122, boi_token_id=BOI, eoi_token_id=EOI,
              boa_token_id=125, eoa_token_index=126)


def tiny_config(**text):
    return transformers.Gemma4Config(text_config={**TEXT, **text}, vision_config=VISION, audio_config=AUDIO, **TOKENS)


def perturb(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "position_embedding" in name:
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.add_(0.2 * torch.randn_like(b))
    return model


@pytest.fixture(scope="module")
def g4v(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("gemma4_vl")
    perturb(transformers.Gemma4ForConditionalGeneration(tiny_config())).save_pretrained(d)
    return d


def pixels():
    """Two images through transformers' image processor, unresized: 16 x 24 pixels (4 x 6 patches, 6 soft tokens)
    and 8 x 16 (2 x 4 patches, 2 soft tokens)."""
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((16, 24), (8, 16))]
    out = transformers.Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)(
        images=images, do_resize=False, return_tensors="pt")
    assert list(out["num_soft_tokens_per_image"]) == [6, 2]
    return out["pixel_values"], out["image_position_ids"]


def image_run(n: int) -> list[int]:
    return [BOI] + [IMAGE] * n + [EOI]


def batch():
    """Row 0: both images; row 1: text, right-padded."""
    g = torch.Generator().manual_seed(0)
    text = lambda n: torch.randint(3, 120, (n,), generator=g).tolist()  # noqa: E731
    row0 = text(3) + image_run(6) + text(4) + image_run(2) + text(5)
    T = len(row0)
    ids = torch.tensor([row0, text(T)])
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    ids[1, 15:] = 0
    return ids, mask


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def hf_logits(hf, ids, mask, pv, pos, image: int = IMAGE):
    """transformers' training forward: `mm_token_type_ids` (1 at the image tokens), as its processor returns."""
    return hf(input_ids=ids, attention_mask=mask, pixel_values=pv, image_position_ids=pos,
              mm_token_type_ids=(ids == image).long()).logits


def load_hf(folder):
    return transformers.Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def load_ours(folder):
    return load_pretrained(folder, models.from_hf_config).eval()


def test_logits_with_images_equal_transformers(g4v, tmp_path):
    hf, ours = load_hf(g4v), load_ours(g4v)
    assert not any(k.startswith(("model.audio_tower", "model.embed_audio")) for k in ours.state_dict())
    ids, mask = batch()
    pv, pos = pixels()
    real = mask.bool()
    with torch.no_grad():
        ref = hf_logits(hf, ids, mask, pv, pos)
        got = ours.lm_head(ours(ids, mask, pixel_values=pv, image_position_ids=pos))
        print(f"max relative logit difference with images: {rel(got[real], ref[real]):.2e}")
        assert rel(got[real], ref[real]) <= 1e-4
        # the two-way attention matters (transformers without mm_token_type_ids: causal everywhere)
        causal = hf(input_ids=ids, attention_mask=mask, pixel_values=pv, image_position_ids=pos).logits
        assert rel(causal[real], ref[real]) > 1e-3
        # text alone (an image token among the text embeds as the pad token, as transformers)
        text = ids[1:, :15].clone()
        text[0, 3] = IMAGE
        assert rel(ours.lm_head(ours(text)), hf(input_ids=text).logits) <= 1e-4
        # the images matter
        other = ours.lm_head(ours(ids, mask, pixel_values=pv.flip(-1), image_position_ids=pos))
        assert rel(other[:1], got[:1]) > 1e-3
    # without use_bidirectional_attention: causal everywhere, as transformers then
    shutil.copytree(g4v, tmp_path / "causal")
    config = json.loads((g4v / "config.json").read_text())
    config["text_config"]["use_bidirectional_attention"] = None
    (tmp_path / "causal" / "config.json").write_text(json.dumps(config))
    plain = load_ours(tmp_path / "causal")
    with torch.no_grad():
        got = plain.lm_head(plain(ids, mask, pixel_values=pv, image_position_ids=pos))
        ref = hf_logits(load_hf(tmp_path / "causal"), ids, mask, pv, pos)
    assert rel(got[real], ref[real]) <= 1e-4 and rel(got[real], causal[real]) <= 1e-4


def test_clipped_linears_and_standardized_features_equal_transformers(tmp_path):
    """A tower with `use_clipped_linears` (its linears' inputs and outputs clamped by stored bounds, set here so
    that they bite) and `standardize` ((x - std_bias) * std_scale after the pooling): logits with images equal."""
    torch.manual_seed(0)
    cfg = tiny_config()
    cfg.vision_config.use_clipped_linears = cfg.vision_config.standardize = True
    hf = perturb(transformers.Gemma4ForConditionalGeneration(cfg)).eval()
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith(("input_min", "input_max", "output_min", "output_max")):
                b.fill_((-1 if name.endswith("min") else 1) * (0.5 if "input" in name else 0.2))
            elif name.endswith("std_bias"):
                b.copy_(0.1 * torch.randn_like(b))
            elif name.endswith("std_scale"):
                b.copy_(1 + 0.1 * torch.randn_like(b))
    hf.save_pretrained(tmp_path)
    ours = load_ours(tmp_path)
    assert ours.model.vision_tower.encoder.layers[0].mlp.up_proj.clipped
    ids, mask = batch()
    pv, pos = pixels()
    real = mask.bool()
    with torch.no_grad():
        ref = hf_logits(load_hf(tmp_path), ids, mask, pv, pos)
        got = ours.lm_head(ours(ids, mask, pixel_values=pv, image_position_ids=pos))
        unclipped = load_ours(tmp_path)
        for m in unclipped.modules():
            if hasattr(m, "clipped"):
                m.clipped = False
        loose = unclipped.lm_head(unclipped(ids, mask, pixel_values=pv, image_position_ids=pos))
    assert rel(got[real], ref[real]) <= 1e-4 and rel(loose[real], ref[real]) > 1e-3


def test_every_gradient_with_images_equals_transformers(g4v):
    """The loss of a padded batch with images and the gradient of every parameter, the tower's and its embedder's
    included (the pooling, the axial RoPE, the padding patches' mask), equal transformers'."""
    hf, ours = load_hf(g4v).train(), load_ours(g4v).train().requires_grad_(True)
    ids, mask = batch()
    pv, pos = pixels()
    labels = ids.masked_fill((mask == 0) | (ids == IMAGE), -100)
    loss_ref = hf(input_ids=ids, attention_mask=mask, pixel_values=pv, image_position_ids=pos,
                  mm_token_type_ids=(ids == IMAGE).long(), labels=labels).loss
    loss_ref.backward()
    logits = ours.output_projection(ours(ids, mask, pixel_values=pv, image_position_ids=pos))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    loss.backward()
    assert float(loss) == pytest.approx(float(loss_ref), rel=1e-5)
    theirs = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    mine = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    assert set(mine) == {n for n in theirs if not n.startswith(("model.audio_tower.", "model.embed_audio."))}
    assert any(n.startswith("model.vision_tower.") for n in mine)
    worst = max(float((g - theirs[n]).norm() / theirs[n].norm().clamp(min=1e-12)) for n, g in mine.items())
    print(f"max relative gradient difference with images: {worst:.2e}")
    assert worst <= 1e-4


def test_image_count_mismatch_is_refused(g4v):
    ours = load_ours(g4v)
    ids, mask = batch()
    pv, pos = pixels()
    with pytest.raises(ValueError, match="8 image tokens for 6 image features"):
        ours(ids, mask, pixel_values=pv[:1], image_position_ids=pos[:1])


def test_config_round_trip(g4v):
    d = json.loads((g4v / "config.json").read_text())
    cfg = models.config_from_hf(d)
    assert (cfg.vision.patch_size, cfg.vision.pooling_kernel_size, cfg.image_token_id) == (4, 2, IMAGE)
    again = cfg.to_hf()
    assert models.config_from_hf(json.loads(json.dumps(again))) == cfg
    assert again["vision_config"] == d["vision_config"] and again["audio_config"] == d["audio_config"]
    with pytest.raises(ValueError, match="rope_type 'axial'"):
        models.config_from_hf({**d, "vision_config": {**d["vision_config"],
                                                      "rope_parameters": {"rope_type": "default"}}})
    with pytest.raises(ValueError, match=r"\['nonsense'\]"):
        models.config_from_hf({**d, "vision_config": {**d["vision_config"], "nonsense": 1}})


def test_greedy_generation_after_images_equals_transformers(g4v):
    """Prompts with images (row 1 left-padded, one image each): greedy tokens equal `generate`."""
    hf, ours = load_hf(g4v), load_ours(g4v)
    ids, _ = batch()
    pv, pos = pixels()
    prompt0 = ids[0, :20]  # both images
    g = torch.Generator().manual_seed(3)
    prompt1 = torch.tensor(torch.randint(3, 120, (4,), generator=g).tolist() + image_run(2) + [7, 8])
    T = 20
    ids = torch.zeros(2, T + 2, dtype=torch.long)
    ids[0, 2:], ids[1, -len(prompt1):] = prompt0, prompt1
    mask = (torch.arange(T + 2)[None] >= torch.tensor([[2], [T + 2 - len(prompt1)]])).long()
    pv3, pos3 = torch.cat([pv, pv[1:]]), torch.cat([pos, pos[1:]])
    ref = hf.generate(input_ids=ids, attention_mask=mask, pixel_values=pv3, image_position_ids=pos3,
                      mm_token_type_ids=(ids == IMAGE).long(), max_new_tokens=8, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    got = models.family(ours).generate(ours, ids, mask, max_new_tokens=8, eos_token_id=[], pixel_values=pv3,
                                       image_position_ids=pos3)
    assert torch.equal(got, ref)


def lora_saved(folder: Path, targets: tuple[str, ...], adapter: Path):
    """Our model of `folder` with LoRA on `targets` (r 4, its B drawn at random), saved in peft's format."""
    from minitrain.adapters.lora import LoRAConfig, apply_lora
    from minitrain.adapters.peft_format import save_adapter

    ours = load_ours(folder)
    cfg = LoRAConfig(r=4, alpha=8, targets=targets)
    apply_lora(ours, cfg)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    save_adapter(ours, adapter, cfg)
    return ours


def test_lora_adapter_loads_in_peft_with_images(g4v, tmp_path):
    """LoRA on the language model's projections, saved in peft's format: peft puts it on
    `AutoModelForImageTextToText` (the same module names) with our logits on a batch with images; none on the
    tower, whose attention and MLP have the same leaf names."""
    peft = pytest.importorskip("peft")
    ours = lora_saved(g4v, ("q_proj", "v_proj", "gate_proj", "down_proj"), tmp_path)
    assert not [n for n, _ in ours.named_parameters() if "lora_" in n and "language_model" not in n]
    hf = transformers.AutoModelForImageTextToText.from_pretrained(g4v, dtype=torch.float32)
    ref = peft.PeftModel.from_pretrained(hf, tmp_path).eval()
    assert not [n for n, _ in ref.named_parameters() if "lora_" in n and "language_model" not in n]
    ids, mask = batch()
    pv, pos = pixels()
    real = mask.bool()
    with torch.no_grad():
        a = hf_logits(ref, ids, mask, pv, pos)
        b = ours.lm_head(ours(ids, mask, pixel_values=pv, image_position_ids=pos))
        with ref.disable_adapter():
            plain = hf_logits(ref, ids, mask, pv, pos)
    print(f"max relative logit difference, LoRA in peft with images: {rel(b[real], a[real]):.2e}")
    assert rel(b[real], a[real]) <= 1e-5 and rel(plain[real], a[real]) > 1e-3


def test_a_saved_folder_loads_in_transformers(g4v, tmp_path):
    """`save_pretrained` (full fine-tuning, merge) writes a folder transformers loads with the same logits with
    images; a changed tower arrives, the audio tower's tensors are written back bit for bit."""
    from safetensors.torch import load_file

    from minitrain.weights import save_pretrained

    ours = load_ours(g4v)
    with torch.no_grad():
        ours.model.vision_tower.encoder.layers[0].input_layernorm.weight.add_(0.1)
    save_pretrained(ours, tmp_path / "saved", json.loads((g4v / "config.json").read_text()))
    before, after = load_file(g4v / "model.safetensors"), load_file(tmp_path / "saved" / "model.safetensors")
    assert set(after) == set(before)
    audio = [k for k in before if k.startswith(("model.audio_tower.", "model.embed_audio."))]
    assert audio and all(torch.equal(after[k], before[k]) for k in audio)
    hf = load_hf(tmp_path / "saved")
    ids, mask = batch()
    pv, pos = pixels()
    with torch.no_grad():
        a = hf_logits(hf, ids, mask, pv, pos)
        b = ours.lm_head(ours(ids, mask, pixel_values=pv, image_position_ids=pos))
    assert rel(b[mask.bool()], a[mask.bool()]) <= 1e-4


# --------------------------------------------------------------------------------------------
# A checkpoint folder with its tokenizer, chat template and image processor: rows, processor, CLI
# --------------------------------------------------------------------------------------------

PRE = {"image_processor_type": "Gemma4ImageProcessor", "processor_class": "Gemma4Processor", "patch_size": 4,
       "pooling_kernel_size": 2, "max_soft_tokens": 70}
MEDIA = ["<|image>", "<image|>", "<|audio>", "<audio|>"]  # boi, eoi, boa, eoa (`<|image|>` etc.: the template's)


def g4_folder(d: Path) -> Path:
    """A tiny Gemma 4 folder: a Gemma-shaped tokenizer with Gemma 4's special tokens (the processor finds the
    media ones as `extra_special_tokens`), Gemma 4's chat template, preprocessor_config.json, the model above
    over its vocabulary."""
    from _tok import add_special_tokens, make_gemma_tokenizer
    from test_chat_template import GEMMA4

    make_gemma_tokenizer(d)
    (d / "tokenizer.model").unlink()  # tokenizer.json alone holds the added tokens
    ids = add_special_tokens(d, GEMMA4 + MEDIA)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["extra_special_tokens"] = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                                  "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    (d / "chat_template.jinja").write_text((Path(__file__).parent / "fixtures" / "chat_templates" / "gemma4.jinja")
                                           .read_text())
    (d / "preprocessor_config.json").write_text(json.dumps(PRE))
    cfg = transformers.Gemma4Config(
        text_config={**TEXT, "vocab_size": 448, "vocab_size_per_layer_input": 448, "eos_token_id": [1, ids["<turn|>"]]},
        vision_config=VISION, audio_config=AUDIO, image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
        audio_token_id=ids["<|audio|>"], boi_token_id=ids["<|image>"], eoi_token_id=ids["<image|>"],
        boa_token_id=ids["<|audio>"], eoa_token_index=ids["<audio|>"])
    torch.manual_seed(0)
    perturb(transformers.Gemma4ForConditionalGeneration(cfg)).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def g4dir(tmp_path_factory) -> dict[str, Path]:
    from test_gemma3_vl import write_rows

    root = tmp_path_factory.mktemp("gemma4_rows")
    return {"root": root, "model": g4_folder(root / "model"), "data": write_rows(root / "data")}


def processor(folder: Path):
    """transformers' `Gemma4Processor` of the folder, built by hand: its video processor needs torchvision, which
    the test extras lack (the video processor is never called on image rows)."""
    from unittest import mock

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    kw = {k: v for k, v in PRE.items() if not k.endswith(("_type", "_class"))}
    with mock.patch.object(transformers.processing_utils.ProcessorMixin, "check_argument_for_proper_class",
                           lambda self, name, arg: None):
        return transformers.Gemma4Processor(
            feature_extractor=transformers.Gemma4AudioFeatureExtractor(),
            image_processor=transformers.Gemma4ImageProcessorPil(**kw), tokenizer=tok, video_processor=None,
            chat_template=(folder / "chat_template.jinja").read_text())


def rows_of(g4dir):
    from minitrain.data.images import ImageRows
    from minitrain.data.readers import read_sft
    from minitrain.text.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(g4dir["model"])
    config = json.loads((g4dir["model"] / "config.json").read_text())
    images = ImageRows.from_checkpoint(config, PRE, lambda i: tok.decode([i], skip_special=False))
    return read_sft(g4dir["data"], tok, max_len=512, images=images), images, tok


def test_rows_equal_the_processor(g4dir):
    """Each row's ids (the chat with every `<|image|>` expanded to `<|image>` + its soft tokens + `<image|>`) equal
    the Gemma 4 processor's `apply_chat_template` on the same chat; image tokens and the prompt take no loss; the
    collated pixel values and patch positions equal the processor's."""
    from test_gemma3_vl import trl_messages

    from minitrain.data.collate import IGNORE_INDEX, collate_causal
    from minitrain.data.images import collate_images

    examples, images, tok = rows_of(g4dir)
    assert images.placeholder == "<|image|>" and images.wrap is not None
    hf = processor(g4dir["model"])
    rows = [json.loads(line) for line in g4dir["data"].read_text().splitlines()]
    base = g4dir["data"].parent
    for ex, row in zip(examples, rows):
        ref = hf.apply_chat_template(trl_messages(row, base), tokenize=True, return_dict=True, return_tensors="np")
        assert ex["input_ids"] == ref["input_ids"][0].tolist()
        batch = collate_images([ex], lambda e: collate_causal(e, tok.pad_id), images.spec)
        if "pixel_values" in ref:
            assert np.array_equal(batch["pixel_values"].numpy(), ref["pixel_values"])
            assert np.array_equal(batch["image_position_ids"].numpy(), ref["image_position_ids"])
        else:
            assert "pixel_values" not in batch
        assert all(label == IGNORE_INDEX for i, label in zip(ex["input_ids"], ex["labels"])
                   if i in (images.token_id, *images.wrap))
        target = tok.decode([i for i, label in zip(ex["input_ids"], ex["labels"]) if label != IGNORE_INDEX])
        assert target.strip().removesuffix("<turn|>").strip() in ("It is red.", "A blue square.",
                                                                  "The first is smaller.", "Fine.")
    counts = [ex["input_ids"].count(images.token_id) for ex in examples]
    assert all(counts[:3]) and counts[3] == 0  # one, one and three images; none


def test_collated_loss_equals_transformers(g4dir):
    from minitrain.data.collate import collate_causal
    from minitrain.data.images import collate_images
    from minitrain.objectives.sft import sft

    examples, images, tok = rows_of(g4dir)
    batch = collate_images(examples, lambda ex: collate_causal(ex, tok.pad_id), images.spec)
    assert batch["pixel_values"].shape == (5, 280, 48) and batch["image_position_ids"].shape == (5, 280, 2)
    ours = load_ours(g4dir["model"])
    hf = load_hf(g4dir["model"])
    with torch.no_grad():
        loss_sum, count, _ = sft(ours, batch)
        ref = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                 pixel_values=batch["pixel_values"], image_position_ids=batch["image_position_ids"],
                 mm_token_type_ids=(batch["input_ids"] == images.token_id).long()).loss
    assert abs(float(loss_sum / count) - float(ref)) <= 1e-5 * float(ref)


REPO = Path(__file__).resolve().parents[1]


def test_lora_sft_on_image_rows_from_the_cli(g4dir, capsys):
    """`python -m minitrain recipes/sft.py model=... data=...` on image rows: LoRA on the language model, the tower
    frozen and quiet in the audit, the loss falling over 4 steps of the same batch; the adapter loads in peft on
    `AutoModelForImageTextToText` with our logits on the rows' images."""
    from minitrain.adapters.peft_format import load_adapter
    from minitrain.cli import run_cli
    from minitrain.data.collate import collate_causal
    from minitrain.data.images import collate_images

    peft = pytest.importorskip("peft")
    out = g4dir["root"] / "out"
    code = run_cli([str(REPO / "recipes" / "sft.py"), f"model={g4dir['model']}", f"data={g4dir['data']}",
                    f"out={out}", "max_steps=4", "batch_size=4", "lora_r=4", "lora_alpha=8", "device=cpu",
                    "max_len=512", "lr=1e-2", "warmup=0", "eval_data="])
    log, err = capsys.readouterr()
    assert code == 0, err
    assert "audit: healthy" in log + err and "vision_tower" not in log + err
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    print(f"CLI LoRA SFT losses: {losses}")
    assert len(losses) == 4 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    adapter = next(out.rglob("adapter_model.safetensors")).parent
    from safetensors import safe_open

    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        assert all("language_model" in k for k in f.keys())
    ref = peft.PeftModel.from_pretrained(transformers.AutoModelForImageTextToText.from_pretrained(
        g4dir["model"], dtype=torch.float32), adapter).eval()
    ours = load_ours(g4dir["model"])
    load_adapter(ours, adapter)
    examples, images, tok = rows_of(g4dir)
    b = collate_images(examples[:3], lambda ex: collate_causal(ex, tok.pad_id), images.spec)
    with torch.no_grad():
        a = hf_logits(ref, b["input_ids"], b["attention_mask"], b["pixel_values"], b["image_position_ids"],
                      images.token_id)
        o = ours.lm_head(ours(b["input_ids"], b["attention_mask"], pixel_values=b["pixel_values"],
                              image_position_ids=b["image_position_ids"]))
    real = b["attention_mask"].bool()
    assert rel(o[real], a[real]) <= 1e-5


def test_full_finetuning_on_image_rows_writes_a_folder_transformers_loads(g4dir, capsys):
    """finetune=full from the CLI: the audit reaches the tower and its embedder on an image row; the written folder
    (the audio tower bit for bit) loads in transformers with our logits on an image batch."""
    from safetensors.torch import load_file

    from minitrain.cli import run_cli
    from minitrain.data.collate import collate_causal
    from minitrain.data.images import collate_images

    out = g4dir["root"] / "full"
    capsys.readouterr()
    code = run_cli([str(REPO / "recipes" / "sft.py"), f"model={g4dir['model']}", f"data={g4dir['data']}",
                    f"out={out}", "max_steps=1", "batch_size=2", "finetune=full", "device=cpu", "max_len=512",
                    "eval_data="])
    log, err = capsys.readouterr()
    assert code == 0, err
    assert "audit: healthy" in log + err
    folder = out / "model"
    ours, base = load_ours(folder), load_ours(g4dir["model"])
    for name in ("vision_tower.patch_embedder.input_proj.weight", "embed_vision.embedding_projection.weight"):
        assert not torch.equal(ours.model.get_parameter(name), base.model.get_parameter(name)), name
    before, after = load_file(g4dir["model"] / "model.safetensors"), load_file(folder / "model.safetensors")
    audio = [k for k in before if k.startswith(("model.audio_tower.", "model.embed_audio."))]
    assert set(after) == set(before) and audio and all(torch.equal(after[k], before[k]) for k in audio)
    examples, images, tok = rows_of(g4dir)
    b = collate_images(examples[:3], lambda ex: collate_causal(ex, tok.pad_id), images.spec)
    with torch.no_grad():
        a = hf_logits(load_hf(folder), b["input_ids"], b["attention_mask"], b["pixel_values"],
                      b["image_position_ids"], images.token_id)
        o = ours.lm_head(ours(b["input_ids"], b["attention_mask"], pixel_values=b["pixel_values"],
                              image_position_ids=b["image_position_ids"]))
    real = b["attention_mask"].bool()
    assert rel(o[real], a[real]) <= 1e-4


def test_the_memory_plan_counts_the_tower(g4dir, capsys):
    """`minitrain plan` (and a CUDA run's memory check) on a Gemma 4 folder with a vision tower: the tower's
    weights, the pixels and its forward (tests/test_plan_vision.py measures them); finetune=full is one line,
    as the text plan's."""
    from minitrain.commands import plan

    capsys.readouterr()
    args = [str(REPO / "recipes" / "sft.py"), f"model={g4dir['model']}", f"data={g4dir['data']}"]
    assert plan.main(args) == 0
    out = capsys.readouterr().out
    assert "weights: vision tower + projector" in out and "pixel values" in out, out
    assert plan.main([*args, "finetune=full"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "finetune=full" in err[0] and "memory_check=false" in err[0], err
