"""Gemma 4 (`models/gemma4.py`) against transformers.

Tiny random checkpoints saved once per session by transformers 5 (fp32; norms and each layer's
`layer_scalar` perturbed so that every tensor matters):

- `e2b`: the E2B / E4B layout: per-layer embeddings (PLE), sliding (head dim 16, window 5) and global
  layers (head dim 32, one kv head, `attention_k_eq_v`: no v_proj), proportional RoPE on the global
  layers (half of the frequencies turned, base 100 so that they turn within 40 tokens), the last two
  layers reusing the keys and values of the last earlier sliding / global layer, their MLPs
  double-wide, the final logit soft cap;
- `dense`: the 31B layout: no PLE, no sharing, separate v_proj, the global layers' own head dim, a
  proportional RoPE `factor`;
- `moe`: the 26B-A4B layout: the expert block (4 experts, top 2) beside each layer's MLP.

Compared with transformers: logits on padded batches (left, right, none; measured equal to the bit),
every parameter's gradient and a LoRA step's (against peft), greedy generation and GRPO's sampler through
the cache (shared keys included), the saved folder. The multimodal `gemma4` checkpoint (a vision and an
audio tower): its language model and vision tower load, the audio tower is carried, peft on `AutoModelForImageTextToText` takes our adapter,
merge and full fine-tuning write the towers back bit for bit. Through the CLI: LoRA SFT (packed and
padded), DPO (shared prompt), exact resume on the MoE size; GGUF export of a kv-sharing layout llama.cpp would
run otherwise refuses in one line (GGUF export itself: tests/test_gguf.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from test_llama import prompts
from test_qwen3_5 import hidden, positions, rel

import models
from minitrain.weights import load_pretrained, save_pretrained

REPO = Path(__file__).resolve().parents[1]
TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, global_head_dim=32, sliding_window=5, max_position_embeddings=256, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, initializer_range=0.1)
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 100.0}}
CONFIGS = {
    "e2b": dict(num_hidden_layers=5, num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
                use_double_wide_mlp=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
                layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                             "full_attention"], final_logit_softcapping=5.0, rope_parameters=ROPE),
    "moe": dict(num_hidden_layers=2, hidden_size_per_layer_input=0, layer_types=["sliding_attention", "full_attention"],
                enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32, rope_parameters=ROPE),
    "dense": dict(num_hidden_layers=3, hidden_size_per_layer_input=0, tie_word_embeddings=False,
                  layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                  rope_parameters={**ROPE, "full_attention": {**ROPE["full_attention"], "factor": 2.0}}),
}


def perturb(model):
    """Random init leaves the norms at 1 and each layer's scalar at 1: move them so that they matter."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("scale"):  # the MoE router's scale, per_expert_scale
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.add_(0.2 * torch.randn_like(b))
    return model


@pytest.fixture(scope="session")
def g4(tmp_path_factory):
    cache = {}

    def make(name: str) -> Path:
        if name not in cache:
            cfg = transformers.AutoConfig.for_model("gemma4_text", **TEXT, **CONFIGS[name])
            torch.manual_seed(0)
            d = tmp_path_factory.mktemp(f"gemma4_{name}")
            perturb(transformers.AutoModelForCausalLM.from_config(cfg)).save_pretrained(d)
            cache[name] = d
        return cache[name]

    return make


def load_ours(folder):
    return load_pretrained(folder, models.from_hf_config).eval()


