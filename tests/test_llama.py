"""models/llama.py against transformers on tiny random checkpoints saved by transformers.

Every numeric check compares with a reference: transformers' logits / generate / TopP warper,
or a closed-form formula (mean rows after resize). Weights are loaded with
`safetensors.torch.load_file` + `load_state_dict(strict=True)` (the streaming loader in
minitrain/weights.py is tested on its own).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from models import layers as fl
from models import llama as ml

T = 24  # long enough for windows, RoPE scaling and dynamic NTK (max_position_embeddings 16) to matter

VARIANTS: dict[str, dict] = {
    "mha": {},
    "gqa": dict(num_key_value_heads=2),
    "tied": dict(tie_word_embeddings=True),
    "head_dim": dict(head_dim=32, num_key_value_heads=2),  # q_proj 64 -> 128: head_dim != hidden/heads
    "mistral_window": dict(model_type="mistral", num_key_value_heads=2, sliding_window=5),
    "rope_linear": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "rope_dynamic": dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=16),
    "rope_yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "rope_yarn_mscale": dict(
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
        }
    ),
    "llama_bias": dict(attention_bias=True, mlp_bias=True),  # exports that keep biases
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, rope_theta=1000000.0),  # q/k/v biases
    "qwen2_window": dict(  # Qwen's window applies from max_window_layers on: layer 0 full, layer 1 slides
        model_type="qwen2", num_key_value_heads=2, use_sliding_window=True, sliding_window=5, max_window_layers=1
    ),
    "qwen3": dict(model_type="qwen3", num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),  # q/k norms
    "qwen3_bias": dict(model_type="qwen3", num_key_value_heads=2, head_dim=16, attention_bias=True),
    "rope_llama3": dict(  # LLaMA 3.2 style: big theta, llama3 scaling, tied head
        rope_theta=500000.0,
        tie_word_embeddings=True,
        num_key_value_heads=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
}


# ------------------------------------------------------------------------------------ helpers


def checkpoint(hf_causal, name: str) -> Path:
    return hf_causal(name, **VARIANTS[name])


def read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def load_ours(folder: Path, dtype: torch.dtype = torch.float32) -> ml.LlamaForCausalLM:
    cfg = ml.LlamaConfig.from_hf(read_config(folder))
    model = ml.LlamaForCausalLM(cfg)
    sd = load_file(folder / "model.safetensors")
    if cfg.tie_word_embeddings:
        assert "lm_head.weight" not in sd  # HF does not store a tied head
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    model.load_state_dict(sd, strict=True)
    model.tie_weights()
    return model.to(dtype).eval()


def load_hf(folder: Path, dtype: torch.dtype = torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def make_batch(padding: str, vocab: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of length T; row 1 has 7 pad tokens on the left or right (or none)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    if padding == "left":
        mask[1, :7] = 0
    elif padding == "right":
        mask[1, -7:] = 0
    ids[mask == 0] = 0
    return ids, mask


def hf_position_ids(mask: torch.Tensor) -> torch.Tensor:
    """What HF generate uses: count of real tokens before each one (pads get 1)."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


@torch.no_grad()
def hf_logits(hf, ids, mask) -> torch.Tensor:
    return hf(input_ids=ids, attention_mask=mask, position_ids=hf_position_ids(mask)).logits.float()


@torch.no_grad()
def our_logits(model, ids, mask) -> torch.Tensor:
    return model.output_projection(model(ids, mask)).float()


# ------------------------------------------------------------------------------ logits vs HF


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers_fp32(hf_causal, name, padding):
    folder = checkpoint(hf_causal, name)
    ours, hf = load_ours(folder), load_hf(folder)
    ids, mask = make_batch(padding)
    a, b = our_logits(ours, ids, mask), hf_logits(hf, ids, mask)
    real = mask.bool()
    assert (a[real] - b[real]).abs().max() <= 1e-4
    # with left padding, pad queries must not produce NaN (they would poison batch sums and grads)
    assert torch.isfinite(a).all()


