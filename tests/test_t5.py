"""models/t5.py against transformers' T5 on tiny random checkpoints saved by transformers.

Three checkpoints: v1.0 style (ReLU FF, head tied to `shared`, output rescaled), v1.1 / FLAN style
(gated-gelu, its own `lm_head`, config saying tie_word_embeddings=false as on the Hub), and the
gated model exactly as transformers 5 saves it (head tied, `scale_decoder_outputs: false`).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from models.t5 import (
    T5Block,
    T5Config,
    T5ForConditionalGeneration,
    clamp_fp16,
    generate,
    ignored_to_pad,
    relative_position_bucket,
    shift_right,
)

TINY = dict(
    vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    relative_attention_num_buckets=8, relative_attention_max_distance=16,  # so T=9 reaches the log buckets
)
ALIASES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


def _save_hf(folder: Path, seed: int, untie: bool, **kw) -> Path:
    """Save a tiny random transformers T5; perturbed so that norms, masks and positions all matter."""
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**TINY, **kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            if name.endswith(".q.weight"):
                p.mul_(8.0)  # default init makes attention nearly uniform; sharpen it
            if "relative_attention_bias" in name:
                p.mul_(8.0)
            if name.endswith((".o.weight", ".wo.weight")):
                p.mul_(2.0)  # let the blocks outweigh the embedding in the residual (else a tied head copies its input)
        if not untie and not model.config.scale_decoder_outputs:
            # tied head without the d_model**-0.5 rescale: std-1 embeddings would make logits ~8x
            # larger than a trained model's, and fp32 noise with them
            model.shared.weight.mul_(TINY["d_model"] ** -0.5)
        if untie:  # transformers 5 always ties at build time; give the head its own weights
            model.lm_head.weight = torch.nn.Parameter(0.5 * torch.randn(TINY["vocab_size"], TINY["d_model"]))
    model.save_pretrained(folder)
    if untie:  # as the Hub's v1.1 / FLAN-T5 configs say (transformers 5 writes true regardless)
        cfg = json.loads((folder / "config.json").read_text())
        cfg["tie_word_embeddings"] = False
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    made = {
        "v1.0": _save_hf(tmp_path_factory.mktemp("t5v10"), 0, False, feed_forward_proj="relu", tie_word_embeddings=True),
        "v1.1": _save_hf(tmp_path_factory.mktemp("t5v11"), 1, True, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
        "hf5-gated": _save_hf(tmp_path_factory.mktemp("t5hf5"), 2, False, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    }
    return made


def _ours(folder: Path, dtype=torch.float32) -> T5ForConditionalGeneration:
    cfg = T5Config.from_hf(json.loads((folder / "config.json").read_text()))
    model = T5ForConditionalGeneration(cfg)
    model.load_state_dict(load_file(folder / "model.safetensors"), strict=True)
    model.tie_weights()
    return model.to(dtype).eval()


def _hf(folder: Path, dtype=torch.float32):
    return transformers.T5ForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()


def _batch():
    """Encoder inputs with right and left padding; decoder inputs with right padding. Ids avoid 0 (pad)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(2, 128, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0  # right padded
    mask[2, :3] = 0  # left padded (T5's relative positions allow either)
    ids = ids.masked_fill(mask == 0, 0)
    dec = torch.randint(2, 128, (3, 6), generator=g)
    dec[:, 0] = 0  # decoder start
    dmask = torch.ones(3, 6, dtype=torch.long)
    dmask[0, 4:] = 0
    dec = torch.where(dmask.bool(), dec, 0)
    return ids, mask, dec, dmask


def _max_diff_at(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    keep = mask.bool()
    return (a.float()[keep] - b.float()[keep]).abs().max().item()


# ----------------------------------------------------------------------------- maths


@pytest.mark.parametrize("style", ["v1.0", "v1.1", "hf5-gated"])
def test_fp32_matches_transformers(ckpt, style):
    ours, hf = _ours(ckpt[style]), _hf(ckpt[style])
    ids, mask, dec, dmask = _batch()
    with torch.no_grad():
        enc_ours = ours.encode(ids, mask)
        enc_hf = hf.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        logits_ours = ours.output_projection(ours(ids, mask, dec, dmask))
        ref = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dmask).logits
    assert _max_diff_at(enc_ours, enc_hf, mask) <= 1e-4
    assert _max_diff_at(logits_ours, ref, dmask) <= 1e-4
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero tensors


def test_head_and_scaling_follow_the_checkpoint(ckpt):
    tied, untied, hf5 = _ours(ckpt["v1.0"]), _ours(ckpt["v1.1"]), _ours(ckpt["hf5-gated"])
    assert tied.lm_head.weight is tied.shared.weight and tied.config.scale_decoder_outputs
    assert untied.lm_head.weight is not untied.shared.weight and not untied.config.scale_decoder_outputs
    assert hf5.lm_head.weight is hf5.shared.weight and not hf5.config.scale_decoder_outputs


@pytest.mark.parametrize("style", ["v1.0", "v1.1"])
def test_bf16_close_to_fp32_reference(ckpt, style):
    ids, mask, dec, dmask = _batch()
    with torch.no_grad():
        ref = _hf(ckpt[style])(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dmask).logits
        ours = _ours(ckpt[style], torch.bfloat16)
        logits = ours.output_projection(ours(ids, mask, dec, dmask))
        hf_bf16 = _hf(ckpt[style], torch.bfloat16)(
            input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dmask
        ).logits
    assert logits.dtype == torch.bfloat16
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 weights, bf16 matmuls
        fp32_model = _ours(ckpt[style])
        autocast_logits = fp32_model.output_projection(fp32_model(ids, mask, dec, dmask))
    scale = ref.abs().max().item()
    assert _max_diff_at(autocast_logits, ref, dmask) <= 0.1 * scale
    err = _max_diff_at(logits, ref, dmask)
    assert err <= 0.1 * scale  # bf16 keeps ~3 significant digits; the sharpened tiny model amplifies that
    # no worse than transformers' own bf16 run (which softmaxes in bf16; we do it in fp32), with slack
    assert err <= 1.25 * _max_diff_at(hf_bf16, ref, dmask) + 1e-3 * scale


def test_incremental_decode_with_cache_equals_full_pass(ckpt):
    model = _ours(ckpt["v1.1"])
    ids, mask, dec, _ = _batch()
    with torch.no_grad():
        full = model(ids, mask, dec)  # (B, Td, D)
        enc = model.encode(ids, mask)
        cache = model.new_cache()
        steps = [model.decode(dec[:, :2], enc, mask, cache=cache)]  # a 2-token prefill, then one at a time
        for t in range(2, dec.shape[1]):
            steps.append(model.decode(dec[:, t : t + 1], None, mask, cache=cache))
    assert cache.length == dec.shape[1]
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-5


def test_relative_position_buckets_match_transformers():
    rel = torch.arange(-300, 300)[None, :]
    for bidirectional in (True, False):
        for nb, md in ((32, 128), (8, 16)):
            ref = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(rel, bidirectional, nb, md)
            assert torch.equal(relative_position_bucket(rel, bidirectional, nb, md), ref)


# ----------------------------------------------------------------------------- precision


def test_fp16_refused_unless_opted_in_then_warned_and_clamped(ckpt):
    model = _ours(ckpt["v1.0"])
    with torch.no_grad():
        for block in model.encoder.block:  # make the FF overflow float16 (max 65504)
            block.layer[-1].DenseReluDense.wo.weight.mul_(1e4)
    model = model.half()
    ids, mask, dec, dmask = _batch()
    with pytest.raises(ValueError, match="float16"):
        model(ids, mask, dec, dmask)
    model.allow_fp16 = True
    with pytest.warns(UserWarning, match="float16"):
        with torch.no_grad():
            hidden = model(ids, mask, dec, dmask)
    assert torch.isfinite(hidden).all()


def test_fp16_autocast_refused(ckpt):
    model = _ours(ckpt["v1.0"])
    ids, mask, dec, dmask = _batch()
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(ValueError, match="bfloat16"):
        model(ids, mask, dec, dmask)


def test_clamp_fp16_is_transformers_rule():
    x = torch.tensor([1.0, -3.0, 60000.0], dtype=torch.float16)
    assert torch.equal(clamp_fp16(x), x)  # nothing overflowed: untouched
    y = torch.tensor([float("inf"), -float("inf"), 2.0], dtype=torch.float16)
    limit = torch.finfo(torch.float16).max - 1000
    assert clamp_fp16(y).tolist() == [pytest.approx(limit, abs=32), pytest.approx(-limit, abs=32), 2.0]
    z = torch.tensor([float("inf")], dtype=torch.bfloat16)
    assert torch.equal(clamp_fp16(z), z)  # only float16 is clamped


# ----------------------------------------------------------------------------- generation


def _generate_with_an_eos_that_fires(hf, ids, mask, **kw) -> tuple[int, torch.Tensor]:
    """Pick as eos a token transformers generates mid-way, so rows end at different steps.

    A random tiny model never samples the real eos; we try the tokens of transformers' own
    first output (from position 3 on, then 1-2) until one really ends a returned hypothesis.
    """
    probe = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kw)
    for eos in dict.fromkeys(probe[:, 3:].flatten().tolist() + probe[:, 1:3].flatten().tolist()):
        ref = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, eos_token_id=eos, **kw)
        if (ref[:, 1:] == eos).any():
            return eos, ref
    raise AssertionError("no token of the reference output ends a hypothesis")


