"""Rows of several sequences through FlexAttention (`packed_attention="flex"`, `models.layers.Documents`).

Forward only: torch's FlexAttention has no backward on a CPU (tests/test_cuda.py checks forward and
backward under torch.compile on a GPU). References: each sequence run alone (after its row's shared
prefix), with no mask at all, and the dense-mask SDPA path; fp32. Every decoder family: LLaMA with
GQA and a sliding window shorter than the sequences (Mistral), Qwen2 mixing full and windowed
layers, Gemma 2 (score soft-cap as flex's score_mod), Gemma 3, Phi-3 with a window. Layouts: SFT
packing, DPO's shared prompt, GRPO's shared-prompt layout.
"""

from __future__ import annotations

import pytest
import torch

import models
from minitrain.config import TrainConfig
from minitrain.data.packing import collate_packed_causal
from minitrain.device import resolve_attention, set_attention
from minitrain.errors import UserError
from minitrain.objectives.dpo import collate_shared_prompt
from minitrain.objectives.grpo import shared_prompt_layout
from minitrain.objectives.sft import sft
from minitrain.train import compile_blocks
from models.layers import document_mask

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, pad_token_id=0)
VARIANTS = {
    "mistral_gqa_window": dict(model_type="mistral", sliding_window=3),
    "qwen2_mixed_window": dict(model_type="qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "gemma2_capped": dict(model_type="gemma2", head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                          attn_logit_softcapping=0.5, final_logit_softcapping=None),
    "gemma3": dict(model_type="gemma3_text", head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                   layer_types=["sliding_attention", "full_attention"]),
    "phi3_window": dict(model_type="phi3", sliding_window=4),
}
LENGTHS = (5, 9, 3, 7, 6, 2)
TOL = dict(atol=1e-5, rtol=1e-5)


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = models.from_hf_config({**TINY, **VARIANTS[name]}).eval()
    with torch.no_grad():  # norms away from their init, so every weight matters
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.2 * torch.randn_like(p))
    return model