def test_positions_come_from_the_mask(hf_causal):
    """RoPE is relative, so a uniform shift of positions hides in most tests; dynamic NTK does
    not hide it (its base depends on the largest position). One left-padded row: its real tokens
    must sit at positions 0..16, not 7..23."""
    folder = checkpoint(hf_causal, "rope_dynamic")
    ids, mask = make_batch("left")
    ids, mask = ids[1:], mask[1:]
    a, b = our_logits(load_ours(folder), ids, mask), hf_logits(load_hf(folder), ids, mask)
    assert (a[mask.bool()] - b[mask.bool()]).abs().max() <= 1e-4


def test_attention_mask_4d_matches_its_definition():
    """Brute-force reference: query slot i sees key slot j iff j <= i, i - j < window and j is
    a real token; a padding query sees (at least) itself, so no row is empty (an empty row is
    NaN on some SDPA kernels)."""
    g = torch.Generator().manual_seed(0)
    key_valid = torch.rand(3, 11, generator=g) > 0.3
    key_valid[0, :4] = False  # left padding
    for q_start, window in [(0, None), (0, 3), (6, None), (6, 4), (10, 2)]:
        got = fl.attention_mask_4d(key_valid, q_start, window)
        assert got.shape == (3, 1, 11 - q_start, 11)
        for b in range(3):
            for t, i in enumerate(range(q_start, 11)):
                for j in range(11):
                    want = j <= i and (window is None or i - j < window) and bool(key_valid[b, j])
                    if bool(key_valid[b, i]):
                        assert bool(got[b, 0, t, j]) == want
                    else:
                        assert bool(got[b, 0, t, j]) == (want or j == i)
        assert got.any(-1).all()


@pytest.mark.parametrize("name", ["rope_linear", "rope_dynamic", "rope_yarn", "rope_yarn_mscale", "rope_llama3"])
def test_rope_scaling_is_not_a_no_op(hf_causal, name):
    """The variants above would be vacuous if the scaling changed nothing at these lengths."""
    folder = checkpoint(hf_causal, name)
    d = read_config(folder)
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": d["rope_parameters"]["rope_theta"]}
    plain = ml.LlamaForCausalLM(ml.LlamaConfig.from_hf(d))
    plain.load_state_dict(load_ours(folder).state_dict())
    plain.tie_weights()
    ids, mask = make_batch("none")
    assert (our_logits(plain.eval(), ids, mask) - hf_logits(load_hf(folder), ids, mask)).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["mistral_window", "qwen2_window"])
def test_sliding_window_is_not_a_no_op(hf_causal, name):
    folder = checkpoint(hf_causal, name)
    d = read_config(folder)
    d["sliding_window"] = None
    full = ml.LlamaForCausalLM(ml.LlamaConfig.from_hf(d))
    full.load_state_dict(load_ours(folder).state_dict())
    ids, mask = make_batch("left")
    real = mask.bool()
    diff = (our_logits(full.eval(), ids, mask) - hf_logits(load_hf(folder), ids, mask))[real]
    assert diff.abs().max() > 1e-3


@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("name", ["gqa", "mistral_window", "rope_llama3"])
def test_logits_match_transformers_bf16(hf_causal, name, padding):
    """bf16 keeps 8 significant bits (relative step 2**-8 = 0.4%); two implementations that
    round in a different order (matmul blocking, SDPA kernel) differ by a few such steps per
    layer on other hardware. So: (1) our bf16 logits are within 1% of the largest logit
    (~2.5 bf16 steps) of transformers' bf16 logits (on CPU they agree bit for bit: same ops in the
    same order), and (2) our bf16 error against the fp32 reference (~0.3-0.8% of the largest logit
    here) is no worse than 1.5x transformers' own."""
    folder = checkpoint(hf_causal, name)
    ids, mask = make_batch(padding)
    real = mask.bool()
    ref = hf_logits(load_hf(folder), ids, mask)[real]  # fp32 reference
    ours = our_logits(load_ours(folder, torch.bfloat16), ids, mask)[real]
    theirs = hf_logits(load_hf(folder, torch.bfloat16), ids, mask)[real]
    scale = ref.abs().max()
    assert (ours - theirs).abs().max() <= 0.01 * scale
    assert (ours - ref).abs().max() <= 1.5 * (theirs - ref).abs().max() + 1e-3 * scale


