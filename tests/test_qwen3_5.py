"""Qwen3.5 dense and MoE (`models/qwen3_5.py`: Gated DeltaNet + gated attention, SwiGLU or experts) against
transformers.

A tiny random `qwen3_5_text` checkpoint saved by transformers 5 (`conftest.save_hf_causal`: 4 layers,
three DeltaNet and one attention layer, hidden 64, GVA 2 q/k heads -> 4 v heads, a quarter of each
attention head rotated) loads through our loader and is compared with transformers' torch path:
logits on padded batches over several chunks (<= 1e-4 relative), every parameter's gradient, greedy
generation (our cache: convolution window + recurrent state for DeltaNet layers, K / V for the
attention layer), GRPO's sampler. State per sequence: a packed row equals each sequence alone, a
left-padded row equals the row without its padding, rows with a shared prefix equal [prefix; sequence]
alone; the chunked rule equals transformers' token-by-token recurrence restarted at each sequence.
Through the engine: LoRA SFT, DPO (shared prompt), packed SFT, GRPO and full fine-tuning from the CLI,
activation checkpointing and compiled blocks; the multimodal checkpoint on text (logits, peft on the
multimodal class, minitrain merge, and full fine-tuning on text rows writing the frozen tower back bit for bit;
with images: tests/test_qwen3_5_vl.py).
`initializer_range=0.15` makes the DeltaNet layers matter without fp32 rounding reaching 1e-4 (measured:
logits 6e-5 at worst, gradients 5.5e-5; a one-token state leak across a boundary: 0.77).

The MoE sizes (`qwen3_5_moe_text`, `VARIANTS["moe"]`: the same layers, every MLP 4 experts top-2 plus the
shared expert; router logits of std ~1.2 at `initializer_range=0.15`, so routing matters) run the tests above
that say `variant` (the Hub's per-expert files transformers 5 writes, and the fused layout it holds in memory),
and: the load-balancing loss equals transformers' `aux_loss`, a LoRA step with expert adapters gives peft's
gradients (`target_parameters`), the multimodal `qwen3_5_moe` folder loads key for key.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_llama import prompts

import models
from pathlib import Path

from minitrain.objectives.sampling import sample
from minitrain.weights import load_pretrained, save_pretrained
from models.qwen3_5 import chunk_gated_delta_rule, recurrent_gated_delta_rule

REPO = Path(__file__).resolve().parents[1]
QWEN35 = dict(model_type="qwen3_5_text", num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
              linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
              initializer_range=0.15)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VARIANTS = {"dense": QWEN35, "moe": {**QWEN35, "model_type": "qwen3_5_moe_text", **EXPERTS}}


@pytest.fixture(scope="session")
def checkpoints(hf_causal, tmp_path_factory):
    """variant -> a tiny checkpoint saved by transformers; "moe_fused": the MoE one's weights in transformers'
    in-memory layout (fused 3-D `mlp.experts.gate_up_proj` / `down_proj`), which transformers loads too.

    The MoE checkpoint's decay rates A = exp(A_log) are redrawn in [0.01, 1] (transformers draws them in
    [0.01, 16]): with decays that fast the DeltaNet layers turn one-ulp differences of their input (the
    experts' sums, a packed row's chunk boundaries) into 5e-4 of some gradients, transformers' fp32 against
    its own fp64 as much as ours against it, so no two fp32 implementations meet 1e-4 there (run in fp64,
    ours and transformers' agree to 7e-9). At A <= 1: 3e-5."""
    cache = {}

    def make(variant: str):
        if variant in cache:
            return cache[variant]
        name = "qwen3_5" if variant == "dense" else f"qwen3_5_{variant}"  # "qwen3_5": the other files' key too
        src = hf_causal(name, **VARIANTS[variant]) if variant in VARIANTS else make("moe")
        if variant == "dense":
            cache[variant] = src
            return src
        cache[variant] = tmp_path_factory.mktemp(f"qwen3_5_{variant}")
        shutil.copy(src / "config.json", cache[variant] / "config.json")
        g = torch.Generator().manual_seed(0)
        if variant == "moe":
            sd = {k: torch.empty(v.shape).uniform_(0.01, 1, generator=g).log() if k.endswith("A_log") else v
                  for k, v in load_file(src / "model.safetensors").items()}
        else:
            sd = {k: v.contiguous() for k, v in load_hf(src).state_dict().items()}
        save_file(sd, cache[variant] / "model.safetensors", metadata={"format": "pt"})
        return cache[variant]

    return make


@pytest.fixture(scope="session")
def folder(checkpoints):
    return checkpoints("dense")


def load_ours(folder, chunk_size: int = 64):
    model = load_pretrained(folder, models.from_hf_config).eval()
    for m in model.modules():
        if hasattr(m, "chunk_size"):
            m.chunk_size = chunk_size
    return model


def load_hf(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def batch(T: int, padding: str, n_pad: int = 37, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    if padding == "left":
        mask[1, :n_pad] = 0
    elif padding == "right":
        mask[1, -n_pad:] = 0
    ids[mask == 0] = 0
    return ids, mask


def positions(mask):
    """Our default positions (real tokens counted from 0), given to transformers, whose default is arange."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def hidden(model, ids, mask=None, **kw):
    with torch.no_grad():
        return model(ids, mask, **kw)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("variant, chunk_size", [("dense", 64), ("dense", 16), ("moe", 16), ("moe_fused", 64)])
def test_logits_match_transformers(checkpoints, variant, chunk_size):
    """150 tokens (three of transformers' 64-token chunks; ten of ours at 16), padded left, right, not at
    all: the real tokens' logits within 1e-4 relative (the CPU runs a padded batch without its padding)."""
    folder = checkpoints(variant)
    ours, hf = load_ours(folder, chunk_size), load_hf(folder)
    for padding in ("none", "left", "right"):
        ids, mask = batch(150, padding)
        a = ours.output_projection(hidden(ours, ids, mask))
        with torch.no_grad():
            b = hf(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        real = mask.bool()
        assert rel(a[real], b[real]) <= 1e-4, padding


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_gradients_match_transformers(checkpoints, variant):
    """Every parameter's gradient (A_log, dt_bias, the convolution, the gated norm, the attention's
    gate half of q_proj; the router, experts, shared expert and its gate) equals transformers' under the
    same loss, over 100 tokens in chunks of 16."""
    folder = checkpoints(variant)
    ours, hf = load_ours(folder, 16).train(), load_hf(folder).train()
    for p in ours.parameters():
        p.requires_grad_(True)
    ids, mask = batch(100, "right", n_pad=17)
    labels = ids.masked_fill(mask == 0, -100)
    hf(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    logits = ours.output_projection(ours(ids, mask))
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()).backward()
    theirs = dict(hf.named_parameters())
    assert set(theirs) == {n for n, _ in ours.named_parameters()}
    for n, p in ours.named_parameters():
        ref = theirs[n].grad
        assert (p.grad - ref).abs().max() <= 1e-4 * ref.abs().max() + 1e-9, n


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_state_dict_keys_are_transformers_keys(checkpoints, variant):
    folder = checkpoints(variant)
    with torch.device("meta"):
        ours = models.from_hf_config(json.loads((folder / "config.json").read_text()))
    hf = load_hf(folder)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in hf.state_dict().items()}


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_greedy_generate_and_the_sampler_match_transformers(checkpoints, variant):
    """Greedy `generate` (prefill of left-padded prompts, then one token a step through the cache) equals
    transformers'; GRPO's sampler (the prompt prefilled once, its cache repeated G = 2 times, finished
    rows dropped from the cache) gives each row that continuation."""
    folder = checkpoints(variant)
    ours, hf = load_ours(folder), load_hf(folder)
    hf.generation_config.eos_token_id = None
    ids, mask = prompts()  # row 1: 7 pads then 5 real tokens
    ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    out = models.family(ours).generate(ours, ids, mask, max_new_tokens=12, eos_token_id=[], pad_token_id=0)
    assert torch.equal(out, ref)
    eos = int(ref[0, 12 + 2])  # row 0 ends at its third token: its two copies leave the batch (keep_rows)
    comp = sample(ours, ids, mask, new_cache=models.family(ours).KVCache, num_generations=2, max_new_tokens=12,
                  greedy=True, eos_ids=[eos], pad_id=0)
    assert torch.equal(comp.ids[0, :3], ref[0, 12:15]) and torch.equal(comp.ids[1, :3], ref[0, 12:15])
    assert int(comp.mask[0].sum()) == 3
    n = int(comp.mask[2].sum())  # row 1 runs on: the same tokens as transformers' until its own eos, if any
    assert torch.equal(comp.ids[2, :n], ref[1, 12:12 + n]) and torch.equal(comp.ids[3], comp.ids[2])
    assert n == 12 or int(ref[1, 12 + n - 1]) == eos


def test_chunked_rule_restarts_equal_transformers_recurrence():
    """The chunked rule over a row of three sequences (and the state carried in) equals transformers'
    token-by-token recurrence run on each sequence alone, for chunks that cut sequences and that hold
    several; so does our recurrent form."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule as reference

    torch.manual_seed(0)
    T, Hk, H, dk, dv = 90, 2, 4, 8, 6
    q, k = torch.randn(1, T, Hk, dk), torch.randn(1, T, Hk, dk)
    v, g, beta = torch.randn(1, T, H, dv), -2 * torch.rand(1, T, H), torch.rand(1, T, H)
    state = torch.randn(1, H, dk, dv)
    cuts = [0, 23, 64, 90]
    segments = torch.zeros(1, T, dtype=torch.long)
    for i, c in enumerate(cuts[1:-1]):
        segments[:, c:] = i + 1
    want, final = [], None
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        part = [t[:, a:b] for t in (q, k, v, g, beta)]
        o, final = reference(*part, initial_state=state if i == 0 else None, output_final_state=True,
                             use_qk_l2norm_in_kernel=True)
        want.append(o)
    want = torch.cat(want, 1)
    for C in (5, 16, 64):
        got, S = chunk_gated_delta_rule(q, k, v, g, beta, segments, state, chunk_size=C)
        assert rel(got, want) <= 1e-5 and rel(S, final) <= 1e-5, C
    got, S = recurrent_gated_delta_rule(*(t[:, 64:] for t in (q, k, v, g, beta)))
    assert rel(got, want[:, 64:]) <= 1e-5 and rel(S, final) <= 1e-5


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_packed_and_padded_rows_equal_each_sequence_alone(checkpoints, variant):
    """A packed row (three documents and padding, `document_ids` / `position_ids`) gives each document
    the hidden states it has alone; a left-padded row gives those of the row without its padding, on
    the CPU's unpadded path (T >= 32) and the padded one (T < 32). A state or convolution window that
    leaked one token across a boundary would change the next sequence's first tokens (by 0.77 relative, dropping the
    restart at the second document; fp32 rounding between layouts: 1e-5)."""
    ours = load_ours(checkpoints(variant), 16)
    g = torch.Generator().manual_seed(3)
    lengths = [40, 53, 27]
    seqs = [torch.randint(3, 128, (1, n), generator=g) for n in lengths]
    row = torch.cat([*seqs, torch.zeros(1, 8, dtype=torch.long)], 1)
    docs = torch.cat([torch.full((1, n), i + 1) for i, n in enumerate(lengths)] + [torch.full((1, 8), -1)], 1)
    pos = torch.cat([torch.arange(n)[None] for n in lengths] + [torch.zeros(1, 8, dtype=torch.long)], 1)
    packed = hidden(ours, row, position_ids=pos, document_ids=docs)
    start = 0
    for s, n in zip(seqs, lengths):
        assert rel(packed[:, start:start + n], hidden(ours, s)) <= 1e-4
        start += n
    for T, n_pad in ((100, 37), (20, 6)):
        ids, mask = batch(T, "left", n_pad=n_pad, seed=4)
        padded = hidden(ours, ids, mask)
        assert rel(padded[1, n_pad:], hidden(ours, ids[1:, n_pad:])[0]) <= 1e-4, T
        assert rel(padded[0], hidden(ours, ids[:1])[0]) <= 1e-4, T
    ids, mask = batch(20, "right", n_pad=6, seed=4)  # the padded path with padding after the tokens
    assert rel(hidden(ours, ids, mask)[1, :14], hidden(ours, ids[1:, :14])[0]) <= 1e-4


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_no_document_reads_another_through_rounding(checkpoints, variant):
    """A padded batch runs as one packed row on the CPU (rows of 41, 34, 48 and 37 tokens: the last row
    starts inside a 64-token chunk that the third one filled). The last row's hidden states do not move
    when the third row's tokens change, and its loss gives the other rows' embeddings no gradient. A
    cumulative log decay over the whole chunk let them do both: G_i - G_j of the last row's tokens kept the
    rounding of the decays the third row had summed (outputs moved by 1e-4, gradients 0.3% of the row's own)."""
    ours = load_ours(checkpoints(variant))
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 100, (n,), generator=g).tolist() + [2] for n in (40, 33, 47, 36)]
    T = max(map(len, rows))
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    other = ids.clone()
    other[2, :47] = torch.randint(3, 100, (47,), generator=g)
    assert hidden(ours, ids, mask)[3, :37].equal(hidden(ours, other, mask)[3, :37])
    seen = {}

    def leaf(module, args, out):
        seen["embeds"] = out.detach().requires_grad_()
        return seen["embeds"]

    hook = ours.model.embed_tokens.register_forward_hook(leaf)
    ours(ids, mask)[3, 36].square().sum().backward()
    hook.remove()
    grad = seen["embeds"].grad.abs().amax(-1)  # (B, T)
    assert float(grad[:3].max()) <= 1e-9 * float(grad[3].max()), (float(grad[:3].max()), float(grad[3].max()))


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_a_shared_prefix_row_equals_each_sequence_after_the_prefix(checkpoints, variant):
    """DPO's shared prompt / GRPO's group layout (document 0 the prefix, seen by every document): each
    document gets the hidden states of [prefix; document] run alone, the prefix those of itself alone."""
    ours = load_ours(checkpoints(variant), 16)
    g = torch.Generator().manual_seed(5)
    prefix, a, b = (torch.randint(3, 128, (1, n), generator=g) for n in (30, 25, 41))
    row = torch.cat([prefix, a, b, torch.zeros(1, 4, dtype=torch.long)], 1)
    docs = torch.tensor([[0] * 30 + [1] * 25 + [2] * 41 + [-1] * 4])
    pos = torch.tensor([list(range(30)) + list(range(30, 55)) + list(range(30, 71)) + [0] * 4])
    shared = hidden(ours, row, position_ids=pos, document_ids=docs)
    with_a, with_b = hidden(ours, torch.cat([prefix, a], 1)), hidden(ours, torch.cat([prefix, b], 1))
    assert rel(shared[:, :30], with_a[:, :30]) <= 1e-4
    assert rel(shared[:, 30:55], with_a[:, 30:]) <= 1e-4
    assert rel(shared[:, 55:96], with_b[:, 30:]) <= 1e-4


def test_a_shared_prefix_as_a_4d_mask_is_refused(folder):
    """Without document_ids, a dense mask whose second sequence sees the first one's prefix cannot say
    where the state should branch from: a ValueError that says to pass document_ids."""
    ours = load_ours(folder)
    from models.layers import document_mask

    docs = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3])
    pos = torch.tensor([list(range(9)) + list(range(5, 8))])
    with pytest.raises(ValueError, match="document_ids"):
        hidden(ours, torch.randint(3, 128, (1, 12)), document_mask(docs, pos, None), position_ids=pos)


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_saved_folder_and_config_load_in_transformers(checkpoints, variant, tmp_path):
    """`to_hf` round-trips; our `save_pretrained` loads in transformers with our logits; a checkpoint
    with the multi-token-prediction head (`mtp.*`) loads, the head left out."""
    folder = checkpoints(variant)
    ours = load_ours(folder)
    cfg = models.config_from_hf(json.loads((folder / "config.json").read_text()))
    d = json.loads(json.dumps(cfg.to_hf()))
    assert models.config_from_hf(d) == cfg
    save_pretrained(ours, tmp_path / "out", d)
    ids, mask = batch(40, "left", n_pad=9)
    a = ours.output_projection(hidden(ours, ids, mask))
    with torch.no_grad():
        b = load_hf(tmp_path / "out")(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
    assert rel(a[mask.bool()], b[mask.bool()]) <= 1e-4
    shutil.copytree(folder, tmp_path / "mtp")
    sd = load_file(folder / "model.safetensors")
    sd["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(sd, tmp_path / "mtp" / "model.safetensors", metadata={"format": "pt"})
    assert torch.equal(ours.output_projection(hidden(load_ours(tmp_path / "mtp"), ids, mask)), a)


BASE = dict(model_type="qwen3_5_text", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


MOE_BASE = {**BASE, "model_type": "qwen3_5_moe_text", **EXPERTS}


@pytest.mark.parametrize("base, config, named", [
    (BASE, {"linear_num_key_heads": 3, "linear_num_value_heads": 4}, "linear_num_value_heads"),
    (BASE, {"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
    (BASE, {"linear_key_head_dim": "128"}, "linear_key_head_dim"),
    (BASE, {"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]}, "layer_types"),
    (BASE, {"layer_types": ["full_attention"]}, "layer_types"),
    (BASE, {"linear_attention_kind": "kda"}, "linear_attention_kind"),
    (BASE, {"attn_output_gate": False}, "attn_output_gate"),
    (BASE, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}},
     "partial_rotary_factor"),
    # an expert field on a dense model; MoE fields we cannot honour (Qwen3-Next's dense layers, an
    # unrenormalised router)
    (BASE, {"num_experts": 8}, "num_experts"),
    (MOE_BASE, {"num_experts_per_tok": 5}, "num_experts_per_tok"),
    (MOE_BASE, {"moe_intermediate_size": 0}, "moe_intermediate_size"),
    (MOE_BASE, {"mlp_only_layers": [1]}, "mlp_only_layers"),
    (MOE_BASE, {"norm_topk_prob": False}, "norm_topk_prob"),
    (MOE_BASE, {"decoder_sparse_step": 2}, "decoder_sparse_step"),
])
def test_configs_we_cannot_honour_are_value_errors(base, config, named):
    with pytest.raises(ValueError, match=named) as e:
        models.from_hf_config({**base, **config})
    assert str(e.value).startswith("config.json: ") and " — " in str(e.value)


# --------------------------------------------------------------------------------------------
# Through the CLI
# --------------------------------------------------------------------------------------------

# the recipes' default list adapts the attention layer's q/k/v/o and every MLP; a DeltaNet layer's
# projections are adapted when named (its A_log, dt_bias and convolution are no Linear: never adapted)
DELTANET_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,in_proj_qkv,in_proj_z,out_proj"


@pytest.fixture(scope="module")
def cli_models(checkpoints, tmp_path_factory):
    """variant -> the checkpoint with a BPE tokenizer, for the recipes."""
    from _tok import make_bpe_tokenizer

    cache = {}

    def make(variant: str):
        if variant not in cache:
            cache[variant] = tmp_path_factory.mktemp(f"q35_cli_{variant}") / "model"
            shutil.copytree(checkpoints(variant), cache[variant])
            make_bpe_tokenizer(cache[variant])
        return cache[variant]

    return make


@pytest.fixture(scope="module")
def cli_model(cli_models):
    return cli_models("dense")


# the MoE sizes: the experts too, named as peft's `target_parameters` (the recipes' gate_proj / up_proj /
# down_proj adapt the shared expert: peft 0.21 maps no per-expert names onto Qwen3.5's experts)
TARGETS = {"dense": DELTANET_TARGETS, "moe": DELTANET_TARGETS + ",experts.gate_up_proj,experts.down_proj"}


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_lora_sft_through_the_cli_loads_in_peft(cli_models, variant, tmp_path, capsys):
    """`recipes/sft_llama.py` with LoRA on the DeltaNet projections too (and the MoE's experts): the run
    passes its preflight audit, trains 2 steps with finite losses, the decay parameters stay frozen (the
    adapter holds LoRA A / B only), and PEFT puts the saved adapter on transformers' model with our logits."""
    peft = pytest.importorskip("peft")
    cli_model = cli_models(variant)
    from _tok import corpus
    from test_families_cli import run

    from minitrain.adapters.peft_format import load_adapter

    lines = corpus(20, seed=3)
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": lines[2 * i], "completion": " " + lines[2 * i + 1]}) + "\n"
                            for i in range(8)))
    run(capsys, "sft_llama.py", cli_model, data, tmp_path / "sft", lora_targets=TARGETS[variant], max_len=80)
    adapter = tmp_path / "sft" / "adapter"
    saved = set(json.loads((adapter / "adapter_config.json").read_text())["target_modules"])
    assert {"in_proj_qkv", "in_proj_z", "out_proj", "q_proj"} <= saved
    keys = load_file(adapter / "adapter_model.safetensors")
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)
    assert any(".linear_attn.in_proj_qkv." in k for k in keys) and not any("A_log" in k or "dt_bias" in k for k in keys)
    experts = json.loads((adapter / "adapter_config.json").read_text()).get("target_parameters") or []
    assert sorted(experts) == ([] if variant == "dense" else ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"])
    assert any(".mlp.experts." in k for k in keys) == (variant == "moe")
    ours = load_pretrained(cli_model, models.from_hf_config).eval()
    load_adapter(ours, adapter)
    ref = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(cli_model), adapter).eval()
    ids = torch.randint(3, 128, (1, 90), generator=torch.Generator().manual_seed(0))
    a = ours.output_projection(hidden(ours, ids))
    with torch.no_grad():
        b = ref(input_ids=ids).logits
    assert rel(a, b) <= 1e-4


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_qlora_on_the_experts_through_the_cli(cli_models, tmp_path, capsys, kind):
    """`quantize=nf4|int8` with the experts named by path (`experts.gate_up_proj`): each expert quantized
    apart, the names reach the adapters, not the quantized weights in the parameters' places (which
    failed as "not a linear layer LoRA can wrap"); two finite steps, every expert pair trained."""
    pytest.importorskip("bitsandbytes")
    from test_families_cli import run

    from _tok import corpus

    lines = corpus(20, seed=3)
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": lines[2 * i], "completion": " " + lines[2 * i + 1]}) + "\n"
                            for i in range(8)))
    run(capsys, "sft_llama.py", cli_models("moe"), data, tmp_path / "sft", lora_targets=TARGETS["moe"],
        quantize=kind, lr=1e-2)
    keys = load_file(tmp_path / "sft" / "adapter" / "adapter_model.safetensors")
    b = [t for k, t in keys.items() if ".mlp.experts." in k and "lora_B" in k]
    assert len(b) == 2 * 4 and all(float(t.abs().max()) > 1e-4 for t in b)