def examples(lengths=LENGTHS, seed=1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, 128, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": ids})
    return out


def hidden(model, batch, kind: str, dense: bool = False) -> torch.Tensor:
    """The model's hidden states of rows of several sequences through `kind`, from the document ids
    (with `dense`: the 4-D bool mask those ids make, `document_mask`, given as attention_mask)."""
    model.packed_attention = kind
    mask = document_mask(batch["document_ids"], batch["position_ids"], None) if dense else None
    with torch.no_grad():
        return model(batch["input_ids"], mask, position_ids=batch["position_ids"], document_ids=batch["document_ids"])


def alone(model, batch) -> torch.Tensor:
    """Each sequence of each row run by itself (a row's shared prefix, document 0, then the sequence's
    tokens, in row order), its hidden states put back where the row holds it (0 on padding). What the
    layout means, computed with no mask at all."""
    out = torch.zeros(*batch["input_ids"].shape, model.config.hidden_size)
    for b, docs in enumerate(batch["document_ids"]):
        for d in docs.unique().tolist():
            if d < 1:
                continue
            cols = ((docs == d) | (docs == 0)).nonzero().squeeze(1)
            with torch.no_grad():
                out[b, cols] = model(batch["input_ids"][b, cols][None])[0]
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_packed_rows_flex_equal_dense_mask_and_each_sequence_alone(name):
    model = build(name)
    batch = collate_packed_causal(examples(), pad_id=0, max_len=14)
    assert batch["input_ids"].shape[0] > 1 and (batch["sequence_ids"] < 0).any()  # several rows, some padding
    real = batch["attention_mask"].bool()
    ref = alone(model, batch)
    sdpa = hidden(model, batch, "sdpa")
    flex = hidden(model, batch, "flex")
    torch.testing.assert_close(sdpa[real], ref[real], **TOL)
    torch.testing.assert_close(flex[real], ref[real], **TOL)
    torch.testing.assert_close(flex[real], sdpa[real], **TOL)
    # a caller's 4-D mask (the contract's other spelling) is the same attention
    torch.testing.assert_close(hidden(model, batch, "sdpa", dense=True)[real], sdpa[real], atol=0, rtol=0)
    # and a loss through the engine's objective (causal_hidden passes the ids)
    with torch.no_grad():
        model.packed_attention = "sdpa"
        loss_sdpa, n_sdpa, _ = sft(model, batch)
        model.packed_attention = "flex"
        loss_flex, n_flex, _ = sft(model, batch)
    assert n_flex == n_sdpa
    torch.testing.assert_close(loss_flex, loss_sdpa, **TOL)


def test_a_leaking_block_mask_fails_the_comparison():
    """The parity above can fail: documents merged into one per row (every token sees the earlier
    sequences of its row), or a window one wider than the model's, move the hidden states far off."""
    model = build("mistral_gqa_window")
    batch = collate_packed_causal(examples(), pad_id=0, max_len=14)
    real = batch["attention_mask"].bool()
    ref = alone(model, batch)
    leaking = {**batch, "document_ids": batch["document_ids"].clamp(max=1)}  # 1 on every real token
    assert (hidden(model, leaking, "flex")[real] - ref[real]).abs().max() > 1e-2
    model.model.windows = [4] * len(model.model.windows)
    assert (hidden(model, batch, "flex")[real] - ref[real]).abs().max() > 1e-2


def test_gemma2_score_cap_bites_in_flex():
    """flex's score_mod is the soft-cap: without it the outputs differ (so the parity test checks it)."""
    model = build("gemma2_capped")
    batch = collate_packed_causal(examples(), pad_id=0, max_len=14)
    real = batch["attention_mask"].bool()
    capped = hidden(model, batch, "flex")
    for layer in model.model.layers:
        layer.self_attn.cap = None
    assert (hidden(model, batch, "flex")[real] - capped[real]).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["qwen2_mixed_window", "gemma2_capped"])
def test_shared_prompt_layouts_flex_equal_dense_mask_and_each_sequence_alone(name):
    """DPO's [prefix, chosen, rejected] rows and GRPO's [prompt, completions] rows (document 0 the
    shared prefix): flex, SDPA and each answer run after its prompt alone agree on every real token."""
    model = build(name)
    g = torch.Generator().manual_seed(2)

    def ids(n):
        return torch.randint(3, 128, (n,), generator=g).tolist()

    pairs = []
    for p, c, r in ((6, 4, 5), (3, 7, 2), (5, 1, 3)):
        prompt = ids(p)
        chosen, rejected = prompt + ids(c), prompt + ids(r)
        pairs.append({"chosen_ids": chosen, "rejected_ids": rejected, "chosen_labels": chosen,
                      "rejected_labels": rejected})
    dpo = collate_shared_prompt(pairs, pad_id=0)

    G, P, C = 3, 6, 5
    prompt_ids = torch.randint(3, 128, (2, P), generator=g).repeat_interleave(G, 0)
    prompt_mask = torch.ones(2 * G, P, dtype=torch.long)
    prompt_mask[G:, :2] = 0  # the second group's prompt is left-padded
    completion_ids = torch.randint(3, 128, (2 * G, C), generator=g)
    completion_mask = (torch.arange(C)[None] < torch.tensor([5, 2, 4, 3, 5, 1])[:, None]).long()
    layout = shared_prompt_layout(prompt_ids, prompt_mask, completion_mask, G)
    assert layout is not None
    flat = torch.cat([prompt_ids, completion_ids], 1).reshape(-1)
    grpo = {"input_ids": flat[layout["rows"]], "position_ids": layout["position_ids"],
            "document_ids": layout["document_ids"]}

    for batch in (dpo, grpo):
        real = batch["document_ids"] >= 0
        assert (real.sum(1) < real.shape[1]).any()  # some padding
        ref = alone(model, batch)
        torch.testing.assert_close(hidden(model, batch, "sdpa")[real], ref[real], **TOL)
        torch.testing.assert_close(hidden(model, batch, "flex")[real], ref[real], **TOL)


