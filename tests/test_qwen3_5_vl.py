"""Multimodal Qwen3.5 (`models/qwen3_5.py`'s `Qwen3_5ForConditionalGeneration`: Qwen3-VL's tower without DeepStack
over Qwen3.5's language model) against transformers' `Qwen3_5ForConditionalGeneration` with images.

A tiny random checkpoint saved once per module by transformers 5 (fp32; the norms perturbed so that they matter,
`initializer_range=0.15` so that the DeltaNet layers do): a 2-block tower (32 wide, 2 heads, patches of 4 pixels,
merge 2, a 4 x 4 position table) and a 4-layer language model, DeltaNet and full-attention layers alternating,
whose interleaved M-RoPE splits the rotated half of head dim 16 into sections (1, 1, 2). The batch is Qwen2.5-VL's
test batch (two images of different grids in one row, one in another, a right-padded text row). Compared: logits
with images, text-only logits, greedy generation after an image prompt (left padding), a LoRA adapter in peft on
`AutoModelForImageTextToText`, a saved folder in transformers, the MoE sizes' logits with images, the config's
round trip and refusals.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from test_qwen2_5_vl import IMAGE, batch, check_generation_after_images, check_lora_in_peft, check_saved_folder, \
    hf_logits, rel

import models
from minitrain.weights import load_pretrained

TEXT = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            initializer_range=0.15, layer_types=["linear_attention", "full_attention"] * 2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [1, 1, 2], "mrope_interleaved": True})
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def tiny_config(moe: bool = False, **text):
    text = {**TEXT, **text}
    if moe:
        text = {k: v for k, v in text.items() if k != "intermediate_size"} | EXPERTS
    return (transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config)(
        text_config=text, vision_config=VISION, image_token_id=IMAGE, video_token_id=151, vision_start_token_id=152,
        vision_end_token_id=153)


def save_tiny(d: Path, moe: bool = False) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(tiny_config(moe))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("A_log"):  # decays in [0.01, 1] (tests/test_qwen3_5.py: fp32 meets 1e-4 there)
                p.copy_(torch.empty_like(p).uniform_(0.01, 1).log())
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def vl35(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("qwen3_5_vl"))


@pytest.fixture(scope="module")
def pair(vl35):
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(vl35, dtype=torch.float32).eval()
    return hf, load_pretrained(vl35, models.from_hf_config).eval()


def check_image_logits(hf, ours) -> torch.Tensor:
    """Our logits of the image batch equal transformers' (at the real positions) to 1e-4 relative; ours returned."""
    ids, mask, pixels, grid = batch()
    with torch.no_grad():
        ref = hf_logits(hf, ids, mask, pixels, grid)
        got = ours.lm_head(ours(ids, mask, pixel_values=pixels, image_grid_thw=grid))
    assert rel(got[mask.bool()], ref[mask.bool()]) <= 1e-4
    return got


def test_logits_with_images_equal_transformers(pair):
    hf, ours = pair
    got = check_image_logits(hf, ours)
    ids, mask, pixels, grid = batch()
    with torch.no_grad():
        # text alone (the three M-RoPE axes agree): Qwen3.5's RoPE
        text = ids[2:, :40]
        assert rel(ours.lm_head(ours(text)), hf(input_ids=text).logits) <= 1e-4
        # the images matter, and so do the 3-D positions (text positions over the same embeddings differ)
        other = ours.lm_head(ours(ids, mask, pixel_values=pixels.flip(0), image_grid_thw=grid))
        assert rel(other[:2], got[:2]) > 1e-3
        flat = hf(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid,
                  position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        assert rel(flat[:2], got[:2]) > 1e-4


def test_greedy_generation_after_images_equals_transformers(pair):
    """3-D positions in the prompt (DeltaNet states and attention keys in the cache), the tokens after it counted
    on from its largest position."""
    check_generation_after_images(*pair)


def test_lora_adapter_loads_in_peft_with_images(vl35, tmp_path):
    """Our adapter in peft on transformers' class, as AutoModelForImageTextToText builds it; the tower frozen."""
    check_lora_in_peft(vl35, [transformers.AutoModelForImageTextToText], tmp_path)


def test_a_saved_folder_loads_in_transformers(vl35, tmp_path):
    ours = load_pretrained(vl35, models.from_hf_config).eval()
    with torch.no_grad():  # as after fine-tuning: not the weights transformers saved
        ours.model.visual.merger.linear_fc1.weight.mul_(1.5)
        ours.model.language_model.layers[1].self_attn.q_norm.weight.add_(0.3)
    check_saved_folder(ours, vl35, transformers.Qwen3_5ForConditionalGeneration, tmp_path)


def test_the_moe_sizes_take_images_too(tmp_path):
    """`qwen3_5_moe`: the same tower and image forward over the MoE language model."""
    folder = save_tiny(tmp_path / "moe", moe=True)
    hf = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    check_image_logits(hf, load_pretrained(folder, models.from_hf_config).eval())


def test_config_round_trip_and_refusals(vl35):
    d = json.loads((vl35 / "config.json").read_text())
    cfg = models.config_from_hf(d)
    assert cfg.mrope_section == [1, 1, 2] and cfg.vision.deepstack_visual_indexes == [] and cfg.rotary_dim == 8
    # frequencies 0..3 of the rotated 8: temporal, height, width, temporal (transformers' interleaving)
    assert cfg.mrope_axes().tolist() == [0, 1, 2, 0] * 2
    again = cfg.to_hf()
    assert again["text_config"]["rope_parameters"]["mrope_section"] == [1, 1, 2]
    assert models.config_from_hf(json.loads(json.dumps(again))) == cfg
    assert transformers.Qwen3_5Config(**again).text_config.rope_parameters["mrope_section"] == [1, 1, 2]
    with pytest.raises(ValueError, match="deepstack_visual_indexes is not a Qwen3.5 field"):
        models.config_from_hf({**d, "vision_config": {**d["vision_config"], "deepstack_visual_indexes": [0]}})
    rope = {**d["text_config"]["rope_parameters"], "mrope_section": [2, 2]}
    with pytest.raises(ValueError, match=r"mrope_section \[2, 2\] — it must be three counts"):
        models.config_from_hf({**d, "text_config": {**d["text_config"], "rope_parameters": rope}})


def test_transformers_default_config_builds_its_shapes(tmp_path):
    """transformers' default `Qwen3_5Config` (a 32-layer model, the tower of its vision defaults) as config.json:
    built on the meta device, our model has transformers' parameter names and shapes; the sections of its RoPE
    (11, 11, 10) cover the 32 rotated frequencies of a 256-wide head."""
    cfg = transformers.Qwen3_5Config()
    cfg.save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    with torch.device("meta"):
        ours, hf = models.from_hf_config(d), transformers.Qwen3_5ForConditionalGeneration(cfg)
    shapes = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items()}  # noqa: E731
    assert shapes(ours) == shapes(hf)
    ours_cfg = models.config_from_hf(d)
    assert ours_cfg.mrope_section == [11, 11, 10] and ours_cfg.rotary_dim // 2 == 32
    assert ours_cfg.vision.depth == cfg.vision_config.depth and ours_cfg.vision.deepstack_visual_indexes == []