@pytest.mark.parametrize("style", ["v1.0", "v1.1"])
def test_greedy_equals_transformers(ckpt, style):
    ours, hf = _ours(ckpt[style]), _hf(ckpt[style])
    ids, mask, _, _ = _batch()
    with torch.no_grad():
        eos, ref = _generate_with_an_eos_that_fires(hf, ids, mask, max_new_tokens=8)
        out = generate(ours, ids, mask, max_new_tokens=8, eos_token_id=eos)
    assert torch.equal(out, ref), (out, ref)


@pytest.mark.parametrize(
    "style,length_penalty,early_stopping",
    [("v1.1", 1.0, False), ("v1.0", 0.6, False), ("v1.0", 2.0, True), ("v1.1", -0.5, "never"), ("v1.1", 2.0, "never")],
)
def test_beam_search_equals_transformers(ckpt, style, length_penalty, early_stopping):
    ours, hf = _ours(ckpt[style]), _hf(ckpt[style])
    ids, mask, _, _ = _batch()
    kw = dict(max_new_tokens=7, num_beams=3, length_penalty=length_penalty, early_stopping=early_stopping)
    with torch.no_grad():
        eos, ref = _generate_with_an_eos_that_fires(hf, ids, mask, **kw)
        out = generate(ours, ids, mask, eos_token_id=eos, **kw)
    assert torch.equal(out, ref), (out, ref)