def test_a_linear_attention_config_we_do_not_understand_is_one_line(cli_model, tmp_path, capsys):
    """Through the CLI: exit 2, one `error:` line naming the field, nothing written."""
    from minitrain.cli import run_cli

    bad = tmp_path / "bad"
    shutil.copytree(cli_model, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "linear_num_key_heads": 3}))
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "a b", "completion": " c d"}) + "\n")
    keys = {"model": bad, "data": data, "eval_data": "", "out": tmp_path / "out", "max_steps": 1}
    code = run_cli([str(REPO / "recipes" / "sft_llama.py")] + [f"{k}={v}" for k, v in keys.items()])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and "linear_num_value_heads" in err[0], err
    assert not (tmp_path / "out").exists()


def test_flex_attention_on_packed_rows_equals_sdpa(folder):
    """`attention=flex` applies to Qwen3.5: the attention layers read the block mask, the DeltaNet layers
    find the sequence starts from its rule; packed rows and a shared prefix give SDPA's hidden states
    (forward only: a CPU's FlexAttention has no backward, which the engine refuses with one line)."""
    ours = load_ours(folder, 16)
    g = torch.Generator().manual_seed(6)
    row = torch.randint(3, 128, (1, 60), generator=g)
    for docs in ([1] * 20 + [2] * 32 + [-1] * 8, [0] * 20 + [1] * 32 + [2] * 8):
        docs = torch.tensor([docs])
        pos = torch.tensor([list(range(20)) + list(range(32)) + [0] * 8])
        if docs[0, 0] == 0:
            pos = torch.tensor([list(range(52)) + list(range(20, 28))])
        want = hidden(ours, row, position_ids=pos, document_ids=docs)
        ours.packed_attention = "flex"
        got = hidden(ours, row, position_ids=pos, document_ids=docs)
        ours.packed_attention = "sdpa"
        real = docs[0] >= 0
        assert rel(got[:, real], want[:, real]) <= 1e-5