def test_attention_setting_on_cpu():
    """auto is sdpa on a CPU; flex there is refused (no backward), as for a family without the path."""
    model = build("mistral_gqa_window")
    cpu = torch.device("cpu")
    assert resolve_attention("auto", model, cpu, compiled=False) == "sdpa"
    assert resolve_attention("sdpa", model, cpu, compiled=False) == "sdpa"
    with pytest.raises(UserError, match="attention=flex: torch's FlexAttention has no backward on cpu"):
        resolve_attention("flex", model, cpu, compiled=False)
    with pytest.raises(UserError, match="no FlexAttention path"):
        resolve_attention("flex", torch.nn.Linear(2, 2), torch.device("cuda"), compiled=True)
    assert resolve_attention("auto", torch.nn.Linear(2, 2), torch.device("cuda"), compiled=True) == "sdpa"
    with pytest.raises(ValueError, match="packed_attention='nope'"):
        model.packed_attention = "nope"
    model.packed_attention = "flex"
    with pytest.raises(ValueError, match="needs document_ids"):  # a 4-D mask alone says no documents
        model(torch.ones(1, 4, dtype=torch.long), torch.ones(1, 1, 4, 4, dtype=torch.bool),
              position_ids=torch.arange(4)[None])
    assert resolve_attention("auto", model, torch.device("cuda"), compiled=True) == "flex"
    assert resolve_attention("auto", model, torch.device("cuda"), compiled=False) == "sdpa"
    # what train() does with the config: the model's switch follows `attention=`
    set_attention(TrainConfig(), model, cpu)
    assert model.packed_attention == "sdpa"
    with pytest.raises(UserError, match="attention=flex"):
        set_attention(TrainConfig(attention="flex"), model, cpu)


def test_compiled_blocks_take_each_batchs_block_mask_without_recompiling():
    """Each forward builds new `Documents` (a new mask_mod closing over new ids): compiled blocks take
    them as inputs, not as constants, so a new batch of the same shape runs the graphs already built,
    with its own layout (values equal each sequence alone). Dynamo with the aot_eager backend (no C++
    build; forward only, as on any CPU); tests/test_cuda.py runs inductor's kernels with a backward."""
    torch._dynamo.reset()
    model = build("qwen2_mixed_window")  # two windows: two block masks a forward
    compile_blocks(model, backend="aot_eager")
    first = collate_packed_causal(examples(seed=1), pad_id=0, max_len=14)
    second = collate_packed_causal(examples((6, 9, 3, 7, 5, 2), seed=5), pad_id=0, max_len=14)
    assert first["input_ids"].shape == second["input_ids"].shape
    assert not torch.equal(first["document_ids"], second["document_ids"])
    hidden(model, first, "flex")
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            out = hidden(model, second, "flex")
    finally:
        torch._dynamo.reset()
    real = second["attention_mask"].bool()
    torch.testing.assert_close(out[real], alone(model, second)[real], **TOL)


def test_flex_under_bf16_autocast_follows_sdpa():
    """Under autocast an fp32 residual stream rotates q / k in fp32 while v comes out of its linear in
    bf16: flex gets them in the autocast dtype, as SDPA does, and stays within bf16 rounding of it."""
    model = build("gemma2_capped")
    batch = collate_packed_causal(examples(), pad_id=0, max_len=14)
    real = batch["attention_mask"].bool()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sdpa = hidden(model, batch, "sdpa").float()
        flex = hidden(model, batch, "flex").float()
    torch.testing.assert_close(flex[real], sdpa[real], atol=5e-2, rtol=5e-2)
    assert (flex[real] - hidden(model, batch, "flex")[real]).abs().max() > 1e-4  # autocast did round