# ---------------------------------------------------------------------------------- config


def test_from_hf_reads_both_rope_spellings(hf_causal):
    v5 = read_config(checkpoint(hf_causal, "rope_llama3"))
    assert "rope_parameters" in v5  # transformers 5 writes the new spelling
    old = dict(v5)
    params = dict(old.pop("rope_parameters"))
    old["rope_theta"] = params.pop("rope_theta")
    old["rope_scaling"] = params  # exactly what a LLaMA 3.1 config.json on disk looks like
    a, b = ml.LlamaConfig.from_hf(v5), ml.LlamaConfig.from_hf(old)
    assert a == b
    old["eos_token_id"] = [2, 5, 7]  # LLaMA 3.1 lists several EOS ids
    assert ml.LlamaConfig.from_hf(ml.LlamaConfig.from_hf(old).to_hf()).eos_token_id == [2, 5, 7]
    assert a.rope_theta == 500000.0 and a.rope_scaling["rope_type"] == "llama3"
    # pre-2024 spelling of the type key
    old["rope_scaling"] = {"type": "linear", "factor": 2.0}
    assert ml.LlamaConfig.from_hf(old).rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("name", ["tied", "mistral_window", "rope_yarn_mscale", "rope_llama3", "rope_dynamic",
                                  "llama_bias", "qwen2_window", "qwen3"])
def test_to_hf_round_trips_and_loads_in_transformers(hf_causal, tmp_path, name):
    folder = checkpoint(hf_causal, name)
    cfg = ml.LlamaConfig.from_hf(read_config(folder))
    d = cfg.to_hf()
    assert ml.LlamaConfig.from_hf(json.loads(json.dumps(d))) == cfg
    (tmp_path / "config.json").write_text(json.dumps(d))
    shutil.copy(folder / "model.safetensors", tmp_path / "model.safetensors")
    ids, mask = make_batch("left")
    real = mask.bool()
    a = our_logits(load_ours(folder), ids, mask)
    b = hf_logits(load_hf(tmp_path), ids, mask)
    assert (a[real] - b[real]).abs().max() <= 1e-4


def test_mistral_defaults_follow_transformers():
    """A Mistral config.json that leaves fields out means transformers' class defaults."""
    d = dict(model_type="mistral", vocab_size=128, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=16)
    ours, ref = ml.LlamaConfig.from_hf(d), transformers.MistralConfig(**d)
    assert ours.sliding_window == ref.sliding_window
    assert ours.num_key_value_heads == ref.num_key_value_heads
    assert ours.max_position_embeddings == ref.max_position_embeddings
    d["sliding_window"] = None  # v0.2+ writes null: no window
    assert ml.LlamaConfig.from_hf(d).sliding_window is None


BASE = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"foo_scale": 2.0}, "foo_scale"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "mrope"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "mystery": 1}}, "mystery"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"pretraining_tp": 2}, "pretraining_tp"),
        ({"model_type": "qwen2", "attention_bias": True}, "attention_bias"),  # not a Qwen2 field
        ({"model_type": "qwen3", "mlp_bias": True}, "mlp_bias"),
        ({"model_type": "qwen3", "layer_types": ["full_attention"]}, "layer_types"),  # one per layer
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"sliding_window": 8}, "sliding_window"),  # on model_type llama transformers would ignore it
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_theta": 1.0, "rope_parameters": {"rope_type": "default", "rope_theta": 2.0}}, "rope_theta"),
    ],
)
def test_unknown_maths_fields_are_value_errors(extra, named):
    with pytest.raises(ValueError, match=named) as e:
        ml.LlamaConfig.from_hf({**BASE, **extra})
    assert str(e.value).startswith("config.json: ") and " — " in str(e.value)


def test_ignored_fields_are_accepted():
    harmless = {k: None for k in ml.IGNORED_FIELDS}
    cfg = ml.LlamaConfig.from_hf({**BASE, **harmless, "pretraining_tp": 1, "attention_dropout": 0.0})
    assert cfg == ml.LlamaConfig.from_hf(BASE)