def load_hf(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def batch(T: int, padding: str, n_pad: int = 9, seed: int = 0, high: int = 128):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, high, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    if padding == "left":
        mask[1, :n_pad] = 0
    elif padding == "right":
        mask[1, -n_pad:] = 0
    ids[mask == 0] = 0
    return ids, mask


ATTENTION_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapted(model, folder: Path, targets):
    """`model` with LoRA on `targets`, B drawn at random (at zero the adapter would be a no-op), saved in
    peft's format to `folder`."""
    from minitrain.adapters.lora import LoRAConfig, apply_lora
    from minitrain.adapters.peft_format import save_adapter

    cfg = LoRAConfig(r=4, alpha=8, targets=tuple(targets))
    apply_lora(model, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    save_adapter(model, folder, cfg)
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(g4, name):
    """40 tokens (eight sliding windows), padded left, right, not at all: the real tokens' logits within
    1e-5 relative (measured: 0, the same operations in the same order)."""
    folder = g4(name)
    ours, hf = load_ours(folder), load_hf(folder)
    for padding in ("none", "left", "right"):
        ids, mask = batch(40, padding)
        a = ours.output_projection(hidden(ours, ids, mask))
        with torch.no_grad():
            b = hf(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        real = mask.bool()
        assert rel(a[real], b[real]) <= 1e-5, padding


@pytest.mark.parametrize("change", ["proportional", "layer_scalar", "sharing", "per_layer_inputs"])
def test_each_feature_changes_the_logits(g4, change):
    """Not a no-op: the default RoPE on the global layers, a layer scalar of 1, a shared layer computing
    from the other type's keys, or zero per-layer inputs each move the logits by more than 1%."""
    from models.layers import RopeSpec, RotaryEmbedding

    folder = g4("e2b")
    ours = load_ours(folder)
    ids, mask = batch(40, "none")
    ref = ours.output_projection(hidden(ours, ids, mask))
    body = ours.model
    if change == "proportional":
        body.rotary["full_attention"] = RotaryEmbedding(RopeSpec(32, 100.0, None, 256))
    elif change == "layer_scalar":
        for layer in body.layers:
            layer.layer_scalar.fill_(1.0)
    elif change == "sharing":  # the sliding layer 3 reads the keys of the sliding layer 0 instead of layer 2
        body.sources = [None, None, None, 0, 1]
    else:
        body.embed_tokens_per_layer.weight.data.zero_()
        body.per_layer_model_projection.weight.data.zero_()
    assert rel(ours.output_projection(hidden(ours, ids, mask)), ref) > 1e-2


@pytest.mark.parametrize("name", ["e2b", "moe"])
def test_gradients_match_transformers(g4, name):
    """Every parameter's gradient (the PLE tables and projections, q / k norms, the shared layers' q_proj
    and double-wide MLPs; the router and the 3-D experts) equals transformers' under the same loss, right
    padding."""
    folder = g4(name)
    ours, hf = load_ours(folder).train(), load_hf(folder).train()
    for p in ours.parameters():
        p.requires_grad_(True)
    ids, mask = batch(40, "right", n_pad=7)
    labels = ids.masked_fill(mask == 0, -100)
    hf(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    logits = ours.output_projection(ours(ids, mask))
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()).backward()
    theirs = dict(hf.named_parameters())
    assert set(theirs) == {n for n, _ in ours.named_parameters()}
    for n, p in ours.named_parameters():
        ref = theirs[n].grad
        assert (p.grad - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-9, n


def test_lora_step_gradients_match_peft(g4, tmp_path):
    """A LoRA step: our adapter (every projection, the PLE gate and projection included), saved and put on
    transformers' model by peft, gets the same loss and the same gradient on every LoRA factor."""
    peft = pytest.importorskip("peft")
    folder = g4("e2b")
    ours = adapted(load_ours(folder), tmp_path / "adapter", (*ATTENTION_MLP, "per_layer_input_gate", "per_layer_projection"))
    ref = peft.PeftModel.from_pretrained(load_hf(folder), tmp_path / "adapter", is_trainable=True).train()
    ours.train()
    ids, mask = batch(40, "left", n_pad=5)
    labels = ids.masked_fill(mask == 0, -100)
    loss_ref = ref(input_ids=ids, attention_mask=mask, position_ids=positions(mask), labels=labels).loss
    loss_ref.backward()
    logits = ours.output_projection(ours(ids, mask))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    loss.backward()
    assert float(loss.detach()) == pytest.approx(float(loss_ref.detach()), rel=1e-5)
    theirs = {n.removeprefix("base_model.model.").replace(".default", ""): p.grad
              for n, p in ref.named_parameters() if "lora_" in n}
    mine = {n: p.grad for n, p in ours.named_parameters() if "lora_" in n}
    assert set(mine) == set(theirs) and any("per_layer_input_gate" in n for n in mine)
    for n, g in mine.items():
        assert (g - theirs[n]).abs().max() <= 1e-5 * theirs[n].abs().max() + 1e-9, n


def test_packed_rows_equal_each_sequence_alone_and_flex_equals_sdpa(g4):
    """A packed row (two documents, then padding) gives each document's hidden states alone (the shared
    layers read their source's keys inside each document only); `attention=flex` (forward: a CPU's
    FlexAttention has no backward) gives SDPA's, a shared prompt too."""
    ours = load_ours(g4("e2b"))
    row = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(6))
    docs = torch.tensor([[1] * 15 + [2] * 20 + [-1] * 5])
    pos = torch.tensor([list(range(15)) + list(range(20)) + [0] * 5])
    packed = hidden(ours, row, position_ids=pos, document_ids=docs)
    for a, b in ((0, 15), (15, 35)):
        alone = hidden(ours, row[:, a:b])
        assert rel(packed[:, a:b], alone) <= 1e-5
    for docs, pos in ((docs, pos), (torch.tensor([[0] * 15 + [1] * 20 + [2] * 5]),
                                    torch.tensor([list(range(35)) + list(range(15, 20))]))):
        want = hidden(ours, row, position_ids=pos, document_ids=docs)
        ours.packed_attention = "flex"
        got = hidden(ours, row, position_ids=pos, document_ids=docs)
        ours.packed_attention = "sdpa"
        real = docs[0] >= 0
        assert rel(got[:, real], want[:, real]) <= 1e-5


def test_a_shared_layers_stored_keys_are_carried_not_read(g4, tmp_path):
    """A checkpoint that still holds k / v projections for a shared layer (transformers ignores them) loads
    with the same logits, and a save writes them back bit for bit."""
    from safetensors.torch import save_file

    folder = g4("e2b")
    shutil.copytree(folder, tmp_path / "extra")
    sd = load_file(folder / "model.safetensors")
    extra = {"model.layers.3.self_attn.k_proj.weight": torch.randn(32, 64),
             "model.layers.4.self_attn.k_norm.weight": torch.randn(32)}
    save_file({**sd, **extra}, tmp_path / "extra" / "model.safetensors", metadata={"format": "pt"})
    ours, ids = load_ours(tmp_path / "extra"), batch(20, "none")[0]
    assert torch.equal(ours.output_projection(hidden(ours, ids)), ours.output_projection(hidden(load_ours(folder), ids)))
    config = json.loads((folder / "config.json").read_text())
    save_pretrained(ours, tmp_path / "out", config)
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(written[k], v) for k, v in extra.items())


def test_lora_on_the_experts_loads_in_peft(g4, tmp_path):
    """LoRA on the MoE size's 3-D experts (`gate_up_proj`, `down_proj`: peft's `target_parameters`) beside
    q_proj and the MLP's down_proj: peft puts the adapter on transformers' model with our logits."""
    peft = pytest.importorskip("peft")
    folder = g4("moe")
    ours = adapted(load_ours(folder), tmp_path / "adapter", ("q_proj", "gate_up_proj", "down_proj"))
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert "0.experts.gate_up_proj" in saved["target_parameters"]
    ref = peft.PeftModel.from_pretrained(load_hf(folder), tmp_path / "adapter").eval()
    ids, mask = batch(30, "none")
    with torch.no_grad():
        b = ref(input_ids=ids).logits
    assert rel(ours.output_projection(hidden(ours, ids)), b) <= 1e-5


def test_state_dict_keys_are_transformers_keys(g4):
    """Key for key and shape for shape, `layer_scalar` buffers included; the shared layers hold no k / v."""
    for name in CONFIGS:
        folder = g4(name)
        with torch.device("meta"):
            ours = models.from_hf_config(json.loads((folder / "config.json").read_text()))
        theirs = load_hf(folder).state_dict()
        assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.items()}


def test_greedy_generate_matches_transformers(g4):
    """Greedy `generate` on left-padded prompts (prefill, then one token a step through the cache; the
    shared layers read the keys their source layer keeps in the cache) equals transformers'."""
    folder = g4("e2b")
    ours, hf = load_ours(folder), load_hf(folder)
    hf.generation_config.eos_token_id = None
    ids, mask = prompts()  # row 1: 7 pads then 5 real tokens
    ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    out = models.family(ours).generate(ours, ids, mask, max_new_tokens=12, eos_token_id=[], pad_token_id=0)
    assert torch.equal(out, ref)
    # GRPO's sampler: the prompts prefilled once, the cache repeated G = 2 times, finished rows dropped
    from minitrain.objectives.sampling import sample

    eos = int(ref[0, 12 + 2])
    comp = sample(ours, ids, mask, new_cache=models.family(ours).KVCache, num_generations=2, max_new_tokens=12,
                  greedy=True, eos_ids=[eos], pad_id=0)
    assert torch.equal(comp.ids[0, :3], ref[0, 12:15]) and torch.equal(comp.ids[1, :3], ref[0, 12:15])
    n = int(comp.mask[2].sum())
    assert torch.equal(comp.ids[2, :n], ref[1, 12:12 + n]) and torch.equal(comp.ids[3], comp.ids[2])


def test_activation_checkpointing_gives_the_same_gradients(g4):
    """The engine's per-block checkpointing recomputes each block (a shared layer gets its source's keys
    and values as inputs): the same gradients as without it."""
    from minitrain.train import enable_checkpointing

    ids, mask = batch(40, "left", n_pad=6)
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for setting in (False, True):
        model = load_ours(g4("e2b")).train()
        for p in model.parameters():
            p.requires_grad_(True)
        if setting:
            assert enable_checkpointing(model, True) == 5
        logits = model.output_projection(model(ids, mask))
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n, g in grads[0].items():
        assert torch.allclose(grads[1][n], g, rtol=1e-5, atol=1e-7), n


def test_saved_folder_and_config_load_in_transformers(g4, tmp_path):
    """`to_hf` round-trips; our `save_pretrained` loads in transformers with our logits; the published
    spelling (`global_head_dim`, `num_global_key_value_heads`) reads as transformers 5's `per_layer_config`."""
    for name in CONFIGS:
        folder = g4(name)
        ours = load_ours(folder)
        config = json.loads((folder / "config.json").read_text())
        cfg = models.config_from_hf(config)
        d = json.loads(json.dumps(cfg.to_hf()))
        assert models.config_from_hf(d) == cfg
        published = {k: v for k, v in config.items() if k != "per_layer_config"}
        published.update(global_head_dim=32, num_global_key_value_heads=CONFIGS[name].get("num_global_key_value_heads"))
        assert models.config_from_hf(published) == cfg
        save_pretrained(ours, tmp_path / name, d)
        ids, mask = batch(30, "left", n_pad=6)
        a = ours.output_projection(hidden(ours, ids, mask))
        with torch.no_grad():
            b = load_hf(tmp_path / name)(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        assert rel(a[mask.bool()], b[mask.bool()]) <= 1e-5


# google/gemma-4-31B-it's text_config as transformers 5.7 prints it (a field renamed since: expert_intermediate_size)
GEMMA4_31B = {
    "attention_bias": False, "attention_dropout": 0.0, "attention_k_eq_v": True, "bos_token_id": 2, "dtype": "bfloat16",
    "enable_moe_block": False, "eos_token_id": 1, "expert_intermediate_size": None, "final_logit_softcapping": 30.0,
    "global_head_dim": 512, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 5376,
    "hidden_size_per_layer_input": 0, "initializer_range": 0.02, "intermediate_size": 21504,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "max_position_embeddings": 262144,
    "model_type": "gemma4_text", "moe_intermediate_size": None, "num_attention_heads": 32, "num_experts": None,
    "num_global_key_value_heads": 4, "num_hidden_layers": 60, "num_key_value_heads": 16, "num_kv_shared_layers": 0,
    "pad_token_id": 0, "rms_norm_eps": 1e-06,
    "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                           "rope_type": "proportional"},
                        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
    "sliding_window": 1024, "tie_word_embeddings": True, "top_k_experts": None, "use_bidirectional_attention": "vision",
    "use_cache": True, "use_double_wide_mlp": False, "vocab_size": 262144, "vocab_size_per_layer_input": 262144,
}


def test_the_published_31b_config_builds_its_shapes():
    """gemma-4-31B-it's config (inside a multimodal one) reads, and builds on meta the shapes transformers
    builds: sliding layers q 8192 / k, v 4096 wide, global layers q 16384 / k 2048 and no v_proj."""
    config = {"model_type": "gemma4", "text_config": dict(GEMMA4_31B, layer_types=GEMMA4_31B["layer_types"] * 10),
              "vision_config": {"model_type": "gemma4_vision"}, "audio_config": None, "tie_word_embeddings": True}
    with torch.device("meta"):
        model = models.from_hf_config(config)
    layers = model.model.language_model.layers
    assert (layers[0].self_attn.q_proj.out_features, layers[0].self_attn.k_proj.out_features,
            layers[0].self_attn.v_proj.out_features) == (8192, 4096, 4096)
    assert (layers[5].self_attn.q_proj.out_features, layers[5].self_attn.k_proj.out_features) == (16384, 2048)
    assert not hasattr(layers[5].self_attn, "v_proj")
    n = sum(p.numel() for p in model.parameters())
    assert 30.0e9 < n < 31.5e9, n


BASE = dict(model_type="gemma4_text", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32)


@pytest.mark.parametrize("config, named", [
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 5, "moe_intermediate_size": 32}, "top_k_experts"),
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2}, "moe_intermediate_size"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"num_kv_shared_layers": 2}, "num_kv_shared_layers"),
    ({"num_hidden_layers": 3, "num_kv_shared_layers": 2,
      "layer_types": ["sliding_attention", "full_attention", "full_attention"]}, "num_kv_shared_layers"),
    ({"per_layer_config": {"0": {"head_dim": 32}}}, "per_layer_config"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "proportional", "rope_theta": 1e6, "beta": 2}}}, "beta"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6}},
      "layer_types": ["sliding_attention", "full_attention"]}, "sliding_attention"),
    ({"hidden_activation": "relu"}, "hidden_activation"),
    ({"altup_num_inputs": 4}, "altup_num_inputs"),
])
def test_configs_we_cannot_honour_are_value_errors(config, named):
    with pytest.raises(ValueError, match=named) as e:
        models.from_hf_config({**BASE, **config})
    assert str(e.value).startswith("config.json: ") and " — " in str(e.value)


