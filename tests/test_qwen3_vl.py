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
from test_qwen2_5_vl import IMAGE, batch, check_generation_after_images, check_lora_in_peft, \
    check_generation_after_videos, check_packed_rows_equal_each_alone, check_saved_folder, check_video_logits, \
    hf_logits, rel

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


def saved_tiny(hf_class, config, d: Path) -> Path:
    """transformers' `hf_class(config)` drawn from seed 0, its norms perturbed (so that they matter), saved in `d`."""
    torch.manual_seed(0)
    model = hf_class(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(d)
    return d


def loaded_pair(hf_class, folder: Path):
    """(transformers' model, ours) of `folder`, in eval mode."""
    return hf_class.from_pretrained(folder, dtype=torch.float32).eval(), load_pretrained(folder, models.from_hf_config).eval()


@pytest.fixture(scope="session")
def vl3(tmp_path_factory) -> Path:
    return saved_tiny(transformers.Qwen3VLForConditionalGeneration, tiny_config(), tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="module")
def pair(vl3):
    return loaded_pair(transformers.Qwen3VLForConditionalGeneration, vl3)


def test_logits_with_videos_equal_transformers(pair):
    """Each temporal patch of a video its own run (after its timestamp text), DeepStack features at the video's
    places too."""
    check_video_logits(*pair, frames_apart=True)


def test_greedy_generation_after_videos_equals_transformers(pair):
    check_generation_after_videos(*pair, frames_apart=True)


def test_logits_with_images_equal_transformers(pair):
    hf, ours = pair
    ids, mask, pixels, grid = batch()
    real = mask.bool()
    with torch.no_grad():
        ref = hf_logits(hf, ids, mask, pixels, grid)
        got = ours.lm_head(ours(ids, mask, pixel_values=pixels, image_grid_thw=grid))
        assert rel(got[real], ref[real]) <= 1e-4
        # the padded layer loop of a forward that captures layers (distillation) adds DeepStack's features too
        captured = ours(ids, mask, hidden_layers=(1,), pixel_values=pixels, image_grid_thw=grid)
        assert rel(ours.lm_head(captured.hidden)[real], ref[real]) <= 1e-4
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
        key = "model.visual.pos_embed.weight"
        assert torch.equal(ours.state_dict()[key], f.get_tensor(key))
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
    text = dict(d["text_config"], rope_parameters={**d["text_config"]["rope_parameters"], "mrope_interleaved": False})
    with pytest.raises(ValueError, match="mrope_interleaved=False"):
        models.config_from_hf({**d, "text_config": text})
    with pytest.raises(ValueError, match=r"vision_config field\(s\) \['window_size'\]"):
        models.config_from_hf({**d, "vision_config": {**d["vision_config"], "window_size": 112}})
    with pytest.raises(ValueError, match="deepstack_visual_indexes"):
        models.config_from_hf({**d, "vision_config": {**d["vision_config"], "deepstack_visual_indexes": [3]}})


# the shape of the Hub's Qwen3-VL-2B-Instruct config.json (transformers 4.57's spelling: `rope_scaling` with
# `rope_theta` beside it, the vision config's model_type "qwen3_vl")
HUB_2B = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "image_token_id": 151655, "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "dtype": "bfloat16",
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 6144, "max_position_embeddings": 262144, "model_type": "qwen3_vl_text",
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000, "tie_word_embeddings": True, "use_cache": True, "vocab_size": 151936},
    "tie_word_embeddings": True, "transformers_version": "4.57.0.dev0", "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1024,
        "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4096, "model_type": "qwen3_vl",
        "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2},
    "vision_end_token_id": 151653, "vision_start_token_id": 151652}


def test_the_hub_config_reads_as_transformers_reads_it():
    """Built on the meta device from the Hub's config, our model has transformers' parameter names and shapes
    (the checkpoint's keys), its RoPE base and sections and tied head."""
    ref = transformers.Qwen3VLConfig(**HUB_2B)
    cfg = models.config_from_hf(HUB_2B)
    assert (cfg.rope_theta, cfg.mrope_section) == (ref.text_config.rope_parameters["rope_theta"],
                                                   ref.text_config.rope_parameters["mrope_section"])
    assert cfg.tie_word_embeddings is ref.tie_word_embeddings is True
    assert cfg.vision.rope_theta == ref.vision_config.rope_parameters["rope_theta"]
    with torch.device("meta"):
        ours, hf = models.from_hf_config(HUB_2B), transformers.Qwen3VLForConditionalGeneration(ref)
    shapes = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items()}  # noqa: E731
    assert shapes(ours) == shapes(hf)
    assert ours.lm_head.weight is ours.model.language_model.embed_tokens.weight


def test_greedy_generation_after_images_equals_transformers(pair):
    """3-D positions and DeepStack in the prompt, the tokens after it counted on from its largest position."""
    check_generation_after_images(*pair)


def test_lora_adapter_loads_in_peft_with_images(vl3, tmp_path):
    """Our adapter in peft on transformers' class, as AutoModelForImageTextToText builds it."""
    assert transformers.AutoModelForImageTextToText.from_config(tiny_config()).__class__.__name__ == \
        "Qwen3VLForConditionalGeneration"
    check_lora_in_peft(vl3, [transformers.AutoModelForImageTextToText], tmp_path)


def test_a_saved_folder_loads_in_transformers(vl3, tmp_path):
    ours = load_pretrained(vl3, models.from_hf_config).eval()
    with torch.no_grad():  # as after fine-tuning: not the weights transformers saved
        ours.model.visual.deepstack_merger_list[1].linear_fc1.weight.mul_(1.5)
        ours.model.language_model.layers[0].self_attn.q_norm.weight.add_(0.3)
    check_saved_folder(ours, vl3, transformers.Qwen3VLForConditionalGeneration, tmp_path)


def test_packed_rows_with_images_equal_each_sequence_alone(pair):
    """Packed image rows: each sequence's logits as its own forward's (DeepStack's features added in the packed rows too)."""
    check_packed_rows_equal_each_alone(pair[1])