# --------------------------------------------------------------------------------------------
# The MoE sizes: the routing's loss terms, LoRA on the experts
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [24, 40])
def test_load_balancing_loss_matches_transformers(checkpoints, tmp_path, T):
    """tests/test_moe.py's check: with `output_router_logits` on, the SFT objective's loss per token is
    transformers' training loss (cross-entropy + router_aux_loss_coef x its `aux_loss`) and the logged
    `aux_loss` is transformers', on a right-padded batch routed with its padding (T = 24) and without it
    (T = 40, the CPU's unpadded path); each layer's expert load is logged."""
    from test_moe import check_load_balancing_loss

    metrics = check_load_balancing_loss(checkpoints("moe"), tmp_path, T)
    loads = {k: v for k, v in metrics.items() if k.startswith("expert_load/")}
    assert sorted(loads) == [f"expert_load/{i}" for i in range(4)] and all(1 / 4 <= v <= 1 for v in loads.values())


def test_a_lora_step_on_the_experts_gives_peft_gradients(checkpoints, tmp_path):
    """A peft adapter (A and B random; `target_modules` an attention, a DeltaNet and a shared-expert linear,
    `target_parameters` the experts' 3-D weights) loaded onto our model: one step's loss equals peft's on
    transformers' model, and so does every adapter gradient, compared in peft's saved layout (each
    gradient written where its tensor is: ours by `save_adapter`, theirs by `save_pretrained`)."""
    peft = pytest.importorskip("peft")
    from minitrain.adapters.lora import freeze_for_adapters
    from minitrain.adapters.peft_format import load_adapter, save_adapter

    folder = checkpoints("moe")
    torch.manual_seed(2)
    theirs = peft.get_peft_model(load_hf(folder), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "in_proj_qkv", "shared_expert.down_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], init_lora_weights=False))
    theirs.save_pretrained(tmp_path / "adapter")
    ours = load_ours(folder, 16).train()
    freeze_for_adapters(ours, load_adapter(ours, tmp_path / "adapter", trainable=True))
    ids, mask = batch(100, "right", n_pad=17)
    labels = ids.masked_fill(mask == 0, -100)
    ref = theirs.train()(input_ids=ids, attention_mask=mask, labels=labels).loss
    ref.backward()
    logits = ours.output_projection(ours(ids, mask))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    loss.backward()
    assert abs(float(loss) - float(ref)) <= 1e-5 * float(ref)
    save_adapter(ours, tmp_path / "ours", state={n: p.grad for n, p in ours.named_parameters() if p.requires_grad})
    with torch.no_grad():
        for p in theirs.parameters():
            if p.requires_grad:
                p.copy_(p.grad)
    theirs.save_pretrained(tmp_path / "theirs")
    a, b = load_file(tmp_path / "ours" / "adapter_model.safetensors"), load_file(tmp_path / "theirs" / "adapter_model.safetensors")
    assert set(a) == set(b) and sum(".mlp.experts." in k for k in b) == 4 * 4  # 4 layers x 2 projections x (A, B)
    for k, want in b.items():
        assert (a[k] - want).abs().max() <= 1e-4 * want.abs().max() + 1e-9, k


# --------------------------------------------------------------------------------------------
# The multimodal checkpoint (Qwen3_5ForConditionalGeneration): its language model
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def multimodal_checkpoints(tmp_path_factory):
    """variant -> a tiny `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration` saved by
    transformers: a one-block vision tower beside the language model of `VARIANTS[variant]` (the MoE one
    without an `intermediate_size`), norms perturbed as `save_hf_causal` does."""
    cache = {}

    def make(variant: str):
        if variant in cache:
            return cache[variant]
        moe = variant == "moe"
        text = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                    **{k: v for k, v in VARIANTS[variant].items() if k not in ("model_type", "num_hidden_layers")},
                    **({} if moe else {"intermediate_size": 128}), bos_token_id=1, eos_token_id=2, pad_token_id=0)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                      temporal_patch_size=2, num_position_embeddings=16)
        cfg = (transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config)(
            text_config=text, vision_config=vision, image_token_id=120, video_token_id=121, vision_start_token_id=122,
            vision_end_token_id=123)
        torch.manual_seed(0)
        model = transformers.AutoModelForImageTextToText.from_config(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.1 * torch.randn_like(p))
        cache[variant] = tmp_path_factory.mktemp(f"qwen3_5_multimodal_{variant}")
        model.save_pretrained(cache[variant])
        return cache[variant]

    return make