# --------------------------------------------------------------------------------------------
# The multimodal checkpoint
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def multimodal(tmp_path_factory):
    """A tiny `Gemma4ForConditionalGeneration` saved by transformers: one-layer vision and audio towers
    beside a language model with PLE, a shared layer and the proportional RoPE. Its image / audio token
    ids are 120..126: the text batches stay below them."""
    text = dict(TEXT, num_hidden_layers=3, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
                num_kv_shared_layers=1, layer_types=["sliding_attention", "full_attention", "full_attention"],
                final_logit_softcapping=5.0, rope_parameters=ROPE)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=16)
    audio = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                 output_proj_dims=32)
    cfg = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=audio, image_token_id=120,
                                    video_token_id=121, audio_token_id=122, boi_token_id=123, eoi_token_id=124,
                                    boa_token_id=125, eoa_token_index=126)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("gemma4_multimodal")
    perturb(transformers.Gemma4ForConditionalGeneration(cfg).eval()).save_pretrained(d)
    return d


def load_multimodal(folder):
    return transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


def test_multimodal_checkpoint_loads_its_language_model_and_vision_tower(multimodal, monkeypatch):
    """Text logits equal the multimodal class's (left padding); the audio tower's tensors are never read (one
    read per tensor of ours: the language model, the vision tower and its embedder, tests/test_gemma4_vl.py);
    `to_hf` gives back the multimodal config."""
    import minitrain.weights as weights

    read = []
    real_read = weights.read_tensor
    monkeypatch.setattr(weights, "read_tensor", lambda *a: read.append(a[-1]) or real_read(*a))
    ours = load_ours(multimodal)
    names = set(ours.state_dict())
    assert all(k.startswith(("model.language_model.", "lm_head.", "model.vision_tower.", "model.embed_vision."))
               for k in names)
    assert any(k.startswith("model.vision_tower.") for k in names)
    assert len(read) == len(names) - 1  # the tied lm_head is the embedding: no audio tensor read
    ids, mask = batch(40, "left", high=120)
    a = ours.output_projection(hidden(ours, ids, mask))
    with torch.no_grad():
        b = load_multimodal(multimodal)(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
    assert rel(a[mask.bool()], b[mask.bool()]) <= 1e-5
    config = json.loads((multimodal / "config.json").read_text())
    cfg = models.config_from_hf(config)
    assert cfg.model_type == "gemma4" and models.config_from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg
    assert cfg.to_hf()["vision_config"] == config["vision_config"]
    assert cfg.to_hf()["audio_config"] == config["audio_config"]


def test_multimodal_lora_adapter_loads_in_peft_on_the_multimodal_class(multimodal, tmp_path):
    """A LoRA adapter on the language model has the keys peft writes on transformers' multimodal class:
    `PeftModel.from_pretrained` on `AutoModelForImageTextToText` loads it with our text logits; minitrain
    merge folds it in, writes every tower tensor back bit for bit, and transformers loads the result."""
    peft = pytest.importorskip("peft")
    from minitrain.commands import merge as tool

    ours = adapted(load_ours(multimodal), tmp_path / "adapter", ATTENTION_MLP)
    keys = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert not any(k.startswith(("base_model.model.model.vision_tower", "base_model.model.model.audio_tower"))
                   for k in keys)
    ref = peft.PeftModel.from_pretrained(load_multimodal(multimodal), tmp_path / "adapter").eval()
    ids, mask = batch(40, "none", high=120)
    with torch.no_grad():
        b = ref(input_ids=ids, attention_mask=mask).logits
    a = ours.output_projection(hidden(ours.eval(), ids, mask))
    assert rel(a, b) <= 1e-5

    tool.merge(str(multimodal), str(tmp_path / "adapter"), str(tmp_path / "merged"), dtype="float32")
    before, after = load_file(multimodal / "model.safetensors"), load_file(tmp_path / "merged" / "model.safetensors")
    assert set(after) == set(before)
    towers = [k for k in before if k.startswith(TOWERS)]
    assert towers and all(torch.equal(after[k], before[k]) for k in towers)
    with torch.no_grad():
        merged = load_multimodal(tmp_path / "merged")(input_ids=ids, attention_mask=mask).logits
    assert rel(merged, a) <= 1e-5


# --------------------------------------------------------------------------------------------
# Through the CLI
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_model(g4, tmp_path_factory):
    from _tok import make_bpe_tokenizer

    d = tmp_path_factory.mktemp("gemma4_cli") / "model"
    shutil.copytree(g4("e2b"), d)
    make_bpe_tokenizer(d)
    return d


def sft_rows(tmp_path, n: int = 8) -> Path:
    from _tok import corpus

    lines = corpus(2 * n, seed=3)
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": lines[2 * i], "completion": " " + lines[2 * i + 1]}) + "\n"
                            for i in range(n)))
    return data