# ---------------------------------------------------------------------- meta build, contract


def test_build_on_meta_then_assign(hf_causal):
    folder = checkpoint(hf_causal, "rope_llama3")  # tied head: the case that needs tie_weights
    cfg = ml.LlamaConfig.from_hf(read_config(folder))
    with torch.device("meta"):
        model = ml.LlamaForCausalLM(cfg)
    assert list(model.buffers()) == []  # nothing for a loader to miss
    sd = load_file(folder / "model.safetensors")
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    assert missing == ["lm_head.weight"] and unexpected == []  # HF omits the tied head
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(p.is_meta for p in model.parameters())
    assert model.output_projection is model.lm_head and model.input_embeddings is model.model.embed_tokens
    assert model.block_types == (ml.LlamaDecoderLayer,) and model.is_encoder_decoder is False
    ids, mask = make_batch("left")
    real = mask.bool()
    a, b = our_logits(model.eval(), ids, mask), hf_logits(load_hf(folder), ids, mask)
    assert (a[real] - b[real]).abs().max() <= 1e-4


@pytest.mark.parametrize("name", ["gqa", "llama_bias", "qwen2", "qwen3_bias"])
def test_state_dict_keys_are_hf_keys(hf_causal, name):
    folder = checkpoint(hf_causal, name)
    hf = load_hf(folder)
    ours = ml.LlamaForCausalLM(ml.LlamaConfig.from_hf(read_config(folder)))
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in hf.state_dict().items()}
    assert isinstance(ours.model.layers[0].self_attn.q_proj, torch.nn.Linear)


def test_backward_with_left_padding_has_finite_grads(hf_causal):
    model = load_ours(checkpoint(hf_causal, "mistral_window")).train()
    ids, mask = make_batch("left")
    logits = model.output_projection(model(ids, mask))  # (B, T, V)
    targets = ids.roll(-1, 1)
    loss = torch.nn.functional.cross_entropy(logits[mask.bool()], targets[mask.bool()])
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


# ----------------------------------------------------------------- unpadded batches, RoPE


def check_padded_batch_equals_each_row_alone(model, padding: str) -> None:
    """On a CPU a padded batch runs without its padding (`Ragged`): the real tokens' hidden
    states and every parameter's gradient must equal those of each row run alone, with no padding
    at all (the definition of what padding must not change); padding positions come out as 0."""
    model.train()
    T = fl.RAGGED_MIN_LENGTH + 4  # (shorter rows take the padded path)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (3, T), generator=g)
    mask = torch.ones(3, T, dtype=torch.long)
    mask[0, :7] = 0 if padding in ("left", "both") else 1
    mask[1, -9:] = 0 if padding in ("right", "both") else 1
    if padding == "both":
        mask[2, :2], mask[2, -3:] = 0, 0  # a run in the middle of its row
    weights = torch.randn(3, T, model.config.hidden_size, generator=g)  # a loss over every real hidden feature

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}  # not lm_head

    assert fl.ragged_lengths(mask.bool()) == tuple(mask.sum(1).tolist())
    h = model(ids, mask)
    batched = grads((h * weights * mask[..., None]).sum())
    assert (h[mask == 0] == 0).all()
    parts = []
    for r in range(3):
        keep = mask[r].bool()
        hr = model(ids[r, keep][None])  # no mask: nothing to unpad
        parts.append(grads((hr * weights[r, keep][None]).sum()))
        assert (h[r, keep] - hr[0]).abs().max() <= 1e-5
    assert len(batched) == len(parts[0]) > 0
    for k in batched:
        ref = sum(p[k] for p in parts)
        assert (batched[k] - ref).abs().max() <= 1e-4 * max(1.0, ref.abs().max().item()), k


@pytest.mark.parametrize("padding", ["left", "right", "both"])
@pytest.mark.parametrize("name", ["gqa", "mistral_window", "qwen2_window", "qwen3"])
def test_padded_batch_equals_each_row_alone(hf_causal, name, padding):
    check_padded_batch_equals_each_row_alone(load_ours(checkpoint(hf_causal, name)), padding)