@pytest.fixture(scope="session")
def multimodal(multimodal_checkpoints):
    return multimodal_checkpoints("dense")


def load_multimodal(folder):
    return transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_multimodal_checkpoint_loads_key_for_key(multimodal_checkpoints, variant, monkeypatch):
    """Text logits equal the multimodal class's (left padding); every tensor is read once (the language
    model's, the MoE's per-expert tensors under `model.language_model.`, lm_head and the vision tower's, which
    tests/test_qwen3_5_vl.py runs on images); `to_hf` gives back the multimodal config."""
    import minitrain.weights as weights

    multimodal = multimodal_checkpoints(variant)
    read = []
    real_read = weights.read_tensor
    monkeypatch.setattr(weights, "read_tensor", lambda *a: read.append(a[-1]) or real_read(*a))
    ours = load_ours(multimodal)
    names = set(ours.state_dict())
    assert all(k.startswith(("model.language_model.", "model.visual.", "lm_head.")) for k in names)
    assert any(k.startswith("model.visual.") for k in names)
    stored = list(load_file(multimodal / "model.safetensors"))
    assert len(read) == len(stored) >= len(names)  # one read per tensor (the MoE's experts: several per parameter)
    ids, mask = batch(90, "left", n_pad=9)
    a = ours.output_projection(hidden(ours, ids, mask))
    with torch.no_grad():
        b = load_multimodal(multimodal)(input_ids=ids, attention_mask=mask).logits
    assert rel(a[mask.bool()], b[mask.bool()]) <= 1e-4
    config = json.loads((multimodal / "config.json").read_text())
    cfg = models.config_from_hf(config)
    assert cfg.model_type == config["model_type"] == {"dense": "qwen3_5", "moe": "qwen3_5_moe"}[variant]
    assert models.config_from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg
    assert cfg.to_hf()["vision_config"] == config["vision_config"]
    if variant == "moe":  # the routing of a training forward, read through the multimodal body
        ours.train()(ids, mask)
        _, metrics = ours.router_aux_loss(mask)
        assert sorted(k for k in metrics if k.startswith("expert_load/")) == [f"expert_load/{i}" for i in range(4)]


