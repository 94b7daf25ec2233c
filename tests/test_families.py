"""Qwen2, Qwen3, Gemma 2, Gemma 3 (text), Phi-3 and LLaMA-with-biases against transformers.

Each family is a tiny random checkpoint saved by transformers (`conftest.save_hf_causal`, norms
and biases perturbed so every tensor matters), loaded by our registry (`models.from_hf_config`,
the path every recipe takes) and compared with transformers' own model on the same files:
logits in fp32 with no / left / right padding, cached decoding, greedy `generate`, adapters both
ways through PEFT, `to_hf` loading back in transformers, and the state-dict keys.
Each variant is built so its family's particular maths is exercised (windows shorter than the
sequence, softcaps small enough to bite, rope scaling at lengths where it changes the result);
the "not a no-op" tests prove that for the softcaps, Gemma 3's local RoPE base and longrope.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from test_llama import (check_captured_layers_match_transformers, check_padded_batch_equals_each_row_alone, hf_logits,
                        hf_position_ids, make_batch, our_logits, prompts)

import models

FAMILY_VARIANTS: dict[str, dict] = {
    "llama_bias": dict(attention_bias=True, mlp_bias=True, num_key_value_heads=2),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, rope_theta=1000000.0),
    "qwen2_window": dict(model_type="qwen2", num_key_value_heads=2, use_sliding_window=True, sliding_window=5,
                         max_window_layers=1),
    "qwen3": dict(model_type="qwen3", num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    "gemma2": dict(  # caps small enough that tanh bends the scores and the logits
        model_type="gemma2", head_dim=16, num_key_value_heads=2, sliding_window=5, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0, tie_word_embeddings=True,
        initializer_range=0.2,  # scores of a few units, so the score cap bends them
    ),
    "gemma3": dict(  # layer 0 local (base 10k, window 5), layer 1 global (base 1M, linear x4)
        model_type="gemma3_text", head_dim=16, num_key_value_heads=2, sliding_window=5, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}},
    ),
    "gemma3_capped": dict(  # a final cap applies; the score cap is ignored, as transformers does
        model_type="gemma3_text", head_dim=16, num_key_value_heads=1, sliding_window=4, sliding_window_pattern=2,
        attn_logit_softcapping=4.0, final_logit_softcapping=2.0,
    ),
    "phi3": dict(model_type="phi3", num_key_value_heads=2),
    "phi3_longrope": dict(  # T=24 > 16: the long factors; prompts of 12: the short ones
        model_type="phi3", num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=16,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                      "long_factor": [1.0 + 0.5 * i for i in range(8)]},
    ),
    "phi3_partial_window": dict(model_type="phi3", num_key_value_heads=2, partial_rotary_factor=0.5, sliding_window=6),
}
GENERATE = ["qwen2_window", "qwen3", "gemma2", "gemma3", "gemma3_capped", "phi3", "phi3_longrope",
            "phi3_partial_window", "llama_bias"]


def family_checkpoint(hf_causal, name: str) -> Path:
    return hf_causal(f"fam_{name}", **FAMILY_VARIANTS[name])


def load_ours(folder: Path) -> torch.nn.Module:
    """Through the registry, weights by `load_state_dict(strict=True)` (HF omits a tied head)."""
    model = models.from_hf_config(json.loads((folder / "config.json").read_text()))
    sd = load_file(folder / "model.safetensors")
    if model.config.tie_word_embeddings:
        assert "lm_head.weight" not in sd
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    model.load_state_dict(sd, strict=True)
    model.tie_weights()
    return model.eval()


def load_hf(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


# ------------------------------------------------------------------------------ logits vs HF


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("name", list(FAMILY_VARIANTS))
def test_logits_match_transformers_fp32(hf_causal, name, padding):
    folder = family_checkpoint(hf_causal, name)
    ids, mask = make_batch(padding)
    a, b = our_logits(load_ours(folder), ids, mask), hf_logits(load_hf(folder), ids, mask)
    real = mask.bool()
    assert (a[real] - b[real]).abs().max() <= 1e-4
    assert torch.isfinite(a).all()


@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("name", ["phi3", "phi3_partial_window", "gemma2", "gemma3", "gemma3_capped"])
def test_captured_layers_match_transformers_eager(hf_causal, name, padding):
    """Phi-3's and Gemma's `hidden_layers` / `attention_layers` (distillation's features and
    attention transfer) as LLaMA's (`test_llama.check_captured_layers_match_transformers`): partial
    RoPE, windows shorter than T, Gemma 2's soft-capped scores and Gemma 3's local / global
    layers included."""
    folder = family_checkpoint(hf_causal, name)
    check_captured_layers_match_transformers(load_ours(folder), folder, padding)


@pytest.mark.parametrize("padding", ["left", "both"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gemma3_capped", "phi3_partial_window"])
def test_padded_batch_equals_each_row_alone(hf_causal, name, padding):
    """Gemma (soft-capped scores, local and global layers) and Phi-3 (partial RoPE, a window)
    unpadded on a CPU, as LLaMA's test (`test_llama.check_padded_batch_equals_each_row_alone`)."""
    check_padded_batch_equals_each_row_alone(load_ours(family_checkpoint(hf_causal, name)), padding)