def test_short_rows_take_the_padded_path():
    """Under `RAGGED_MIN_LENGTH` positions the per-sequence loop costs more than the padding it skips."""
    valid = torch.ones(4, fl.RAGGED_MIN_LENGTH, dtype=torch.bool)
    valid[0, :3] = False
    assert fl.unpadded_lengths(valid, True, None) == (fl.RAGGED_MIN_LENGTH - 3,) + (fl.RAGGED_MIN_LENGTH,) * 3
    assert fl.unpadded_lengths(valid[:, 1:], True, None) is None
    from minitrain.plan.decoder import ModelShape

    assert ModelShape.UNPADS_FROM == fl.RAGGED_MIN_LENGTH  # the memory plan counts the same padding


def test_ragged_lengths_refuses_a_hole():
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 0], [0, 0, 0, 0]]).bool()
    assert fl.ragged_lengths(mask) is None  # row 0 has a hole: the padded path serves it
    assert fl.ragged_lengths(mask[1:]) == (2,)  # an empty row drops out


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.bfloat16, torch.bfloat16)])
def test_rotary_is_the_written_out_form_to_the_bit(dtypes):
    """`apply_rotary`'s own backward against autograd through HF's form, bit for bit, including a
    bf16 input under fp32 tables (autocast: each product's gradient cast before the sum)."""
    x_dtype, table_dtype = dtypes
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, T, 64, generator=g).to(x_dtype).requires_grad_()
    angles = torch.randn(2, T, 32, generator=g) * 10
    table = torch.cat([angles, angles], -1)
    cos, sin = table.cos().to(table_dtype), table.sin().to(table_dtype)
    ours = fl.apply_rotary(x, cos, sin)
    hf = x * cos[:, None] + fl.rotate_half(x) * sin[:, None]
    up = torch.randn(hf.shape, generator=g).to(hf.dtype)
    assert torch.equal(ours, hf)
    assert torch.equal(torch.autograd.grad(ours, x, up)[0], torch.autograd.grad(hf, x, up)[0])