def test_multimodal_lora_adapter_loads_in_peft_on_the_multimodal_class(multimodal, tmp_path):
    """A LoRA adapter trained on the language model (attention, MLP and DeltaNet projections) has the keys
    peft writes on transformers' multimodal class: `PeftModel.from_pretrained` on
    `AutoModelForImageTextToText` loads it with our text logits."""
    peft = pytest.importorskip("peft")
    from minitrain.adapters.lora import LoRAConfig, apply_lora
    from minitrain.adapters.peft_format import save_adapter

    ours = load_ours(multimodal)
    cfg = LoRAConfig(r=4, alpha=8, targets=tuple(DELTANET_TARGETS.split(",")))
    apply_lora(ours, cfg)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    save_adapter(ours, tmp_path / "adapter", cfg)
    keys = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.language_model.layers.0.linear_attn.in_proj_qkv.lora_A.weight" in keys
    ref = peft.PeftModel.from_pretrained(load_multimodal(multimodal), tmp_path / "adapter").eval()
    ids, mask = batch(70, "none")
    with torch.no_grad():
        b = ref(input_ids=ids, attention_mask=mask).logits
    a = ours.output_projection(hidden(ours.eval(), ids, mask))
    assert rel(a, b) <= 1e-4
    # minitrain merge folds it in: the towers come back bit for bit, transformers loads the multimodal class
    from minitrain.commands import merge as tool

    tool.merge(str(multimodal), str(tmp_path / "adapter"), str(tmp_path / "merged"), dtype="float32")
    before, after = load_file(multimodal / "model.safetensors"), load_file(tmp_path / "merged" / "model.safetensors")
    assert set(after) == set(before)
    assert all(torch.equal(after[k], before[k]) for k in before if k.startswith("model.visual."))
    with torch.no_grad():
        merged = load_multimodal(tmp_path / "merged")(input_ids=ids, attention_mask=mask).logits
    assert rel(merged, a) <= 1e-4


