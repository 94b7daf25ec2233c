"""Multimodal Gemma 3 (`models/gemma3_vl.py`) against transformers' `Gemma3ForConditionalGeneration`.

A tiny random checkpoint saved once per session by transformers 5 (fp32; the norms perturbed so that they
matter; the projection, which transformers starts at zeros, drawn): a 2-layer SigLIP tower (32 wide, 2 heads, 32-pixel images in patches of 4: an 8 x 8 grid pooled to
mm_tokens_per_image 4) and a 3-layer Gemma 3 language model (sliding, global, sliding; a window of 3 tokens,
shorter than an image's 4 soft tokens, so that the window and the images' two-way attention meet). Compared:
logits with images in the batch (two images in one row, one in another, a padded text-only row), text-only
logits, greedy generation after image prompts, the layouts transformers saves and the Hub holds, the config's
round trip, a LoRA adapter in peft, a saved folder in transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

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


def hf_logits(hf, ids, mask, pixels):
    """transformers' training forward: `token_type_ids` (1 at the soft tokens), as its processor returns."""
    return hf(input_ids=ids, attention_mask=mask, pixel_values=pixels, token_type_ids=(ids == SOFT).long()).logits


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