def test_compiled_rotary_is_the_written_out_form():
    """Under torch.compile `apply_rotary` is HF's form, not `_Rotary`: in a compiled block the
    custom Function raised the peak memory of LoRA SFT by 1.30 GB on an H100 (torch 2.11,
    BENCHMARKS.md), and inductor fuses the written-out form by itself."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(1, 2, 5, 8, requires_grad=True)
    table = torch.randn(1, 5, 8)
    ours = torch.compile(fl.apply_rotary, backend=backend, fullgraph=True)(x, table.cos(), table.sin())
    ops = {str(n.target) for gm in graphs for n in gm.graph.nodes}
    assert not any("autograd_function_apply" in op for op in ops), ops
    torch.testing.assert_close(ours, fl.apply_rotary(x, table.cos(), table.sin()), rtol=0, atol=0)
    torch._dynamo.reset()


# ---------------------------------------------------------------------------- resize


@pytest.mark.parametrize("name", ["mha", "tied"])
def test_resize_token_embeddings_keeps_old_rows(hf_causal, name):
    model = load_ours(checkpoint(hf_causal, name))
    old_emb = model.input_embeddings.weight.detach().clone()
    old_head = model.lm_head.weight.detach().clone()
    model.resize_token_embeddings(131)
    emb, head = model.input_embeddings.weight, model.lm_head.weight
    assert emb.shape == (131, 64) and head.shape == (131, 64) and model.config.vocab_size == 131
    assert torch.equal(emb[:128], old_emb) and torch.equal(head[:128], old_head)
    assert torch.allclose(emb[128:], old_emb.mean(0).expand(3, -1))
    assert torch.allclose(head[128:], old_head.mean(0).expand(3, -1))
    assert (head is emb) == (name == "tied")
    hidden = model(torch.tensor([[5, 130, 129]]))
    assert model.output_projection(hidden).shape == (1, 3, 131)


# ---------------------------------------------------------------------------- KV cache


def test_cached_decoding_matches_full_forward(hf_causal):
    """Prefill + one-token steps through the KV cache == one forward over the whole sequence."""
    model = load_ours(checkpoint(hf_causal, "mistral_window"))
    ids, mask = make_batch("left")
    with torch.no_grad():
        full = model(ids, mask)
        cache = ml.KVCache(T)
        parts = [model(ids[:, :10], mask[:, :10], cache=cache)]
        for t in range(10, T):
            parts.append(model(ids[:, t : t + 1], mask[:, t : t + 1], cache=cache))
    stepped = torch.cat(parts, 1)
    real = mask.bool()
    assert (stepped[real] - full[real]).abs().max() <= 1e-5


# ---------------------------------------------------------------------------- generate


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = make_batch("left", seed=1)
    return ids[:, :12], mask[:, :12]  # row 1: 7 pads then 5 real tokens


@pytest.mark.parametrize("name", ["gqa", "mistral_window", "rope_llama3", "qwen2_window", "qwen3"])
def test_greedy_generate_matches_transformers(hf_causal, name):
    folder = checkpoint(hf_causal, name)
    ours, hf = load_ours(folder), load_hf(folder)
    hf.generation_config.eos_token_id = None
    ids, mask = prompts()
    ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    out = ml.generate(ours, ids, mask, max_new_tokens=10, eos_token_id=[], pad_token_id=0)
    assert torch.equal(out, ref)
    # stop on a token that row 0 really produces: row 0 is then padded, the rest continue as HF
    eos = int(ref[0, 12 + 2])
    ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                      eos_token_id=eos, pad_token_id=0)
    out = ml.generate(ours, ids, mask, max_new_tokens=10, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref)


def test_sampling_matches_transformers_and_is_reproducible(hf_causal):
    folder = checkpoint(hf_causal, "gqa")
    ours, hf = load_ours(folder), load_hf(folder)
    ids, mask = prompts()
    kw = dict(max_new_tokens=12, do_sample=True, temperature=1.5, top_p=0.9, eos_token_id=[], pad_token_id=0)
    a = ml.generate(ours, ids, mask, seed=7, **kw)
    assert torch.equal(a, ml.generate(ours, ids, mask, seed=7, **kw))
    assert not torch.equal(a, ml.generate(ours, ids, mask, seed=8, **kw))
    # transformers draws with torch.multinomial from the global RNG: same seed, same draws
    hf.generation_config.eos_token_id = None
    torch.manual_seed(7)
    ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=True,
                      temperature=1.5, top_p=0.9, top_k=0, pad_token_id=0)
    assert torch.equal(a, ref)


def test_top_p_filter_matches_transformers_warper():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    for top_p in (1e-9, 0.05, 0.5, 0.9, 0.999):
        ref = transformers.TopPLogitsWarper(top_p)(None, logits.clone())
        assert torch.equal(fl.top_p_filter(logits, top_p), ref)
    # a vanishing top_p keeps exactly the most likely token (sampling becomes greedy)
    kept = torch.isfinite(fl.top_p_filter(logits, 1e-9))
    assert torch.equal(kept, torch.nn.functional.one_hot(logits.argmax(-1), 50).bool())


def test_generate_refuses_right_padding(hf_causal):
    model = load_ours(checkpoint(hf_causal, "mha"))
    ids, mask = make_batch("right")
    with pytest.raises(ValueError, match="left-pad"):
        ml.generate(model, ids, mask, max_new_tokens=2)


def test_generate_restores_training_mode(hf_causal):
    model = load_ours(checkpoint(hf_causal, "mha")).train()
    ml.generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=2)
    assert model.training


# ------------------------------------------------------- captured hidden states and attention


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("name", ["gqa", "mistral_window", "qwen3"])
def test_captured_layers_match_transformers_eager(hf_causal, name, padding):
    """`hidden_layers` / `attention_layers` against transformers' output_hidden_states /
    output_attentions (eager attention): layer i's output is HF's hidden_states[i + 1] (the last
    one HF gives after the final norm), its probabilities HF's attentions[i]; the final hidden
    equals the plain (SDPA) forward's."""
    folder = checkpoint(hf_causal, name)
    check_captured_layers_match_transformers(load_ours(folder), folder, padding)