def test_lora_sft_packed_and_dpo_through_the_cli(cli_model, tmp_path, capsys):
    """`recipes/sft.py` with LoRA (the default projections and the PLE gate / projection): the preflight
    audit passes, 2 steps with finite losses, peft puts the adapter on transformers' model with our
    logits; `packing=true` trains with the padded run's first-step loss; DPO's shared-prompt rows give
    the metrics of `[chosen; rejected]` rows."""
    peft = pytest.importorskip("peft")
    from _tok import corpus
    from test_families_cli import run

    from minitrain.adapters.peft_format import load_adapter

    data = sft_rows(tmp_path)
    targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,per_layer_input_gate,per_layer_projection"
    padded = run(capsys, "sft.py", cli_model, data, tmp_path / "sft", lora_targets=targets)
    adapter = tmp_path / "sft" / "adapter"
    keys = load_file(adapter / "adapter_model.safetensors")
    assert any(".per_layer_input_gate.lora_A" in k for k in keys)
    assert not any(".layers.3.self_attn.k_proj" in k for k in keys)  # a shared layer has no k_proj
    ours = load_ours(cli_model)
    load_adapter(ours, adapter)
    ref = peft.PeftModel.from_pretrained(load_hf(cli_model), adapter).eval()
    ids = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        b = ref(input_ids=ids).logits
    assert rel(ours.output_projection(hidden(ours, ids)), b) <= 1e-5

    packed = run(capsys, "sft.py", cli_model, data, tmp_path / "packed", lora_targets=targets, packing="true")
    assert packed[0]["loss"] == pytest.approx(padded[0]["loss"], rel=1e-5)

    lines = corpus(40, seed=3)
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": lines[i], "chosen": " " + lines[i + 10],
                                         "rejected": " " + lines[i + 20]}) + "\n" for i in range(8)))
    two = run(capsys, "dpo_mistral.py", cli_model, prefs, tmp_path / "two")
    shared = run(capsys, "dpo_mistral.py", cli_model, prefs, tmp_path / "shared", shared_prompt="true")
    keys = [k for k in two[0] if k in ("loss", "grad_norm") or k.startswith(("logps/", "rewards/"))]
    assert "logps/chosen" in keys and "grad_norm" in keys
    for key in keys:
        assert shared[0][key] == pytest.approx(two[0][key], rel=1e-4, abs=1e-6), key