# ----------------------------------------------------------------------------- labels


def test_shift_right_treats_minus_100_as_pad(ckpt):
    labels = torch.tensor([[5, 6, 7, 1], [8, 1, -100, -100]])
    hf = _hf(ckpt["v1.0"])
    assert torch.equal(shift_right(labels, 0, 0), hf._shift_right(labels))
    assert torch.equal(_ours(ckpt["v1.0"]).shift_right(labels), hf._shift_right(labels))
    assert torch.equal(shift_right(labels, 3, 9), torch.tensor([[3, 5, 6, 7], [3, 8, 1, 9]]))
    assert torch.equal(ignored_to_pad(labels, 0), torch.tensor([[5, 6, 7, 1], [8, 1, 0, 0]]))


# ----------------------------------------------------------------------------- contract


@pytest.mark.parametrize("style", ["v1.0", "v1.1"])
def test_resize_keeps_rows_and_updates_config(ckpt, style):
    model = _ours(ckpt[style])
    old_emb, old_head = model.shared.weight.detach().clone(), model.lm_head.weight.detach().clone()
    ids, mask, dec, _ = _batch()
    with torch.no_grad():
        before = model.output_projection(model(ids, mask, dec))
    model.resize_token_embeddings(140)
    assert model.config.vocab_size == 140
    assert model.shared.weight.shape == (140, 64) and model.lm_head.weight.shape == (140, 64)
    assert model.encoder.embed_tokens is model.shared and model.decoder.embed_tokens is model.shared
    assert torch.equal(model.shared.weight[:128], old_emb)
    assert torch.allclose(model.shared.weight[128:], old_emb.mean(0).expand(12, -1))
    assert torch.allclose(model.lm_head.weight[128:], old_head.mean(0).expand(12, -1))
    assert (model.lm_head.weight is model.shared.weight) == (style == "v1.0")
    with torch.no_grad():
        after = model.output_projection(model(ids, mask, dec))
    assert after.shape[-1] == 140 and torch.equal(after[..., :128], before)