def check_captured_layers_match_transformers(ours, folder, padding: str) -> None:
    """The body of `test_captured_layers_match_transformers_eager`, for any family's model `ours`
    loaded from `folder` (tests/test_families.py calls it for Phi-3)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    ids, mask = make_batch(padding)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=hf_position_ids(mask),
                 output_hidden_states=True, output_attentions=True)
        got = ours(ids, mask, hidden_layers=(0,), attention_layers=(0, 1))
        plain = ours(ids, mask)
    real = mask.bool()
    assert set(got.hidden_states) == {0} and set(got.attentions) == {0, 1}
    assert (got.hidden_states[0][real] - ref.hidden_states[1][real]).abs().max() <= 1e-4
    assert (got.hidden - plain)[real].abs().max() <= 1e-5
    for i in (0, 1):
        a, b = got.attentions[i], ref.attentions[i].float()
        assert a.shape == b.shape == (2, 4, T, T)
        q = real[:, None, :, None].expand_as(a)  # real queries (padding queries are garbage anyway)
        assert (a - b)[q].abs().max() <= 1e-5
        assert torch.allclose(a.sum(-1)[q[..., 0]], torch.ones(()), atol=1e-5)


def test_captured_attention_is_causal_and_skips_padding(hf_causal):
    """Independently of transformers: each real query's row is a distribution over the real
    keys at or before it (zero on future and padding keys), also with a 4-D block mask."""
    ours = load_ours(checkpoint(hf_causal, "mha"))
    ids, mask = make_batch("left")
    with torch.no_grad():
        a = ours(ids, mask, attention_layers=(1,)).attentions[1]  # (B, H, T, T)
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None] & mask.bool()[:, None, :]  # (B, T, T)
    real = mask.bool()
    assert (a.masked_fill(allowed[:, None], 0)[real[:, None].expand(-1, 4, -1)] == 0).all()
    block = allowed[:, None] | torch.eye(T, dtype=torch.bool)  # the same attention as a (B, 1, T, T) mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        b = ours(ids, block, position_ids=pos, attention_layers=(1,)).attentions[1]
    assert (a - b)[real[:, None].expand(-1, 4, -1)].abs().max() <= 1e-6
    with pytest.raises(ValueError, match="layer 2 does not exist"):
        ours(ids, mask, hidden_layers=(2,))


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.bfloat16, torch.bfloat16)])
def test_rms_norm_own_backward_against_transformers(dtypes):
    """A frozen RMSNorm weight takes `_RMSNorm` (its own backward, four passes over x): the output is
    transformers' `LlamaRMSNorm`'s to the bit, the input's gradient equal to autograd's through it
    to float rounding in fp32 and to the bit for bf16 inputs; a trained weight keeps the written-out
    form and gets transformers' gradient."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x_dtype, w_dtype = dtypes
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 5, 96, generator=g) * 3).to(x_dtype).requires_grad_()
    w = (torch.rand(96, generator=g) + 0.5).to(w_dtype)
    ours, hf = ml.RMSNorm(96, 1e-6).to(w_dtype), LlamaRMSNorm(96, eps=1e-6).to(w_dtype)
    for norm in (ours, hf):
        norm.weight.data.copy_(w)
        norm.weight.requires_grad_(False)
    y, ref = ours(x), hf(x)
    assert y.grad_fn.name() == "_RMSNormBackward"
    assert torch.equal(y, ref)
    up = torch.randn(y.shape, generator=g).to(y.dtype)
    gx, gref = torch.autograd.grad(y, x, up)[0], torch.autograd.grad(ref, x, up)[0]
    if x_dtype == torch.float32:
        torch.testing.assert_close(gx, gref, rtol=1e-6, atol=1e-6)
        assert not torch.equal(gx, torch.zeros_like(gx))
    else:
        assert torch.equal(gx, gref)
    ours.weight.requires_grad_(True)
    hf.weight.requires_grad_(True)
    y, ref = ours(x), hf(x)
    assert y.grad_fn.name() != "_RMSNormBackward"
    assert torch.equal(torch.autograd.grad(y, ours.weight, up)[0], torch.autograd.grad(ref, hf.weight, up)[0])