def test_full_fine_tuning_a_multimodal_checkpoint_keeps_its_towers(multimodal, tmp_path, capsys):
    """`finetune=full` through the CLI on text rows of the multimodal folder (its vision tower built and, with no
    image in the rows, frozen; images: tests/test_gemma4_vl.py): the written folder holds every tower tensor
    bit-identical to the input, the audio tower's too, a trained language model, and loads in transformers as the
    multimodal class with our text logits."""
    from _tok import make_bpe_tokenizer

    from minitrain.cli import run_cli

    model = tmp_path / "model"
    shutil.copytree(multimodal, model)
    make_bpe_tokenizer(model)
    keys = {"model": model, "data": sft_rows(tmp_path), "eval_data": "", "out": tmp_path / "out", "max_steps": 2,
            "batch_size": 2, "max_len": 64, "finetune": "full", "lr": 1e-3}
    assert run_cli([str(REPO / "recipes" / "sft.py")] + [f"{k}={v}" for k, v in keys.items()]) == 0, \
        capsys.readouterr().err
    written = next(p.parent for p in (tmp_path / "out").rglob("model.safetensors"))
    before, after = load_file(model / "model.safetensors"), load_file(written / "model.safetensors")
    assert set(after) == set(before)
    towers = [k for k in before if k.startswith(TOWERS)]
    assert towers and all(after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in towers)
    trained = "model.language_model.per_layer_model_projection.weight"
    assert not torch.equal(after[trained], before[trained])
    ids, mask = batch(40, "none", high=120)
    with torch.no_grad():
        b = load_multimodal(written)(input_ids=ids, attention_mask=mask).logits
    ours = load_ours(written)
    assert rel(ours.output_projection(hidden(ours, ids, mask)), b) <= 1e-5