def test_dpo_shared_prompt_and_packed_sft_through_the_cli(cli_model, tmp_path, capsys):
    """DPO's shared-prompt rows ([prompt, chosen, rejected], the prompt seen by both answers) run each
    answer after the prompt: step 1's metrics equal those of `[chosen; rejected]` rows. SFT with
    `packing=true` (documents restart the state) trains with the padded run's first-step loss."""
    from _tok import corpus
    from test_families_cli import run

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
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": lines[2 * i], "completion": " " + lines[2 * i + 1]}) + "\n"
                           for i in range(8)))
    padded = run(capsys, "sft_llama.py", cli_model, sft, tmp_path / "padded")
    packed = run(capsys, "sft_llama.py", cli_model, sft, tmp_path / "packed", packing="true")
    assert packed[0]["loss"] == pytest.approx(padded[0]["loss"], rel=1e-4)


@pytest.mark.parametrize("parallel", ["none", "fsdp"])
def test_full_fine_tuning_a_multimodal_checkpoint_keeps_its_towers(multimodal, tmp_path, capsys, parallel):
    """`finetune=full` through the CLI on the multimodal folder, in one process and under torchrun with
    `parallel=fsdp` on 2 ranks (its sharded save, one file at a time; cut after step 1 and finished with
    resume=true, the ranks' collective sequences equal in both launches): on text rows the tower stays frozen
    (no loss reaches it), so the written folder holds every vision tower tensor bit-identical to the input, a
    trained language model, and loads in transformers as the multimodal class with our text logits."""
    from _tok import corpus, make_bpe_tokenizer

    model = tmp_path / "model"
    shutil.copytree(multimodal, model)
    make_bpe_tokenizer(model)
    lines = corpus(20, seed=3)
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": lines[2 * i], "completion": " " + lines[2 * i + 1]}) + "\n"
                            for i in range(8)))
    from minitrain.cli import run_cli

    keys = {"model": model, "data": data, "eval_data": "", "out": tmp_path / "out", "max_steps": 2, "batch_size": 2,
            "max_len": 64, "finetune": "full", "lr": 1e-3}
    args = [str(REPO / "recipes" / "sft_llama.py")] + [f"{k}={v}" for k, v in keys.items()]
    if parallel == "fsdp":
        from test_torchrun_resume import launch

        args += ["parallel=fsdp", "device=cpu", "save_every=1"]
        launch(2, [*args, "stop_after=1"])
        resumed = launch(2, [*args, "resume=true"])
        assert "resumed from" in resumed.stdout + resumed.stderr
        steps = [json.loads(x)["step"] for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2]
    else:
        assert run_cli(args) == 0, capsys.readouterr().err
    written = next(p.parent for p in (tmp_path / "out").rglob("config.json") if p.parent.name == "model")
    before = load_file(model / "model.safetensors")
    after = {k: v for f in sorted(written.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert set(after) == set(before)
    towers = [k for k in before if k.startswith("model.visual.")]
    assert towers and all(after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in towers)
    assert not torch.equal(after["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"],
                           before["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"])
    ids, mask = batch(40, "none")
    with torch.no_grad():
        b = load_multimodal(written)(input_ids=ids, attention_mask=mask).logits
    ours = load_ours(written)
    assert rel(ours.output_projection(hidden(ours, ids, mask)), b) <= 1e-4


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_activation_checkpointing_gives_the_same_gradients(checkpoints, variant):
    """The engine's per-block non-reentrant checkpointing (`enable_checkpointing`) recomputes each
    block, DeltaNet layers included, on a padded batch: the same gradients as without it."""
    from minitrain.train import enable_checkpointing

    ids, mask = batch(70, "left", n_pad=11)
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for setting in (False, True):
        model = load_ours(checkpoints(variant), 16).train()
        for p in model.parameters():
            p.requires_grad_(True)
        if setting:
            assert enable_checkpointing(model, True) == 4
        logits = model.output_projection(model(ids, mask))
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n, g in grads[0].items():
        assert torch.allclose(grads[1][n], g, rtol=1e-5, atol=1e-7), n


def test_grpo_through_the_cli(cli_model, tmp_path, capsys, monkeypatch):
    """`recipes/grpo_qwen.py` on the demo's prompts: the sampler decodes through the hybrid cache (prompts
    prefilled once, repeated G times) and the log-probabilities run on GRPO's shared-prompt rows; two
    steps with finite losses."""
    from minitrain.cli import run_cli
    from models.qwen3_5 import Qwen3_5Model

    shared = []
    real = Qwen3_5Model._forward_block_mask

    def spy(self, x, mask, position_ids, document_ids, *rest, **kw):
        shared.append(document_ids is not None and bool((document_ids == 0).any()))
        return real(self, x, mask, position_ids, document_ids, *rest, **kw)

    monkeypatch.setattr(Qwen3_5Model, "_forward_block_mask", spy)
    demo = REPO / "demo" / "grpo"
    args = [f"model={cli_model}", f"data={demo / 'train.jsonl'}", f"out={tmp_path / 'out'}", "max_steps=2",
            "batch_size=2", "num_generations=4", "max_completion_length=8", "max_len=48", "lora_r=4", "lora_alpha=8",
            "grad_accum=1", "eval_data=", "log_every=1"]
    assert run_cli([str(REPO / "recipes" / "grpo_qwen.py"), *args]) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 2 and all(abs(x) < 1e6 for x in losses)
    assert any(shared)  # the group layout ran (a prompt shared by its completions)


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_compiled_blocks_give_the_same_gradients(checkpoints, variant):
    """`compile=true` (`compile_blocks`, here with dynamo's eager backend): the DeltaNet layers' scan runs
    outside the graph (a loop over chunks), the rest of each block inside; the same loss and gradients."""
    from minitrain.train import compile_blocks

    ids, mask = batch(70, "right", n_pad=11)
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for compiled in (False, True):
        model = load_ours(checkpoints(variant), 16).train()
        for p in model.parameters():
            p.requires_grad_(True)
        if compiled:
            compile_blocks(model, backend="eager")
        logits = model.output_projection(model(ids, mask))
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n, g in grads[0].items():
        assert torch.allclose(grads[1][n], g, rtol=1e-5, atol=1e-7), n