def test_short_sequences_use_longrope_short_factors(hf_causal):
    folder = family_checkpoint(hf_causal, "phi3_longrope")
    ids, mask = make_batch("left")
    ids, mask = ids[:, :12], mask[:, :12]
    a, b = our_logits(load_ours(folder), ids, mask), hf_logits(load_hf(folder), ids, mask)
    assert (a - b)[mask.bool()].abs().max() <= 1e-4


def edited(folder: Path, tmp_path: Path, **changes) -> Path:
    """A copy of the checkpoint whose config.json has `changes` (None deletes a key)."""
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    d = json.loads((tmp_path / "config.json").read_text())
    for k, v in changes.items():
        d.pop(k, None) if v is None else d.__setitem__(k, v)
    (tmp_path / "config.json").write_text(json.dumps(d))
    return tmp_path


@pytest.mark.parametrize("name, changes", [
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"final_logit_softcapping": None}),
    ("gemma2", {"query_pre_attn_scalar": 16}),
    ("gemma3", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}}),
    ("gemma3", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                    "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}),
    ("phi3_longrope", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    ("qwen2_window", {"use_sliding_window": False}),
])
def test_family_maths_is_not_a_no_op(hf_causal, tmp_path, name, changes):
    """Each particular of a family changes the logits at these sizes, so the parity above tests it:
    our model with that particular switched off no longer matches transformers."""
    folder = family_checkpoint(hf_causal, name)
    ids, mask = make_batch("left")
    ours = our_logits(load_ours(edited(folder, tmp_path, **changes)), ids, mask)
    ref = hf_logits(load_hf(folder), ids, mask)
    assert (ours - ref)[mask.bool()].abs().max() > 1e-3


@pytest.mark.parametrize("name", ["gemma2", "gemma3_capped"])
def test_chunked_loss_sees_the_final_softcap(hf_causal, name):
    """The final cap is inside `output_projection`, so the chunked loss (frozen head or not) equals
    transformers' cross-entropy over its capped logits."""
    from minitrain.objectives.losses import chunked_cross_entropy_sum, shift_labels

    folder = family_checkpoint(hf_causal, name)
    model = load_ours(folder)
    ids, mask = make_batch("right")
    labels = ids.masked_fill(mask == 0, -100)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(
            hf_logits(ref, ids, mask).flatten(0, 1), shift_labels(labels).flatten(), reduction="sum")
    for p in model.parameters():
        p.requires_grad_(False)
    hidden = model(ids, mask).requires_grad_(True)
    got, count = chunked_cross_entropy_sum(hidden, model.output_projection, shift_labels(labels), chunk=7)
    assert int(count) == int(mask[:, 1:].sum()) and abs(float(got.detach()) - float(want)) <= 1e-4
    got.backward()  # the generic (checkpointed) path: the capped head has a gradient too
    assert torch.isfinite(hidden.grad).all()


# ----------------------------------------------------------------------- cache and generate


@pytest.mark.parametrize("name", ["qwen2_window", "gemma2", "gemma3", "phi3_partial_window"])
def test_cached_decoding_matches_full_forward(hf_causal, name):
    model = load_ours(family_checkpoint(hf_causal, name))
    ids, mask = make_batch("left")
    with torch.no_grad():
        full = model(ids, mask)
        cache = models.family(model).KVCache(ids.shape[1])
        parts = [model(ids[:, :10], mask[:, :10], cache=cache)]
        for t in range(10, ids.shape[1]):
            parts.append(model(ids[:, t : t + 1], mask[:, t : t + 1], cache=cache))
    stepped = torch.cat(parts, 1)
    assert (stepped - full)[mask.bool()].abs().max() <= 1e-5


