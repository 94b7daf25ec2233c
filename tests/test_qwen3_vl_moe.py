"""Qwen3-VL-MoE (`models/qwen3_vl_moe.py`) against transformers' `Qwen3VLMoeForConditionalGeneration`.

A tiny random checkpoint saved once per session by transformers 5 (fp32; norms perturbed): Qwen3-VL's 3-layer
tower of tests/test_qwen3_vl.py (DeepStack after blocks 0 and 2) over a 3-layer Qwen3-MoE language model
(4 experts of 24, top 2; layer 1 dense, `mlp_only_layers`), head dim 16 in interleaved M-RoPE sections
(2, 3, 3). Compared: logits with images, text-only logits, the load-balancing loss, greedy generation after an
image prompt, an expert adapter in peft (`target_parameters`), a saved folder in transformers, both expert
layouts, the config's round trip and its refusals, the Hub's 30B-A3B config's shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_qwen2_5_vl import IMAGE, batch, check_generation_after_images, check_packed_rows_equal_each_alone, \
    check_saved_folder, check_video_logits, hf_logits, rel
from test_qwen3_vl import TEXT, VISION, loaded_pair, saved_tiny

import models
from minitrain.weights import load_pretrained

MOE = dict(TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1],
           router_aux_loss_coef=0.01)


def tiny_config(**text):
    return transformers.Qwen3VLMoeConfig(text_config={**MOE, **text}, vision_config=VISION, image_token_id=IMAGE,
                                         video_token_id=151, vision_start_token_id=152, vision_end_token_id=153)


@pytest.fixture(scope="session")
def vlmoe(tmp_path_factory) -> Path:
    return saved_tiny(transformers.Qwen3VLMoeForConditionalGeneration, tiny_config(),
                      tmp_path_factory.mktemp("qwen3_vl_moe"))


@pytest.fixture(scope="module")
def pair(vlmoe):
    return loaded_pair(transformers.Qwen3VLMoeForConditionalGeneration, vlmoe)


def test_logits_and_aux_loss_with_images_equal_transformers(pair):
    hf, ours = pair
    ids, mask, pixels, grid = batch()
    real = mask.bool()
    with torch.no_grad():
        ref = hf_logits(hf, ids, mask, pixels, grid)
        got = ours.lm_head(ours(ids, mask, pixel_values=pixels, image_grid_thw=grid))
        assert rel(got[real], ref[real]) <= 1e-4
        text = ids[2:, :40]
        assert rel(ours.lm_head(ours(text)), hf(input_ids=text).logits) <= 1e-4
    # the load-balancing loss over the real tokens, as transformers computes it with output_router_logits
    hf.train(), ours.train()
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid,
                  mm_token_type_ids=(ids == IMAGE).long(), output_router_logits=True).aux_loss
        ours(ids, mask, pixel_values=pixels, image_grid_thw=grid)
        _, metrics = ours.router_aux_loss(mask)
    hf.eval(), ours.eval()
    assert metrics["aux_loss"] == pytest.approx(float(want), rel=1e-5)


def test_logits_with_videos_equal_transformers(pair):
    """Qwen3-VL's video forward (each temporal patch its own run, DeepStack at the video's places) over the experts."""
    check_video_logits(*pair, frames_apart=True)


def test_fused_experts_load_in_both_layouts(vlmoe, tmp_path):
    """transformers 5 saves the experts in its in-memory layout ((E, 2F, D), (E, D, F): ours); the Hub's files hold
    them transposed ((E, D, 2F), (E, F, D)), and load to the same tensors; the dense layer has no experts."""
    ours = load_pretrained(vlmoe, models.from_hf_config)
    key = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    with safe_open(vlmoe / "model.safetensors", "pt") as f:
        assert set(ours.state_dict()) == set(f.keys())
        assert torch.equal(ours.state_dict()[key], f.get_tensor(key))
    E, F, D = 4, 24, 64
    assert ours.state_dict()[key].shape == (E, 2 * F, D)
    tensors = {k: (v.transpose(1, 2).contiguous() if ".experts." in k else v)
               for k, v in load_file(vlmoe / "model.safetensors").items()}
    assert tensors[key].shape == (E, D, 2 * F)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((vlmoe / "config.json").read_text())
    a, b = ours.state_dict(), load_pretrained(tmp_path, models.from_hf_config).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any(k.startswith("model.language_model.layers.1.mlp.experts") for k in a)


def test_config_round_trip_and_refusals(vlmoe):
    d = json.loads((vlmoe / "config.json").read_text())
    cfg = models.config_from_hf(d)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.mlp_only_layers) == (4, 2, True, [1])
    assert cfg.mrope_axes().tolist() == [0, 1, 2, 0, 1, 2, 0, 1] * 2
    again = cfg.to_hf()
    assert models.config_from_hf(again) == cfg
    assert transformers.Qwen3VLMoeConfig(**again).text_config.num_experts == 4
    with pytest.raises(ValueError, match="norm_topk_prob=false"):
        models.config_from_hf({**d, "text_config": {**d["text_config"], "norm_topk_prob": False}})
    with pytest.raises(ValueError, match="deepstack_visual_indexes"):
        models.config_from_hf({**d, "vision_config": {**d["vision_config"], "deepstack_visual_indexes": [3]}})


# the shape of the Hub's Qwen3-VL-30B-A3B-Instruct config.json (transformers 4.57's spelling)
HUB_30B = {
    "architectures": ["Qwen3VLMoeForConditionalGeneration"], "image_token_id": 151655, "model_type": "qwen3_vl_moe",
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
        "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 262144,
        "mlp_only_layers": [], "model_type": "qwen3_vl_moe_text", "moe_intermediate_size": 768,
        "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000, "use_cache": True, "vocab_size": 151936},
    "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0", "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
        "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304, "model_type": "qwen3_vl_moe",
        "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2},
    "vision_end_token_id": 151653, "vision_start_token_id": 151652}


def test_the_hub_config_builds_transformers_parameter_shapes():
    """Built on the meta device from the Hub's 30B-A3B config: transformers' parameter names and shapes (the
    experts as transformers holds them in memory) and its parameter count."""
    ref = transformers.Qwen3VLMoeConfig(**HUB_30B)
    with torch.device("meta"):
        ours, hf = models.from_hf_config(HUB_30B), transformers.Qwen3VLMoeForConditionalGeneration(ref)
    shapes = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items()}  # noqa: E731
    assert shapes(ours) == shapes(hf)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())


def test_greedy_generation_after_images_equals_transformers(pair):
    check_generation_after_images(*pair)


def test_expert_adapter_loads_in_peft_with_images(vlmoe, tmp_path):
    """LoRA on the attention and on every expert (each its own pair, B drawn at random), saved in peft's format
    (`target_parameters` for the experts): peft puts it on transformers' class with our logits on images."""
    peft = pytest.importorskip("peft")
    from minitrain.adapters.lora import LoRAConfig, apply_lora
    from minitrain.adapters.peft_format import save_adapter

    ours = load_pretrained(vlmoe, models.from_hf_config).eval()
    cfg = LoRAConfig(r=4, alpha=8, targets=["q_proj", "v_proj", "experts.gate_up_proj", "experts.down_proj"])
    names = apply_lora(ours, cfg)
    assert any(".experts." in n for n in names)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    save_adapter(ours, tmp_path / "adapter", cfg)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"]
    hf = transformers.AutoModelForImageTextToText.from_pretrained(vlmoe, dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids, mask, pixels, grid = batch()
    real = mask.bool()
    with torch.no_grad():
        got = ours.lm_head(ours(ids, mask, pixel_values=pixels, image_grid_thw=grid))
        ref = hf(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid,
                 mm_token_type_ids=(ids == IMAGE).long()).logits
        base = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(vlmoe, dtype=torch.float32).eval()
        plain = hf_logits(base, ids, mask, pixels, grid)
    assert rel(got[real], ref[real]) <= 1e-5
    assert rel(got[real], plain[real]) > 1e-3  # the adapter moved the logits


def test_a_saved_folder_loads_in_transformers(vlmoe, tmp_path):
    ours = load_pretrained(vlmoe, models.from_hf_config).eval()
    with torch.no_grad():  # as after fine-tuning: not the weights transformers saved
        ours.model.language_model.layers[0].mlp.experts.down_proj.mul_(1.5)
    check_saved_folder(ours, vlmoe, transformers.Qwen3VLMoeForConditionalGeneration, tmp_path)


def test_fsdp_defers_the_saved_layout_and_the_transposed_one(vlmoe, tmp_path):
    """parallel=fsdp reads each rank's rows: a folder in transformers' layout (its saves, ours) needs no conversion;
    the Hub's transposed experts are converted row by row (each rank its experts: `test_moe.py`'s MXFP4 test checks
    that rows of a conversion are the conversion's rows). A conversion whose inputs are not cut along the
    experts is refused in one line."""
    from minitrain.errors import UserError
    from minitrain.parallel import fsdp
    from minitrain.weights import open_pretrained

    built, headers = open_pretrained(vlmoe, models.from_hf_config)
    assert not fsdp._conversions(built, {k: info["shape"] for h, _ in headers.values() for k, info in h.items()})
    fsdp.defer_weights(built, vlmoe, headers, torch.float32, torch.device("cpu"))
    tensors = {k: (v.transpose(1, 2).contiguous() if ".experts." in k else v)
               for k, v in load_file(vlmoe / "model.safetensors").items()}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((vlmoe / "config.json").read_text())
    built, headers = open_pretrained(tmp_path, models.from_hf_config)
    stored = {k: info["shape"] for h, _ in headers.values() for k, info in h.items()}
    assert len(fsdp._conversions(built, stored)) == sum(".experts." in k for k in tensors)
    fsdp.defer_weights(built, tmp_path, headers, torch.float32, torch.device("cpu"))
    bad = {k: (v.transpose(0, 2).contiguous() if ".experts." in k else v) for k, v in tensors.items()}
    save_file(bad, tmp_path / "model.safetensors", metadata={"format": "pt"})
    built, headers = open_pretrained(tmp_path, models.from_hf_config)
    with pytest.raises(UserError, match="in a form whose rows are not its rows — use parallel=ddp"):
        fsdp.defer_weights(built, tmp_path, headers, torch.float32, torch.device("cpu"))


def test_packed_rows_with_images_equal_each_sequence_alone(pair):
    """Packed image rows: each sequence's logits as its own forward's (the experts over every sequence's tokens)."""
    check_packed_rows_equal_each_alone(pair[1])


@pytest.mark.slow
def test_fsdp_lora_from_torchrun_resumes_and_equals_one_process(tmp_path):
    """`python -m torch.distributed.run ... -m minitrain recipes/sft.py parallel=fsdp` on a Qwen3-VL-MoE folder saved
    by transformers (its experts in the model's layout, read by rows: `fsdp.defer_weights`), LoRA on the attention
    and the experts, cut after step 1 and finished with resume=true at 2 ranks (the ranks' collectives compared in
    each launch): the losses and adapter of one process."""
    from test_image_rows import vl_folder
    from test_torchrun_resume import assert_equal_runs, launch, rows

    model = vl_folder(tmp_path / "model", "qwen3_vl_moe")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w}."},
                                                     {"role": "assistant", "content": w}]}) + "\n"
                            for w in ("one", "two", "three", "four", "five", "six", "seven", "eight")))
    args = ["recipes/sft.py",
        f"model={model}", f"data={data}", "batch_size=2", "max_steps=2", "lora_r=4", "lora_alpha=8", "lr=1e-2",
        "device=cpu", "max_len=64", "log_every=1", "lora_targets=q_proj,v_proj,experts.gate_up_proj,experts.down_proj"]
    launch(1, [*args, f"out={tmp_path / 'one'}"])
    cut = [*args, f"out={tmp_path / 'fsdp'}", "parallel=fsdp", "save_every=1"]
    launch(2, [*cut, "stop_after=1"])
    assert [r["step"] for r in rows(tmp_path / "fsdp")] == [1]
    launch(2, [*cut, "resume=true"])
    assert_equal_runs(tmp_path / "fsdp", tmp_path / "one", tol=1e-5)
