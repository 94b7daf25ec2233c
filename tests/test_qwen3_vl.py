"""Qwen3-VL (`models/qwen3_vl.py`) against transformers' `Qwen3VLForConditionalGeneration`.

A tiny random checkpoint saved once per session by transformers 5 (fp32; the norms, LayerNorm biases included,
perturbed so that they matter): a 3-layer tower (32 wide, 2 heads, patches of 4 pixels, merge 2, a 4 x 4
position table resampled to each grid, DeepStack mergers after blocks 0 and 2) and a 3-layer Qwen3 language
model whose interleaved M-RoPE splits head dim 16 into sections (2, 3, 3). The batch is Qwen2.5-VL's test
batch (two images in one row, one in another, a padded text row). Compared: logits with images, text-only
logits, greedy generation after an image prompt, a LoRA adapter in peft, a saved folder in transformers, the
config's round trip and its refusals.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from test_qwen2_5_vl import IMAGE, batch, rel

import models
from minitrain.weights import load_pretrained

TEXT = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0,
                             "mrope_interleaved": True})
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0, 2])


def tiny_config(**text):
    return transformers.Qwen3VLConfig(text_config={**TEXT, **text}, vision_config=VISION, image_token_id=IMAGE,
                                      video_token_id=151, vision_start_token_id=152, vision_end_token_id=153)


@pytest.fixture(scope="session")
def vl3(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(tiny_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("qwen3_vl")
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def pair(vl3):
    hf = transformers.Qwen3VLForConditionalGeneration.from_pretrained(vl3, dtype=torch.float32).eval()
    return hf, load_pretrained(vl3, models.from_hf_config).eval()


def hf_logits(hf, ids, mask, pixels, grid) -> torch.Tensor:
    return hf(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid,
              mm_token_type_ids=(ids == IMAGE).long()).logits


def test_logits_with_images_equal_transformers(pair):
    hf, ours = pair
    ids, mask, pixels, grid = batch()
    real = mask.bool()
    with torch.no_grad():
        ref = hf_logits(hf, ids, mask, pixels, grid)
        got = ours.lm_head(ours(ids, mask, pixel_values=pixels, image_grid_thw=grid))
        assert rel(got[real], ref[real]) <= 1e-4
        # text alone (the three M-RoPE axes agree): Qwen3's RoPE
        text = ids[2:, :40]
        assert rel(ours.lm_head(ours(text)), hf(input_ids=text).logits) <= 1e-4
        # the images matter, and so do the DeepStack features (the parity above would miss neither)
        other = ours.lm_head(ours(ids, mask, pixel_values=pixels.flip(0), image_grid_thw=grid))
        assert rel(other[:2], got[:2]) > 1e-3
        saved = [m.linear_fc2.weight.clone() for m in ours.model.visual.deepstack_merger_list]
        for m in ours.model.visual.deepstack_merger_list:
            m.linear_fc2.weight.zero_()
        flat = ours.lm_head(ours(ids, mask, pixel_values=pixels, image_grid_thw=grid))
        for m, w in zip(ours.model.visual.deepstack_merger_list, saved):
            m.linear_fc2.weight.copy_(w)
        assert rel(flat[:2], got[:2]) > 1e-3


def test_interleaved_sections(vl3):
    """Frequency j of the 8 follows height at j = 1, 4, 7, width at 2, 5, temporal at 0, 3, 6 (sections 2, 3, 3)."""
    cfg = models.config_from_hf(json.loads((vl3 / "config.json").read_text()))
    assert cfg.mrope_axes().tolist() == [0, 1, 2, 0, 1, 2, 0, 1] * 2


def test_checkpoint_loads_key_for_key_in_both_layouts(vl3, tmp_path):
    """transformers 5 saves `model.visual.*` / `model.language_model.*` (our tree); the flat layout Qwen2.5-VL's
    Hub folders use (`visual.*`, `model.layers.*`) loads to the same model."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    ours = load_pretrained(vl3, models.from_hf_config)
    with safe_open(vl3 / "model.safetensors", "pt") as f:
        assert set(ours.state_dict()) == set(f.keys())
        assert torch.equal(ours.state_dict()["model.visual.pos_embed.weight"], f.get_tensor("model.visual.pos_embed.weight"))
    tensors = load_file(vl3 / "model.safetensors")
    flat = {(k[len("model."):] if k.startswith("model.visual.") else k.replace("model.language_model.", "model.", 1)): v
            for k, v in tensors.items()}
    save_file(flat, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((vl3 / "config.json").read_text())
    a, b = ours.state_dict(), load_pretrained(tmp_path, models.from_hf_config).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_config_round_trip_and_refusals(vl3):
    d = json.loads((vl3 / "config.json").read_text())
    cfg = models.config_from_hf(d)
    assert cfg.mrope_section == [2, 3, 3] and cfg.vision.deepstack_visual_indexes == [0, 2] and cfg.head_dim == 16
    again = cfg.to_hf()
    assert again["text_config"]["rope_parameters"]["mrope_interleaved"] is True
    assert models.config_from_hf(again) == cfg
    assert transformers.Qwen3VLConfig(**again).text_config.head_dim == 16
    with pytest.raises(ValueError, match="qwen3_vl_moe.*not supported"):
        models.config_from_hf({**d, "model_type": "qwen3_vl_moe"})
    text = dict(d["text_config"], rope_parameters={**d["text_config"]["rope_parameters"], "mrope_interleaved": False})
    with pytest.raises(ValueError, match="mrope_interleaved=False"):
        models.config_from_hf({**d, "text_config": text})
    with pytest.raises(ValueError, match=r"vision_config field\(s\) \['window_size'\]"):
        models.config_from_hf({**d, "vision_config": {**d["vision_config"], "window_size": 112}})
    with pytest.raises(ValueError, match="deepstack_visual_indexes"):
        models.config_from_hf({**d, "vision_config": {**d["vision_config"], "deepstack_visual_indexes": [3]}})


def test_greedy_generation_after_images_equals_transformers(pair):
    """A prompt with an image (left-padded beside a row with two): 3-D positions and DeepStack in the prompt,
    the tokens after it continuing from its largest position, as transformers' generation."""
    hf, ours = pair
    ids, _, pixels, grid = batch()
    ids, mask = ids[:2, :52].clone(), torch.ones(2, 52, dtype=torch.long)
    ids[1] = torch.cat([torch.zeros(52 - 40, dtype=torch.long), ids[1, :40]])  # row 1 left-padded
    mask[1, :12] = 0
    ref = hf.generate(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid,
                      mm_token_type_ids=(ids == IMAGE).long(), max_new_tokens=6, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    got = models.family(ours).generate(ours, ids, mask, max_new_tokens=6, eos_token_id=[], pixel_values=pixels,
                                       image_grid_thw=grid)
    assert torch.equal(got, ref)
    # two tokens after the prompt through the cache: the logits of a forward over the whole sequence
    nxt = torch.tensor([[5, 6], [7, 8]])
    full_ids, full_mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
    with torch.no_grad():
        whole = hf_logits(hf, full_ids, full_mask, pixels, grid)[:, -2:]
        cache = models.family(ours).KVCache(60)
        ours(ids, mask, cache=cache, pixel_values=pixels, image_grid_thw=grid)
        stepped = ours.lm_head(ours(nxt, torch.ones_like(nxt), cache=cache))
    assert rel(stepped, whole) <= 1e-4


def test_lora_adapter_loads_in_peft_with_images(vl3, tmp_path):
    """Our LoRA (B drawn at random) on the language model, saved in peft's format, loads in peft on
    transformers' class and through AutoModelForImageTextToText, with our logits on an image batch."""
    peft = pytest.importorskip("peft")
    from minitrain.adapters.lora import LoRAConfig, apply_lora
    from minitrain.adapters.peft_format import save_adapter

    ours = load_pretrained(vl3, models.from_hf_config).eval()
    cfg = LoRAConfig(r=4, alpha=8, targets=("q_proj", "v_proj", "gate_proj", "down_proj"))
    apply_lora(ours, cfg)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    assert not [n for n, _ in ours.named_parameters() if "lora_" in n and "visual" in n]
    save_adapter(ours, tmp_path, cfg)
    ids, mask, pixels, grid = batch()
    real = mask.bool()
    with torch.no_grad():
        b = ours.lm_head(ours(ids, mask, pixel_values=pixels, image_grid_thw=grid))
    for cls in (transformers.Qwen3VLForConditionalGeneration, transformers.AutoModelForImageTextToText):
        ref = peft.PeftModel.from_pretrained(cls.from_pretrained(vl3, dtype=torch.float32), tmp_path).eval()
        assert not [n for n, _ in ref.named_parameters() if "lora_" in n and "visual" in n]
        with torch.no_grad():
            a = hf_logits(ref, ids, mask, pixels, grid)
            with ref.disable_adapter():
                plain = hf_logits(ref, ids, mask, pixels, grid)
        assert rel(b[real], a[real]) <= 1e-5 and rel(plain[real], a[real]) > 1e-3


def test_a_saved_folder_loads_in_transformers(vl3, tmp_path):
    """`save_pretrained` (full fine-tuning, merge) writes a folder transformers loads, with the same logits."""
    from minitrain.weights import save_pretrained

    ours = load_pretrained(vl3, models.from_hf_config).eval()
    with torch.no_grad():  # as after fine-tuning: not the weights transformers saved
        ours.model.visual.deepstack_merger_list[1].linear_fc1.weight.mul_(1.5)
        ours.model.language_model.layers[0].self_attn.q_norm.weight.add_(0.3)
    config = dict(json.loads((vl3 / "config.json").read_text()), vocab_size=160)  # as a full fine-tuning run writes it
    save_pretrained(ours, tmp_path / "saved", config)
    again = load_pretrained(tmp_path / "saved", models.from_hf_config)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in ours.state_dict().items())
    hf = transformers.Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
    ids, mask, pixels, grid = batch()
    with torch.no_grad():
        a = hf_logits(hf, ids, mask, pixels, grid)
        b = ours.lm_head(ours(ids, mask, pixel_values=pixels, image_grid_thw=grid))
    assert rel(b[mask.bool()], a[mask.bool()]) <= 1e-4