@pytest.mark.parametrize("style", ["v1.0", "v1.1"])
def test_config_round_trip_loads_in_transformers(ckpt, style, tmp_path):
    ours = _ours(ckpt[style])
    hf_dict = ours.config.to_hf()
    assert T5Config.from_hf(hf_dict) == ours.config
    (tmp_path / "config.json").write_text(json.dumps(hf_dict))
    sd = {k: v for k, v in ours.state_dict().items() if k not in ALIASES}
    if ours.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf = _hf(tmp_path)
    ids, mask, dec, dmask = _batch()
    with torch.no_grad():
        mine = ours.output_projection(ours(ids, mask, dec, dmask))
        theirs = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dmask).logits
    assert _max_diff_at(mine, theirs, dmask) <= 1e-4


def test_from_hf_rejects_unknown_maths_and_ignores_harmless(ckpt):
    d = json.loads((ckpt["v1.1"] / "config.json").read_text())
    cfg = T5Config.from_hf({**d, "task_specific_params": {"x": 1}, "n_positions": 512})
    assert cfg.feed_forward_proj == "gated-gelu" and cfg.d_kv == 16
    with pytest.raises(ValueError, match="config.json: rope_theta"):
        T5Config.from_hf({**d, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="config.json: feed_forward_proj"):
        T5Config.from_hf({**d, "feed_forward_proj": "gated-gelu-x"})
    with pytest.raises(ValueError, match="config.json: model_type"):
        T5Config.from_hf({**d, "model_type": "bart"})
    flan = {  # the fields of google/flan-t5-base's config.json on the Hub
        "architectures": ["T5ForConditionalGeneration"], "d_ff": 2048, "d_kv": 64, "d_model": 768,
        "decoder_start_token_id": 0, "dense_act_fn": "gelu_new", "dropout_rate": 0.1, "eos_token_id": 1,
        "feed_forward_proj": "gated-gelu", "initializer_factor": 1.0, "is_encoder_decoder": True,
        "is_gated_act": True, "layer_norm_epsilon": 1e-06, "model_type": "t5", "n_positions": 512,
        "num_decoder_layers": 12, "num_heads": 12, "num_layers": 12, "output_past": True, "pad_token_id": 0,
        "relative_attention_max_distance": 128, "relative_attention_num_buckets": 32,
        "task_specific_params": {}, "tie_word_embeddings": False, "torch_dtype": "float32",
        "transformers_version": "4.23.1", "use_cache": True, "vocab_size": 32128,
    }
    flan_cfg = T5Config.from_hf(flan)
    assert not flan_cfg.tie_word_embeddings and not flan_cfg.scale_decoder_outputs and flan_cfg.activation == "gelu_new"
    old = T5Config.from_hf({"d_model": 64, "feed_forward_proj": "relu"})  # pre-transformers-5 defaults
    assert old.tie_word_embeddings and old.scale_decoder_outputs and old.decoder_start_token_id == 0


@pytest.mark.parametrize("style", ["v1.0", "v1.1"])
def test_build_on_meta_then_assign(ckpt, style):
    cfg = T5Config.from_hf(json.loads((ckpt[style] / "config.json").read_text()))
    with torch.device("meta"):
        model = T5ForConditionalGeneration(cfg)
    model.load_state_dict(load_file(ckpt[style] / "model.safetensors"), strict=True, assign=True)
    model.tie_weights()
    model.eval()
    assert not any(p.is_meta for p in model.parameters())
    assert list(model.buffers()) == []
    ids, mask, dec, dmask = _batch()
    with torch.no_grad():
        mine = model.output_projection(model(ids, mask, dec, dmask))
        ref = _ours(ckpt[style]).output_projection(_ours(ckpt[style])(ids, mask, dec, dmask))
    assert torch.equal(mine, ref)


def test_contract_attributes(ckpt):
    model = _ours(ckpt["v1.0"])
    assert model.is_encoder_decoder and model.block_types == (T5Block,)
    assert model.input_embeddings is model.shared and model.output_projection is model.lm_head
    names = [n for n, _ in model.named_parameters()]
    assert "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in names
    assert "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight" not in names
    assert "decoder.block.1.layer.2.DenseReluDense.wi.weight" in names and "lm_head.weight" not in names


def test_old_checkpoint_keys_load_and_differing_tied_head_is_refused(ckpt):
    sd = load_file(ckpt["v1.0"] / "model.safetensors")
    cfg = T5Config.from_hf(json.loads((ckpt["v1.0"] / "config.json").read_text()))
    old = dict(sd)  # older savers wrote every alias and an unused cross-attention bias table
    old.update({k: sd["shared.weight"] for k in ALIASES + ("lm_head.weight",)})
    old["decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"] = torch.zeros(8, 4)
    T5ForConditionalGeneration(cfg).load_state_dict(old, strict=True)
    bad = {**sd, "lm_head.weight": sd["shared.weight"] + 1}
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        T5ForConditionalGeneration(cfg).load_state_dict(bad, strict=True)


@pytest.mark.parametrize("style", ["v1.0", "v1.1"])
def test_minitrain_loader_builds_and_loads(ckpt, style):
    from minitrain.weights import load_pretrained
    from models import from_hf_config

    model = load_pretrained(ckpt[style], from_hf_config).eval()
    assert isinstance(model, T5ForConditionalGeneration)
    ids, mask, dec, dmask = _batch()
    with torch.no_grad():
        mine = model.output_projection(model(ids, mask, dec, dmask))
        ref = _hf(ckpt[style])(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dmask).logits
    assert _max_diff_at(mine, ref, dmask) <= 1e-4


def test_minitrain_loader_skips_the_unused_cross_attention_bias(ckpt, tmp_path):
    from safetensors.torch import save_file

    from minitrain.weights import load_pretrained
    from models import from_hf_config

    sd = load_file(ckpt["v1.0"] / "model.safetensors")
    (tmp_path / "config.json").write_text((ckpt["v1.0"] / "config.json").read_text())
    save_file({**sd, "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight": torch.zeros(8, 4)},
              tmp_path / "model.safetensors")
    model = load_pretrained(tmp_path, from_hf_config)
    assert torch.equal(model.shared.weight, sd["shared.weight"])


def test_no_warning_in_fp32(ckpt):
    model = _ours(ckpt["v1.0"])
    ids, mask, dec, dmask = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model(ids, mask, dec, dmask)