@pytest.mark.parametrize("name", GENERATE)
def test_greedy_generate_matches_transformers(hf_causal, name):
    """12 new tokens after prompts of 12 (left-padded): past every window, through the cache."""
    folder = family_checkpoint(hf_causal, name)
    ours, hf = load_ours(folder), load_hf(folder)
    generate = models.family(ours).generate
    hf.generation_config.eos_token_id = None
    ids, mask = prompts()
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    ref = hf.generate(input_ids=ids, attention_mask=mask, **kw)
    out = generate(ours, ids, mask, max_new_tokens=12, eos_token_id=[], pad_token_id=0)
    assert torch.equal(out, ref)
    eos = int(ref[0, 12 + 2])  # row 0 stops there and is padded; the other row continues as HF
    ref = hf.generate(input_ids=ids, attention_mask=mask, eos_token_id=eos, **kw)
    out = generate(ours, ids, mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("name", ["llama_bias", "qwen2_window", "qwen3", "gemma2", "gemma3_capped",
                                  "phi3_partial_window"])
def test_batched_sampler_greedy_matches_transformers(hf_causal, name):
    """GRPO's sampler (minitrain.objectives.sampling), greedy with G = 2 completions per left-padded
    prompt and an eos that stops one row early: each row equals transformers' `generate`, the mask covers
    the tokens up to the eos, and only the row that never met the eos is marked truncated."""
    from minitrain.objectives.sampling import sample

    folder = family_checkpoint(hf_causal, name)
    ours, hf = load_ours(folder).train(), load_hf(folder)
    hf.generation_config.eos_token_id = None
    ids, mask = prompts()
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    eos = int(hf.generate(input_ids=ids, attention_mask=mask, **kw)[0, 12 + 3])  # row 0 stops after 4 tokens
    ref = hf.generate(input_ids=ids, attention_mask=mask, eos_token_id=eos, **kw)[:, 12:]
    got = sample(ours, ids, mask, new_cache=models.family(ours).KVCache, num_generations=2, max_new_tokens=10,
                 greedy=True, eos_ids=[eos], pad_id=0)
    assert got.ids.shape[0] == 4 and torch.is_grad_enabled()
    for row in range(4):
        want = ref[row // 2]
        n = int((want == eos).nonzero()[0]) + 1 if bool((want == eos).any()) else len(want)
        assert got.ids[row, :n].tolist() == want[:n].tolist(), row
        assert got.mask[row].sum() == n and bool(got.truncated[row]) == (n == 10 and int(want[-1]) != eos)
    assert ours.training  # the model is left as it was


def test_sampler_filters_equal_transformers_warpers():
    """top-k then top-p as transformers' TopKLogitsWarper and TopPLogitsWarper keep them."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    from minitrain.objectives.sampling import filter_logits

    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    for k, p in ((0, 0.9), (7, 1.0), (7, 0.5), (0, 0.3), (1, 0.95)):
        ref = logits.clone()
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1:
            ref = TopPLogitsWarper(p)(None, ref)
        assert torch.equal(torch.isinf(filter_logits(logits, k, p)), torch.isinf(ref)), (k, p)


# ------------------------------------------------------------------------ config, keys


@pytest.mark.parametrize("name", list(FAMILY_VARIANTS))
def test_to_hf_round_trips_and_loads_in_transformers(hf_causal, tmp_path, name):
    folder = family_checkpoint(hf_causal, name)
    cfg = models.config_from_hf(json.loads((folder / "config.json").read_text()))
    d = json.loads(json.dumps(cfg.to_hf()))
    assert models.config_from_hf(d) == cfg
    (tmp_path / "config.json").write_text(json.dumps(d))
    shutil.copy(folder / "model.safetensors", tmp_path / "model.safetensors")
    ids, mask = make_batch("left")
    a, b = our_logits(load_ours(folder), ids, mask), hf_logits(load_hf(tmp_path), ids, mask)
    assert (a - b)[mask.bool()].abs().max() <= 1e-4


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma2", "gemma3", "phi3", "llama_bias"])
def test_state_dict_keys_are_hf_keys(hf_causal, name):
    folder = family_checkpoint(hf_causal, name)
    with torch.device("meta"):
        ours = models.from_hf_config(json.loads((folder / "config.json").read_text()))
    assert list(ours.buffers()) == []
    hf = load_hf(folder)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in hf.state_dict().items()}


def test_gemma3_old_config_spelling_equals_v5(tmp_path):
    """A Gemma 3 1B config.json as published (rope_local_base_freq, sliding_window_pattern,
    cache_implementation) reads as transformers reads it."""
    old = dict(model_type="gemma3_text", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=7,
               num_attention_heads=4, num_key_value_heads=1, head_dim=16, rope_theta=1000000, rope_local_base_freq=10000,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=512, sliding_window_pattern=6,
               cache_implementation="hybrid", query_pre_attn_scalar=16, final_logit_softcapping=None,
               attn_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh")
    ours = models.config_from_hf(old)
    ref = transformers.Gemma3TextConfig(**{k: v for k, v in old.items() if k != "model_type"})
    assert ours.layer_types == ref.layer_types
    assert ours.rope_local_base_freq == ref.rope_parameters["sliding_attention"]["rope_theta"]
    assert ours.rope_theta == ref.rope_parameters["full_attention"]["rope_theta"]
    assert ours.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    ref.save_pretrained(tmp_path)  # what transformers 5 writes: rope_parameters per layer type
    assert models.config_from_hf(json.loads((tmp_path / "config.json").read_text())) == ours


@pytest.mark.parametrize("config, named", [
    ({"model_type": "gemma3"}, "without text_config / vision_config"),
    ({"model_type": "gemma2", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"model_type": "gemma2", "hidden_activation": "relu"}, "hidden_activation"),
    ({"model_type": "gemma2", "rope_local_base_freq": 10000.0}, "rope_local_base_freq"),
    ({"model_type": "gemma3_text", "rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                                                       "full_attention": {"rope_type": "default"}}}, "local RoPE"),
    ({"model_type": "phi3", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "Phi-3"),
    ({"model_type": "phi3", "resid_pdrop": 0.1}, "resid_pdrop"),
    ({"model_type": "phi3", "rope_scaling": {"type": "su", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3}},
     "head_dim/2"),
    ({"model_type": "qwen2", "layer_types": ["sliding_attention"]}, "layer_types"),
])
def test_configs_we_cannot_honour_are_value_errors(config, named):
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(ValueError, match=named) as e:
        models.from_hf_config({**base, **config})
    assert str(e.value).startswith("config.json: ") and " — " in str(e.value)


def test_phi3_su_is_longrope():
    """The first Phi-3 128k configs spell longrope `su`; transformers reads it as longrope."""
    base = dict(model_type="phi3", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, original_max_position_embeddings=16, max_position_embeddings=64)
    r = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    su = models.config_from_hf({**base, "rope_scaling": {"type": "su", **r}})
    assert su == models.config_from_hf({**base, "rope_scaling": {"rope_type": "longrope", **r}})
    assert su.rope_scaling["rope_type"] == "longrope"
    assert su.rope_scaling["original_max_position_embeddings"] == 16


# ---------------------------------------------------------------------------- PEFT both ways

PEFT_TARGETS = {
    "qwen2": ["q_proj", "v_proj", "o_proj", "up_proj"],
    "qwen3": ["q_proj", "k_proj", "down_proj"],
    "gemma2": ["q_proj", "o_proj", "gate_proj", "down_proj"],
    "gemma3": ["k_proj", "v_proj", "up_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],  # the fused names, as PEFT names them
    "llama_bias": ["q_proj", "o_proj", "gate_proj"],
}
TOKENS = torch.tensor([[1, 5, 9, 33, 70, 2, 17], [1, 100, 3, 3, 8, 64, 127]])


def _logits(model, x):
    with torch.no_grad():
        out = model(x)
        return out.logits if hasattr(out, "logits") else model.output_projection(out)


@pytest.mark.parametrize("name", list(PEFT_TARGETS))
def test_adapters_round_trip_through_peft(hf_causal, tmp_path, name):
    """Ours -> PEFT on transformers' model, and PEFT's -> ours: equal logits, adapter on and off."""
    peft = pytest.importorskip("peft")
    from minitrain.adapters.lora import LoRAConfig, apply_lora, disable_adapters
    from minitrain.adapters.peft_format import load_adapter, save_adapter
    from minitrain.weights import load_pretrained

    folder = family_checkpoint(hf_causal, name)
    ours = load_pretrained(folder, models.from_hf_config).eval()
    cfg = LoRAConfig(r=4, alpha=8, targets=tuple(PEFT_TARGETS[name]))
    assert len(apply_lora(ours, cfg)) == 2 * len(PEFT_TARGETS[name])  # each name once per layer
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_" in n:
                p.copy_(0.1 * torch.randn_like(p))
    save_adapter(ours, tmp_path / "ours", cfg, base_model_name_or_path=str(folder))
    ref = peft.PeftModel.from_pretrained(load_hf(folder), tmp_path / "ours").eval()
    base = _logits(load_hf(folder), TOKENS)
    assert (_logits(ref, TOKENS) - base).abs().max() > 1e-3  # the adapter changes the output
    torch.testing.assert_close(_logits(ours, TOKENS), _logits(ref, TOKENS), rtol=0, atol=1e-5)

    torch.manual_seed(2)
    theirs = peft.get_peft_model(load_hf(folder), peft.LoraConfig(
        r=4, lora_alpha=16, target_modules=PEFT_TARGETS[name], init_lora_weights=False, task_type="CAUSAL_LM")).eval()
    theirs.save_pretrained(tmp_path / "peft")
    back = load_pretrained(folder, models.from_hf_config).eval()
    load_adapter(back, tmp_path / "peft")
    torch.testing.assert_close(_logits(back, TOKENS), _logits(theirs, TOKENS), rtol=0, atol=1e-5)
    with disable_adapters(back), theirs.disable_adapter():
        torch.testing.assert_close(_logits(back, TOKENS), _logits(theirs, TOKENS), rtol=0, atol=1e-5)
