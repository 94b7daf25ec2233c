"""The gradient-path audit: each planted failure is detected and named; no false alarms.

Planted failures (issue "gradient-path audit"): (a) reentrant checkpointing over frozen embeddings,
(b) a loss built from detached logits, (c) an adapter loaded without trainable=True, (d) a trainable
tensor missing from the optimizer, (e) a layer wrapped twice by hand, (f) a forward section under
no_grad. Healthy cases: LoRA at init (B == 0), QLoRA over a quantized base, T5.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import models
from minitrain.adapters.lora import LoRAConfig, LoRALinear, apply_lora, freeze_for_adapters
from minitrain.adapters.peft_format import load_adapter, save_adapter
from minitrain.audit import UNREACHABLE, ZERO_AT_INIT, audit, preflight
from minitrain.errors import UserError
from minitrain.objectives.losses import chunked_cross_entropy_sum, shift_labels
from minitrain.objectives.sft import seq2seq, sft
from minitrain.train import enable_checkpointing
from minitrain.weights import load_pretrained

CFG = LoRAConfig(r=4, alpha=8, targets=("q_proj", "v_proj"))


def _batch(vocab: int = 128, b: int = 2, t: int = 12) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (b, t), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100  # prompt tokens
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


@pytest.fixture
def lora_model(hf_causal):
    model = load_pretrained(hf_causal("audit_llama"), models.from_hf_config)
    apply_lora(model, CFG)
    freeze_for_adapters(model, CFG)
    return model


def test_healthy_lora_at_init_is_not_a_false_alarm(lora_model):
    opt = torch.optim.AdamW([p for p in lora_model.parameters() if p.requires_grad])
    before = {n: p.detach().clone() for n, p in lora_model.named_parameters()}
    report = audit(lora_model, sft, _batch(), optimizer=opt)
    assert report.ok, report.table()
    a = [t for t in report.tensors if ".lora_A." in t.name]
    b = [t for t in report.tensors if ".lora_B." in t.name]
    # B == 0 at init makes A's gradient exactly zero: recognised and confirmed by the probe
    assert a and all(t.status == ZERO_AT_INIT for t in a)
    assert b and all(t.status == "ok" and t.grad_norm > 0 for t in b)
    assert "healthy" in report.verdict()
    # the audit leaves no trace: parameters unchanged (the probe restored B) and no grads left
    for n, p in lora_model.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.grad is None
    assert set(report.layer_norms) == {"model.layers.0", "model.layers.1"}
    assert "healthy" in report.table() and '"ok": true' in report.to_json()


def test_healthy_with_nonzero_B_reports_norms_against_autograd(lora_model):
    with torch.no_grad():
        for m in lora_model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.normal_(0, 0.02)
    report = audit(lora_model, sft, _batch())
    assert report.ok
    # reference: the same loss by hand, autograd's gradient norms
    batch = _batch()
    loss_sum, count, _ = sft(lora_model, batch)
    (loss_sum / count).backward()
    for t in report.tensors:
        p = dict(lora_model.named_parameters())[t.name]
        assert t.grad_norm == pytest.approx(float(p.grad.norm()), rel=1e-5)


def test_a_reentrant_checkpointing_over_frozen_embeddings(lora_model):
    for block in lora_model.modules():
        if isinstance(block, lora_model.block_types):
            inner = block.forward

            def forward(*args, _inner=inner, **kwargs):  # what `use_reentrant=True` users wrote
                return checkpoint(lambda *a: _inner(*a, **kwargs), *args, use_reentrant=True)

            block.forward = forward
    # this is the field reports' crash: the loss has no graph at all
    loss_sum, count, _ = sft(lora_model, _batch())
    with pytest.raises(RuntimeError, match="does not require grad"):
        loss_sum.backward()
    report = audit(lora_model, sft, _batch())
    assert not report.ok
    assert "no grad_fn" in report.problems[0]
    assert "reentrant" in report.problems[0] and "model.layers.0" in report.problems[0]
    assert all(t.status == UNREACHABLE for t in report.tensors)


@pytest.mark.parametrize("setting", [True, 1])
def test_non_reentrant_checkpointing_is_healthy(lora_model, setting):
    assert enable_checkpointing(lora_model, setting) == (2 if setting is True else 1)  # all, or the first block
    assert audit(lora_model, sft, _batch()).ok


def test_b_loss_from_detached_logits(lora_model):
    def detached(model, batch):
        hidden = model(batch["input_ids"], batch["attention_mask"]).detach()
        return (*chunked_cross_entropy_sum(hidden, model.output_projection, shift_labels(batch["labels"])), {})

    report = audit(lora_model, detached, _batch())
    assert not report.ok
    assert "no grad_fn" in report.problems[0] and "detach" in report.problems[0]


def test_c_adapter_loaded_without_trainable(lora_model, hf_causal, tmp_path):
    save_adapter(lora_model, tmp_path / "adapter", CFG)
    fresh = load_pretrained(hf_causal("audit_llama"), models.from_hf_config)
    load_adapter(fresh, tmp_path / "adapter")  # trainable defaults to False (rule 4)
    report = audit(fresh, sft, _batch())
    assert not report.ok
    assert "adapter is frozen" in report.problems[0] and "trainable=True" in report.problems[0]


def test_d_trainable_tensor_missing_from_optimizer(lora_model):
    only_b = [p for n, p in lora_model.named_parameters() if p.requires_grad and ".lora_B." in n]
    report = audit(lora_model, sft, _batch(), optimizer=torch.optim.AdamW(only_b))
    assert not report.ok
    assert "not in the optimizer" in report.problems[0] and ".lora_A." in report.problems[0]


def test_e_layer_wrapped_twice_by_hand(lora_model):
    attn = lora_model.model.layers[1].self_attn
    inner = attn.q_proj

    class HandLoRA(torch.nn.Module):
        """A PEFT-style wrapper someone added by hand around an already adapted layer: it keeps
        the inner layer as `base_layer` but computes the base product from the weight itself."""

        def __init__(self, base):
            super().__init__()
            self.base_layer = base
            self.weight = base.weight
            self.lora_A = torch.nn.Linear(base.in_features, 4, bias=False)
            self.lora_B = torch.nn.Linear(4, base.out_features, bias=False)
            torch.nn.init.normal_(self.lora_B.weight, std=0.02)

        def forward(self, x):
            return F.linear(x, self.weight) + self.lora_B(self.lora_A(x))

    attn.q_proj = HandLoRA(inner)
    report = audit(lora_model, sft, _batch())
    assert not report.ok
    assert any("wrapped twice" in p and "model.layers.1.self_attn.q_proj" in p for p in report.problems)
    dead = [t for t in report.tensors if t.status == UNREACHABLE]
    assert {t.module for t in dead} == {"model.layers.1.self_attn.q_proj.base_layer"}
    assert any("never ran" in p for p in report.problems)


def test_f_forward_section_under_no_grad(lora_model):
    block = lora_model.model.layers[0]
    inner = block.forward

    def forward(*args, **kwargs):
        with torch.no_grad():
            return inner(*args, **kwargs)

    block.forward = forward
    report = audit(lora_model, sft, _batch())
    assert not report.ok
    problem = report.problems[0]
    assert "unreachable" in problem and "model.layers.0." in problem
    assert "no_grad" in problem and "reentrant" not in problem
    # layer 1 still trains: only layer 0's tensors are cut
    dead = {t.name for t in report.tensors if t.status == UNREACHABLE}
    assert dead and all(n.startswith("model.layers.0.") for n in dead)


def test_preflight_stops_with_one_line_error(lora_model):
    lines: list[str] = []
    only_b = [p for n, p in lora_model.named_parameters() if p.requires_grad and ".lora_B." in n]
    with pytest.raises(UserError, match="gradient-path audit before step 1: .* skip_audit=true"):
        preflight(lora_model, sft, _batch(), optimizer=torch.optim.AdamW(only_b), log=lines.append)
    assert "problem:" in lines[0] and "BROKEN" in lines[0]


def test_qlora_over_quantized_base_is_healthy(hf_causal):
    pytest.importorskip("bitsandbytes")
    from minitrain.adapters.quant import quantize_hook

    model = load_pretrained(hf_causal("audit_llama"), models.from_hf_config,
                            tensor_hook=quantize_hook("nf4", compute_dtype=torch.float32))
    apply_lora(model, CFG)
    freeze_for_adapters(model, CFG)
    report = audit(model, sft, _batch())
    assert report.ok, report.table()
    assert report.quantized, "the nf4 base tensors are listed as quantized"


def test_t5_is_healthy(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0))
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, models.from_hf_config)
    cfg = LoRAConfig(r=4, alpha=8, targets=("q", "v", "wi_0", "wo"))
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    b = _batch()
    batch = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"], "labels": b["input_ids"][:, :6]}
    report = audit(model, seq2seq, batch)
    assert report.ok, report.table()
    assert any(k.startswith("encoder.block.") for k in report.layer_norms)
    assert any(k.startswith("decoder.block.") for k in report.layer_norms)


def test_train_runs_the_preflight_and_stops_a_broken_run(lora_model, tmp_path):
    """train() audits before step 1: a broken path stops the run (exit-2 error) before any step,
    and skip_audit=true lets it through with a logged notice."""
    from minitrain.config import TrainConfig
    from minitrain.data.collate import collate_causal
    from minitrain.train import train

    b = _batch()
    examples = [{"input_ids": b["input_ids"][i].tolist(), "labels": b["labels"][i].tolist()} for i in range(2)]
    collate = lambda ex: collate_causal(ex, pad_id=0)  # noqa: E731
    block = lora_model.model.layers[0]
    inner = block.forward

    def forward(*args, **kwargs):
        with torch.no_grad():
            return inner(*args, **kwargs)

    block.forward = forward
    cfg = TrainConfig(out=str(tmp_path / "a"), max_steps=1, batch_size=2)
    lines: list[str] = []
    with pytest.raises(UserError, match="gradient-path audit before step 1: .*model.layers.0"):
        train(lora_model, sft, examples, collate, cfg, log=lines.append)
    assert not (tmp_path / "a" / "metrics.jsonl").exists()
    assert any("unreachable" in line for line in lines)
    cfg = TrainConfig(out=str(tmp_path / "b"), max_steps=1, batch_size=2, skip_audit=True)
    lines = []
    summary = train(lora_model, sft, examples, collate, cfg, log=lines.append)
    assert summary["step"] == 1 and any("audit skipped" in line for line in lines)


def test_tools_audit_cli_exit_codes(hf_causal, tmp_path):
    """`minitrain audit RECIPE.py key=value`: table + verdict, exit 0 healthy, 1 broken, 2 bad input."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from _tok import corpus, make_bpe_tokenizer

    repo = Path(__file__).resolve().parent.parent
    model = tmp_path / "model"
    shutil.copytree(hf_causal("audit_llama"), model)
    make_bpe_tokenizer(model)
    data = tmp_path / "train.jsonl"
    rows = [t.split() for t in corpus(8)]
    data.write_text("".join(json.dumps({"prompt": " ".join(w[:3]), "completion": " ".join(w[3:]) or "end"}) + "\n"
                            for w in rows))
    env = {**os.environ, "PYTHONPATH": str(repo)}

    def audit_cli(*args):
        return subprocess.run([sys.executable, "-m", "minitrain", "audit", str(repo / "recipes" / "sft_llama.py"),
                               f"model={model}", f"data={data}", "out=" + str(tmp_path / "out"), "batch_size=2", *args],
                              capture_output=True, text=True, env=env, cwd=tmp_path)

    ok = audit_cli("checkpointing=true")
    assert ok.returncode == 0, ok.stderr
    assert "audit: healthy" in ok.stdout and "gradient norm per layer" in ok.stdout
    part = audit_cli("checkpointing=1")  # the first block checkpointed, the other not
    assert part.returncode == 0 and "audit: healthy" in part.stdout, part.stderr
    assert not (tmp_path / "out").exists()  # the audit writes nothing
    js = audit_cli("--json")
    assert js.returncode == 0 and json.loads(js.stdout)["ok"] is True
    # a recipe whose forward has a no_grad section: the table names it, exit 1
    broken = tmp_path / "broken_recipe.py"
    broken.write_text(f"""import runpy
import torch
base = runpy.run_path({str(repo / "recipes" / "sft_llama.py")!r})
config = base["config"]
def setup(config):
    job = base["setup"](config)
    block = job.model.model.layers[1]
    inner = block.forward
    def forward(*a, **k):
        with torch.no_grad():
            return inner(*a, **k)
    block.forward = forward
    return job
def run(config):
    raise SystemExit("audit only")
""")
    b = subprocess.run([sys.executable, "-m", "minitrain", "audit", str(broken), f"model={model}", f"data={data}",
                        "batch_size=2"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert b.returncode == 1, b.stderr
    assert "unreachable" in b.stdout and "model.layers.1" in b.stdout and "no_grad" in b.stdout
    bad = audit_cli("lr=-1")
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "lr" in bad.stderr


# ----------------------------------------------------------------------------- blind spots (issue 13)


def _nonzero_b(model) -> None:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.normal_(0, 0.02)


def _only_through_times_zero(model, batch):
    """Field report 000's hack: the logits come from a no_grad forward, and `+ p.sum() * 0` keeps
    backward from raising — every trainable tensor is 'used', none can ever move."""
    with torch.no_grad():
        hidden = model(batch["input_ids"], batch["attention_mask"])
    loss_sum, count = chunked_cross_entropy_sum(hidden, model.output_projection, shift_labels(batch["labels"]))
    keep = sum(p.sum() for p in model.parameters() if p.requires_grad)
    return loss_sum + keep * 0, count, {}


def test_g_frozen_zero_lora_b_is_not_zero_at_init(lora_model):
    """LoRA-FA done backwards: B frozen (and zero), A trainable — A's gradient is zero for ever."""
    for n, p in lora_model.named_parameters():
        if ".lora_B." in n:
            p.requires_grad_(False)
    report = audit(lora_model, sft, _batch())
    assert not report.ok and "healthy" not in report.table()
    assert not any(t.status == ZERO_AT_INIT for t in report.tensors)
    problem = report.problems[0]
    assert ".lora_A." in problem and "is zero and frozen" in problem and "train B as well" in problem
    with pytest.raises(UserError, match="gradient exactly zero for ever"):
        preflight(lora_model, sft, _batch(), log=lambda _: None)


def test_g_frozen_zero_partner_on_the_other_side(lora_model):
    """The neighbour: A frozen at zero, B trainable — B's gradient (x A^T) is zero for ever too."""
    with torch.no_grad():
        for n, p in lora_model.named_parameters():
            if ".lora_A." in n:
                p.zero_()
                p.requires_grad_(False)
    report = audit(lora_model, sft, _batch())
    assert not report.ok
    assert "LoRA A" in report.problems[0] and ".lora_B." in report.problems[0]


def test_h_continued_adapter_reached_only_through_times_zero(lora_model):
    """A continued adapter (B non-zero) under an objective that adds `p.sum() * 0`: every gradient is
    exactly zero, and 'healthy — 0 of 16' is no longer a verdict the audit can give."""
    _nonzero_b(lora_model)
    report = audit(lora_model, _only_through_times_zero, _batch())
    assert report.loss is not None and all(t.status == "zero" for t in report.tensors)
    assert not report.ok and "healthy" not in report.verdict()
    assert report.problems[0].startswith(f"{len(report.tensors)} of {len(report.tensors)} trainable tensors get an "
                                         f"exactly zero gradient")
    assert "* 0" in report.problems[0]


def test_h_fresh_adapter_reached_only_through_times_zero(lora_model):
    """The same hack at init: B is zero, but the probe cannot lift A's zero, so nothing is 'as expected'."""
    report = audit(lora_model, _only_through_times_zero, _batch())
    assert not report.ok
    assert not any(t.status == ZERO_AT_INIT for t in report.tensors)


def test_i_adapter_merged_before_training(lora_model, hf_causal, tmp_path):
    """init_adapter then merge(): the forward skips the adapter; say so, name the layers, say what to do."""
    from minitrain.adapters.merge import merge

    _nonzero_b(lora_model)
    save_adapter(lora_model, tmp_path / "adapter", CFG)
    fresh = load_pretrained(hf_causal("audit_llama"), models.from_hf_config)
    load_adapter(fresh, tmp_path / "adapter", trainable=True)
    merge(fresh)
    report = audit(fresh, sft, _batch())
    assert not report.ok
    assert len(report.problems) == 1, report.problems  # not also "a .detach() in the objective"
    problem = report.problems[0]
    assert "merged into its base weights in 4 layers" in problem
    assert "model.layers.0.self_attn.q_proj" in problem and "unmerge(model)" in problem
    assert "detach" not in problem


def test_i_adapter_merged_in_some_layers_only(lora_model):
    """Half merged by hand: the loss still has a graph; the merged layers are named, not 'unreachable'."""
    lora_model.model.layers[1].self_attn.v_proj.merge("v")
    report = audit(lora_model, sft, _batch())
    assert not report.ok
    assert report.problems == [p for p in report.problems if "merged" in p]
    assert "1 layer (model.layers.1.self_attn.v_proj)" in report.problems[0]


def test_i_adapter_disabled_during_training(lora_model):
    from minitrain.adapters.lora import disable_adapters

    with disable_adapters(lora_model):
        report = audit(lora_model, sft, _batch())
    assert not report.ok and "disabled in 4 layers" in report.problems[0]


def test_h_zero_on_this_batch_only_is_a_warning_not_healthy_and_not_fatal():
    """One loss position (a 2-token example: the first token predicts the second): attention over a
    single key has a q / k gradient of exactly zero whatever the weights (the softmax of one score is
    1). The batch, not the run, is at fault: the verdict is a WARNING (never "healthy") and the
    preflight lets the run go. (The exact zero needs an exact softmax backward: test_train's TinyLM.)"""
    from minitrain.data.collate import collate_causal
    from test_train import TinyLM, freeze_embeddings

    model = freeze_embeddings(TinyLM(seed=3))
    batch = collate_causal([{"input_ids": [5, 9], "labels": [-100, 9]}], pad_id=0)
    report = audit(model, sft, batch)
    zero = {t.name for t in report.tensors if t.status == "zero"}
    # reference: autograd on the same loss gives exactly zero for those tensors, non-zero for the rest
    loss_sum, count, _ = sft(model, batch)
    (loss_sum / count).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert zero == {n for n, g in grads.items() if not g.any()}
    assert zero and all(".self_attn.q_proj." in n or ".self_attn.k_proj." in n for n in zero), zero
    assert report.ok and not report.problems
    assert report.verdict().startswith(f"audit: WARNING — {len(zero)} of {len(grads)} trainable tensors get an "
                                       f"exactly zero gradient on this batch")
    model.zero_grad(set_to_none=True)
    lines: list[str] = []
    preflight(model, sft, batch, log=lines.append)
    assert lines[0].startswith("audit: WARNING")


def test_audit_runs_on_a_short_slice_of_the_shortest_example(lora_model):
    """The audit batch is a window of the shortest row (<= 32 tokens however long the row), keeps
    the causal alignment (labels are -100 or the id at the same position) and a target, cuts DPO's
    two rows alike and seq2seq's encoder and decoder both; the audit on it is healthy and still
    finds a planted break (a forward section under no_grad)."""
    from minitrain.data.collate import collate_causal, collate_preference, collate_seq2seq
    from minitrain.train import AUDIT_SLICE, audit_batch

    g = torch.Generator().manual_seed(1)
    rows = []
    for n_prompt, n_answer in ((300, 40), (900, 60)):
        ids = torch.randint(3, 128, (n_prompt + n_answer,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * n_prompt + ids[n_prompt:]})
    batch = audit_batch(rows, lambda ex: collate_causal(ex, pad_id=0), None, torch.device("cpu"))
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    assert ids.numel() == 2 * AUDIT_SLICE and ids.tolist() == rows[0]["input_ids"][300 - AUDIT_SLICE: 300 + AUDIT_SLICE]
    assert ((labels == -100) | (labels == ids)).all() and (labels[1:] != -100).sum() == AUDIT_SLICE
    report = audit(lora_model, sft, batch)
    assert report.ok, report.table()

    pair = {"chosen_ids": rows[1]["input_ids"], "chosen_labels": rows[1]["labels"],
            "rejected_ids": rows[1]["input_ids"][:920], "rejected_labels": rows[1]["labels"][:920]}
    b = audit_batch([pair], lambda ex: collate_preference(ex, pad_id=0), None, torch.device("cpu"))
    assert b["input_ids"].shape == (2, 2 * AUDIT_SLICE) and torch.equal(b["input_ids"][0], b["input_ids"][1])
    s2s = {"input_ids": list(range(3, 503)), "labels": list(range(3, 103))}
    b = audit_batch([s2s], lambda ex: collate_seq2seq(ex, pad_id=0), None, torch.device("cpu"))
    assert b["input_ids"].shape == (1, 1 + AUDIT_SLICE) and b["labels"].shape == (1, 1 + AUDIT_SLICE)

    block = lora_model.model.layers[0]
    inner = block.forward

    def forward(*args, **kwargs):
        with torch.no_grad():
            return inner(*args, **kwargs)

    block.forward = forward
    report = audit(lora_model, sft, audit_batch(rows, lambda ex: collate_causal(ex, pad_id=0), None,
                                                torch.device("cpu")))
    assert any(t.status == UNREACHABLE for t in report.tensors if "layers.0" in t.name)


# ----------------------------------------------------------------------------- mixture of experts


@pytest.fixture
def moe_model(hf_causal):
    """A tiny Qwen3-MoE (8 experts, top 2; layer 1 dense), LoRA on everything, the router trained whole."""
    from test_moe import hub_checkpoint

    model = load_pretrained(hub_checkpoint(hf_causal, "qwen3_moe"), models.from_hf_config)
    cfg = LoRAConfig(r=2, alpha=4, targets="all-linear", modules_to_save=("gate",))
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    return model


def _moe_batch() -> dict:
    ids = torch.tensor([[5, 6, 7]])  # 3 tokens x top 2: at most 6 of the 8 experts receive one
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def test_moe_experts_without_a_token_are_not_dead(moe_model, hf_causal):
    """Experts that receive no token of the audit batch get no gradient in their slices of the expert
    tensors: the audit is healthy and names them in a note; which ones, from transformers' own router
    on the same batch."""
    import transformers
    from test_moe import hub_checkpoint

    report = audit(moe_model, sft, _moe_batch())
    assert report.ok and "healthy" in report.verdict(), report.table()
    hf = transformers.AutoModelForCausalLM.from_pretrained(hub_checkpoint(hf_causal, "qwen3_moe")).eval()
    with torch.no_grad():
        router = hf(input_ids=_moe_batch()["input_ids"], output_router_logits=True).router_logits[0]  # (3, 8)
    used = set(router.topk(2, dim=-1).indices.flatten().tolist())
    assert len(used) < 8
    assert report.notes == [f"experts that received no token of the audit batch (routing, not a cut path: their "
                            f"slices of the expert tensors get no gradient from this batch alone): "
                            f"model.layers.0.mlp.experts {8 - len(used)} of 8"]
    # the expert adapters are audited whole: reached (A zero at init, B with a gradient)
    statuses = {t.name: t.status for t in report.tensors}
    assert statuses["model.layers.0.mlp.experts.deltas.down_proj.lora_B.weight"] == "ok"
    assert statuses["model.layers.0.mlp.experts.deltas.down_proj.lora_A.weight"] == ZERO_AT_INIT


def test_moe_detached_router_is_caught(moe_model, monkeypatch):
    """A router whose output is detached: the trained router is cut off from the loss; named."""
    from models.layers import Router

    inner = Router.forward
    monkeypatch.setattr(Router, "forward", lambda self, x: tuple(t.detach() for t in inner(self, x)))
    report = audit(moe_model, sft, _moe_batch())
    assert not report.ok
    assert {t.name for t in report.tensors if t.status == UNREACHABLE} == {"model.layers.0.mlp.gate.weight"}
    assert "the output of model.layers.0.mlp.gate does not require grad" in report.problems[0]


def test_moe_experts_under_no_grad_are_caught(moe_model, monkeypatch):
    """The experts run under no_grad: every expert adapter is cut off, and the router, which reaches the
    loss only through the experts' weighted outputs; the audit says where."""
    from models.layers import Experts

    inner = Experts.forward

    def forward(self, *args):
        with torch.no_grad():
            return inner(self, *args)

    monkeypatch.setattr(Experts, "forward", forward)
    report = audit(moe_model, sft, _moe_batch())
    assert not report.ok
    dead = {t.name for t in report.tensors if t.status == UNREACHABLE}
    assert dead == {f"model.layers.0.mlp.experts.deltas.{p}.lora_{s}.weight" for p in ("gate_up_proj", "down_proj")
                    for s in "AB"} | {"model.layers.0.mlp.gate.weight"}
    assert "ran with gradients disabled: a torch.no_grad() / inference_mode section inside " \
           "model.layers.0.mlp.experts's forward" in report.problems[0]