def test_what_does_not_apply_yet_is_one_line(g4, tmp_path, capsys):
    """GGUF export of the `e2b` layout (its sliding shared layer reuses layer 2's keys, llama.cpp's gemma4 would give
    it layer 1's: tests/test_gguf.py exports the layouts llama.cpp computes) refuses in one line with exit 2, writing
    nothing; the dense and MoE sizes' plans print their tables (the MoE size's under quantize=nf4 too)."""
    from minitrain.commands import export, plan

    model = g4("e2b")
    capsys.readouterr()
    assert export.main(["--model", str(model), "--out", str(tmp_path / "m.gguf"), "--type", "f32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "num_kv_shared_layers=2" in err[0], err
    assert not (tmp_path / "m.gguf").exists()
    data = sft_rows(tmp_path)
    assert plan.main([str(REPO / "recipes" / "sft.py"), f"model={model}", f"data={data}"]) == 0  # the dense sizes
    assert "2 sharing k/v" in capsys.readouterr().out
    moe = g4("moe")
    capsys.readouterr()
    assert plan.main([str(REPO / "recipes" / "sft.py"), f"model={moe}", f"data={data}", "quantize=none"]) == 0
    assert "experts of" in capsys.readouterr().out  # the MoE size
    assert plan.main([str(REPO / "recipes" / "sft.py"), f"model={moe}", f"data={data}", "quantize=nf4"]) == 0
    assert "per expert: nf4" in capsys.readouterr().out  # QLoRA on the experts (tests/test_plan_hybrid.py)


def test_moe_size_resumes_exactly_through_the_cli(g4, tmp_path, capsys):
    """LoRA SFT on the MoE size (preflight audit healthy), stopped after step 2 (`stop_after`) and resumed
    with `resume=true`, ends with the uninterrupted run's metrics and adapter, bit for bit."""
    from _tok import make_bpe_tokenizer
    from test_resume import steady

    from minitrain.cli import run_cli

    model = tmp_path / "model"
    shutil.copytree(g4("moe"), model)
    make_bpe_tokenizer(model)
    data = sft_rows(tmp_path)

    def run(out: Path, *extra: str) -> list[dict]:
        keys = {"model": model, "data": data, "eval_data": "", "out": out, "max_steps": 4, "save_every": 2,
                "batch_size": 2, "grad_accum": 1, "lora_r": 4, "lora_alpha": 8, "max_len": 64, "log_every": 1,
                "lora_dropout": 0.1}
        argv = [str(REPO / "recipes" / "sft.py")] + [f"{k}={v}" for k, v in keys.items()] + list(extra)
        assert run_cli(argv) == 0, capsys.readouterr().err
        assert "audit: healthy" in capsys.readouterr().out
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    straight = run(tmp_path / "a")
    assert [r["step"] for r in run(tmp_path / "b", "stop_after=2") if "loss" in r] == [1, 2]
    resumed = run(tmp_path / "b", "resume=true")
    assert steady(resumed) == steady(straight) and [r["step"] for r in resumed if "loss" in r] == [1, 2, 3, 4]
    a = load_file(tmp_path / "a" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "b" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_qlora_under_fsdp_reads_the_layer_scalars_and_equals_ddp(g4, tmp_path, capsys):
    """The MoE size under `parallel=fsdp` on 2 gloo ranks (torchrun), int8 (its experts quantized each rank's own):
    the layer scalars, buffers FSDP2 does not shard, are read from the checkpoint (they once came out of `to_empty`
    as garbage: a run that learned nothing); step 1's loss is one process's, and the run, cut after step 2 and
    finished with resume=true, trains the adapter the same run trains under ddp."""
    pytest.importorskip("bitsandbytes")
    from _tok import make_bpe_tokenizer
    from test_distributed import cli_args, max_abs_diff
    from test_torchrun_resume import launch

    from minitrain.cli import run_cli

    model = tmp_path / "model"
    shutil.copytree(g4("moe"), model)
    make_bpe_tokenizer(model)
    keys = ["lora_targets=all-linear", "lr=1e-3", "quantize=int8"]
    assert run_cli(cli_args(model, tmp_path / "one", *keys)) == 0, capsys.readouterr().err
    launch(2, cli_args(model, tmp_path / "ddp", *keys))
    for leg in ("stop_after=2", "resume=true"):
        launch(2, cli_args(model, tmp_path / "fsdp", *keys, "parallel=fsdp", leg))

    def losses(run: str) -> list[float]:
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if "loss" in r]

    assert len(losses("fsdp")) == 3 and losses("fsdp")[0] == pytest.approx(losses("one")[0], rel=1e-5)
    assert losses("fsdp") == pytest.approx(losses("ddp"), rel=1e-5)
    got = load_file(tmp_path / "fsdp" / "adapter" / "adapter_model.safetensors")
    diff = max_abs_diff(got, load_file(tmp_path / "ddp" / "adapter" / "adapter_model.safetensors"))
    print(f"losses one / ddp / fsdp: {losses('one')} / {losses('ddp')} / {losses('fsdp')}; adapter |fsdp - ddp| {diff:.2e}")
    assert diff <= 1e-5
    assert max(float(t.abs().max()) for k, t in got.items() if "lora_B" in k) > 1e-4  # it trained
