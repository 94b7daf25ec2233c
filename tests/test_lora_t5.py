"""recipes/lora_t5.py and minitrain/evaluate/generation.py on a tiny T5 saved by transformers.

One real `python -m minitrain recipes/lora_t5.py ...` run (module fixture; rows with other key
names mapped by `fields`, an added `[Question]` token, eval every 2 steps) is checked for what it
writes: metrics with eval/rouge*, ROUGE equal to rouge-score's on its own predictions file, a best
adapter that reproduces those predictions, a PEFT adapter that transformers + peft load. Further
runs go through `run_cli` in-process. Parameter counts are checked against the hand formula
sum over wrapped layers of r * (in + out), and against the field report's FLAN-T5-small count.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from _tok import corpus, make_t5_tokenizer
from rouge_score import rouge_scorer

import models
from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters, trainable_report
from minitrain.adapters.peft_format import load_adapter
from minitrain.cli import run_cli
from minitrain.errors import UserError
from minitrain.evaluate.generation import EarlyStopping, GenerationEval, generate_texts, until_eos
from minitrain.text.tokenizer import Tokenizer
from minitrain.train import train
from minitrain.weights import load_pretrained
from models.t5 import generate

# the recipe passes GenerationEval to train(eval_fn=...): the loop's hook, requested from its owner
needs_hook = pytest.mark.skipif("eval_fn" not in inspect.signature(train).parameters,
                                reason="minitrain.train.train has no eval_fn hook yet")
REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "lora_t5.py")
SEVEN = {"q", "k", "v", "o", "wi_0", "wi_1", "wo"}
TINY_T5 = dict(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
               feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0)
# google/flan-t5-small's config.json (the maths fields)
FLAN_T5_SMALL = dict(model_type="t5", vocab_size=32128, d_model=512, d_kv=64, d_ff=1024, num_layers=8,
                     num_decoder_layers=8, num_heads=6, relative_attention_num_buckets=32,
                     relative_attention_max_distance=128, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                     decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


def save_tiny_t5(folder: Path, seed: int = 0) -> Path:
    """A tiny random T5 v1.1 (gated-gelu, own lm_head) saved by transformers, plus a T5 tokenizer."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**TINY_T5)).eval()
    model.lm_head.weight = torch.nn.Parameter(0.5 * torch.randn(TINY_T5["vocab_size"], TINY_T5["d_model"]))
    model.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["tie_word_embeddings"] = False  # transformers 5 writes true whatever the head; the Hub's v1.1 configs say false
    (folder / "config.json").write_text(json.dumps(cfg))
    make_t5_tokenizer(folder)  # vocab 128: covers the model's rows exactly
    return folder


def write_rows(path: Path, lines: list[str], keys=("question", "answer")) -> Path:
    """Copy-task rows "[Question] <line>" -> "<line>" under the given key names."""
    path.write_text("".join(json.dumps({keys[0]: "[Question] " + line, keys[1]: line}) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_t5")
    lines = corpus(40, seed=5)
    return {"root": root, "model": save_tiny_t5(root / "model"),
            "data": write_rows(root / "train.jsonl", lines[:32]),
            "eval": write_rows(root / "val.jsonl", lines[32:])}


def args(tiny: dict[str, Path], out: Path, *extra: str) -> list[str]:
    keys = {"model": tiny["model"], "data": tiny["data"], "eval_data": tiny["eval"], "out": out, "max_steps": 4,
            "eval_every": 2, "batch_size": 4, "max_new_tokens": 6, "lr": 3e-3,
            "fields": '{"prompt": "question", "completion": "answer"}', "added_tokens": '["[Question]"]'}
    keys.update(e.split("=", 1) for e in extra)
    return [RECIPE] + [f"{k}={v}" for k, v in keys.items()]


@pytest.fixture(scope="module")
def smoke(tiny) -> tuple[subprocess.CompletedProcess, Path]:
    out = tiny["root"] / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-m", "minitrain", *args(tiny, out)], cwd=REPO, env=env,
                       capture_output=True, text=True)
    return p, out


def cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what fixtures printed
    code = run_cli(argv)
    out, err = capsys.readouterr()
    return code, out, err


def one_error(code: int, err: str, needle: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert needle in lines[0], lines[0]
    return lines[0]


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def base_model(tiny, added: int = 0):
    model = load_pretrained(tiny["model"], models.from_hf_config).eval()
    if added:
        model.resize_token_embeddings(model.config.vocab_size + added)
    return model


# ----------------------------------------------------------------------------- the smoke run


@needs_hook
def test_smoke_run_logs_eval_rouge_and_writes_adapters(smoke, tiny):
    p, out = smoke
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    rows = rows_of(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        for k in ("eval/loss", "eval/rouge1", "eval/rouge2", "eval/rougeL"):
            assert math.isfinite(r[k]), (k, r)
        for k in ("eval/rouge1", "eval/rouge2", "eval/rougeL"):
            assert 0.0 <= r[k] <= 1.0
    assert "stop" not in json.dumps(rows)
    assert "added_tokens: 1 new ({'[Question]': 128}); embedding and head resized 128 -> 129 rows" in p.stdout

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["fields"] == {"prompt": "question", "completion": "answer"} and cfg["added_tokens"] == ["[Question]"]
    assert (cfg["warmup"], cfg["lora_r"], cfg["schedule"]) == (0.06, 16, "linear")  # the recipe's defaults
    for folder in (out / "adapter", out / "best_adapter"):
        acfg = json.loads((folder / "adapter_config.json").read_text())
        assert set(acfg["target_modules"]) == SEVEN and acfg["r"] == 16, acfg
        assert acfg["task_type"] == "SEQ_2_SEQ_LM"
        with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
            assert f.metadata()["minitrain.vocab_size"] == "129"  # the resized vocab travels with the adapter
        assert Tokenizer.from_folder(folder).token_to_id("[Question]") == 128  # the tokenizer travels with it


@needs_hook
def test_logged_rouge_equals_rouge_score_on_the_predictions(smoke, tiny):
    _, out = smoke
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=False)
    completions = [json.loads(line)["answer"] for line in tiny["eval"].read_text().splitlines()]
    for row in rows_of(out / "metrics.jsonl"):
        if "eval/rougeL" not in row:
            continue
        preds = rows_of(out / "predictions" / f"step_{row['step']:07d}.jsonl")
        assert [" ".join(p["reference"].split()) for p in preds] == [" ".join(c.split()) for c in completions]
        assert all(p["input"].startswith("[Question]") for p in preds), preds[0]["input"]  # shown, not skipped
        for t in ("rouge1", "rouge2", "rougeL"):
            theirs = [scorer.score(p["reference"], p["prediction"])[t].fmeasure for p in preds]
            assert row[f"eval/{t}"] == pytest.approx(sum(theirs) / len(theirs), abs=1e-12)
            assert [p[t] for p in preds] == pytest.approx(theirs, abs=1e-12)
    assert any(p["prediction"] for p in preds), "the model generated nothing: the comparison would be vacuous"


@needs_hook
def test_best_adapter_reproduces_its_steps_predictions(smoke, tiny):
    """Tokenizer from the adapter folder, resize, load: the predictions of the best step come back."""
    _, out = smoke
    best = json.loads((out / "best_adapter" / "best.json").read_text())
    values = {r["step"]: r["eval/rougeL"] for r in rows_of(out / "metrics.jsonl") if "eval/rougeL" in r}
    assert best["metric"] == "eval/rougeL" and best["value"] == max(values.values())
    assert best["step"] == min(s for s, v in values.items() if v == best["value"])  # the first of equal bests

    tok = Tokenizer.from_folder(out / "best_adapter")
    model = base_model(tiny)
    model.resize_token_embeddings(tok.vocab_size)
    load_adapter(model, out / "best_adapter")
    rows = [json.loads(line) for line in tiny["eval"].read_text().splitlines()]
    examples = [{"input_ids": tok.encode(r["question"], eos=True)} for r in rows]
    preds = generate_texts(model, examples, tok, generate, batch_size=4, max_new_tokens=6)
    saved = rows_of(out / "predictions" / f"step_{best['step']:07d}.jsonl")
    assert preds == [p["prediction"] for p in saved]


@needs_hook
def test_adapter_loads_in_peft_with_our_logits(smoke, tiny):
    """transformers + peft on the same resized base give our logits, the added token's included."""
    import peft
    import transformers

    _, out = smoke
    ours = base_model(tiny, added=1)
    ref = transformers.T5ForConditionalGeneration.from_pretrained(tiny["model"], dtype=torch.float32)
    ref.resize_token_embeddings(129)  # transformers 5 re-ties the head here and draws its own new row:
    with torch.no_grad():  # give it our resized matrices instead, head untied
        ref.shared.weight.copy_(ours.shared.weight)
        ref.lm_head = torch.nn.Linear(32, 129, bias=False)
        ref.lm_head.weight.copy_(ours.lm_head.weight)
    load_adapter(ours, out / "adapter")
    ours.eval()  # the LoRA layers load_adapter inserts start in training mode (lora_dropout on)
    assert any(m.lora_B.weight.abs().max() > 0 for m in ours.modules() if hasattr(m, "lora_B"))
    ref = peft.PeftModel.from_pretrained(ref, out / "adapter").eval()
    ids = torch.tensor([[128, 17, 42, 99, 63, 1], [128, 8, 9, 1, 0, 0]])  # 128: [Question]
    mask = (torch.arange(6) < torch.tensor([[6], [4]])).long()
    dec = torch.tensor([[0, 11, 12, 13], [0, 21, 22, 23]])
    with torch.no_grad():
        got = ours.output_projection(ours(ids, mask, dec))
        want = ref(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- early stopping through the recipe


@needs_hook
def test_recipe_stops_early_and_keeps_the_best(capsys, tiny, tmp_path):
    """min_delta=2 (> any ROUGE gain): the eval at step 4 cannot reset patience 1, so the run ends at step 4."""
    out = tmp_path / "out"
    code, stdout, err = cli(capsys, args(tiny, out, "max_steps=10", "patience=1", "min_delta=2"))
    assert code == 0, err
    rows = rows_of(out / "metrics.jsonl")
    assert rows[-1]["step"] == 4 and [r["step"] for r in rows if "eval/rougeL" in r] == [2, 4]
    assert "early stop — eval/rougeL did not improve by more than 2 in 1 evaluations" in stdout
    assert "done: step 4/10" in stdout
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 4
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    best = json.loads((out / "best_adapter" / "best.json").read_text())
    assert best["step"] in (2, 4)


@needs_hook
def test_early_stop_on_eval_loss(capsys, tiny, tmp_path):
    out = tmp_path / "out"
    code, stdout, err = cli(capsys, args(tiny, out, "max_steps=10", "patience=1", "min_delta=100",
                                         "early_stop_metric=eval/loss"))
    assert code == 0, err
    rows = [r for r in rows_of(out / "metrics.jsonl") if "eval/loss" in r]
    assert [r["step"] for r in rows] == [2, 4]
    best = json.loads((out / "best_adapter" / "best.json").read_text())
    assert best["value"] == min(r["eval/loss"] for r in rows) and best["mode"] == "min"


@needs_hook
def test_bf16_run(capsys, tiny, tmp_path):
    """precision=bf16: bf16 base, autocast for training and for generation at eval."""
    out = tmp_path / "out"
    code, stdout, err = cli(capsys, args(tiny, out, "max_steps=2", "precision=bf16"))
    assert code == 0, err
    assert "base in bfloat16" in stdout
    row = rows_of(out / "metrics.jsonl")[-1]
    assert all(math.isfinite(row[k]) for k in ("loss", "eval/loss", "eval/rougeL"))


# ----------------------------------------------------------------------------- added tokens and a saved adapter


@needs_hook
def test_load_adapter_on_an_unresized_base_says_to_add_the_token(smoke, tiny):
    _, out = smoke
    with pytest.raises(UserError) as e:
        load_adapter(base_model(tiny), out / "adapter")
    assert ("the adapter was trained on a vocabulary of 129 tokens but the model's input embedding has 128 — "
            "add the same special tokens and call model.resize_token_embeddings(129) before load_adapter") in str(e.value)


@needs_hook
def test_recipe_init_adapter_without_the_added_token_is_one_line(capsys, smoke, tiny, tmp_path):
    _, out = smoke
    code, _, err = cli(capsys, args(tiny, tmp_path / "next", "added_tokens=[]", f"init_adapter={out / 'adapter'}"))
    one_error(code, err, f"init_adapter={out / 'adapter'}: the adapter was trained with 129 embedding rows, this model "
                         f"has 128 — pass the added_tokens of the run that trained it (its tokenizer adds [Question])")
    assert not (tmp_path / "next").exists()


@needs_hook
def test_recipe_init_adapter_with_the_added_token_continues(capsys, smoke, tiny, tmp_path):
    _, out = smoke
    code, stdout, err = cli(capsys, args(tiny, tmp_path / "next", "max_steps=1", f"init_adapter={out / 'adapter'}"))
    assert code == 0, err
    assert f"adapter: continuing {out / 'adapter'} (r=16" in stdout


# ----------------------------------------------------------------------------- trainable parameters


def hand_count(cfg: dict, r: int) -> int:
    """sum over wrapped layers of r * (in + out): per encoder block q k v o (d <-> heads*d_kv) and
    wi_0 wi_1 (d -> d_ff), wo (d_ff -> d); a decoder block has a second attention (cross)."""
    d, inner, ff = cfg["d_model"], cfg["num_heads"] * cfg["d_kv"], cfg["d_ff"]
    attention, feed_forward = 4 * (d + inner), 3 * (d + ff)
    return r * (cfg["num_layers"] * (attention + feed_forward)
                + cfg["num_decoder_layers"] * (2 * attention + feed_forward))


def adapted(cfg: dict, r: int = 16, modules_to_save=()):
    with torch.device("meta"):
        model = models.from_hf_config({"model_type": "t5", **cfg})
    lcfg = LoRAConfig(r=r, alpha=2.0 * r, targets=sorted(SEVEN), modules_to_save=modules_to_save)
    apply_lora(model, lcfg)
    freeze_for_adapters(model, lcfg)
    return model


def test_trainable_count_equals_hand_count_and_peft(tiny):
    import peft
    import transformers

    expected = hand_count(TINY_T5, 16)
    assert expected == 43_008  # 2 * 16 * (4*64 + 3*96) + 2 * 16 * (8*64 + 3*96)
    model = adapted(TINY_T5)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == expected
    total = sum(p.numel() for p in model.parameters())
    assert trainable_report(model).splitlines()[0] == (
        f"trainable: {expected:,} of {total:,} parameters ({100 * expected / total:.2f}%)")
    ref = transformers.T5ForConditionalGeneration.from_pretrained(tiny["model"])
    ref = peft.get_peft_model(ref, peft.LoraConfig(r=16, lora_alpha=32, target_modules=sorted(SEVEN)))
    assert ref.get_nb_trainable_parameters()[0] == expected


def test_flan_t5_small_count_matches_the_field_report():
    """Field report 003: "4.05% trainable (2,555,904 / ...)" for FLAN-T5-small, r=16 on the seven targets."""
    model = adapted(FLAN_T5_SMALL)
    assert hand_count(FLAN_T5_SMALL, 16) == 2_555_904
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2_555_904
    assert "WARNING" not in trainable_report(model)


def test_modules_to_save_shared_and_head_is_loud():
    model = adapted(FLAN_T5_SMALL, modules_to_save=["shared", "lm_head"])
    c = FLAN_T5_SMALL
    d, inner, ff, V = c["d_model"], c["num_heads"] * c["d_kv"], c["d_ff"], c["vocab_size"]
    block = 4 * d * inner + 3 * d * ff  # weights of an encoder block, without its norms
    base = (2 * V * d + c["num_layers"] * (block + 2 * d) + c["num_decoder_layers"] * (block + 4 * d * inner + 3 * d)
            + 2 * (32 * c["num_heads"] + d))  # + per stack: relative position table, final norm
    assert base == 76_961_152  # FLAN-T5-small's published size ("77M")
    full = 2 * V * d
    report = trainable_report(model)
    warning = [line for line in report.splitlines() if line.startswith("WARNING")]
    assert len(warning) == 1, report
    share = 100 * full / (base + 2_555_904)
    assert f"fully training shared, lm_head: {full:,} parameters = {share:.1f}% of the model" in warning[0]
    assert f"{share:.1f}" == "41.4"


# ----------------------------------------------------------------------------- config refusals


@pytest.mark.parametrize("extra,needle", [
    (("precision=fp16",), "precision=fp16: T5 activations overflow float16"),
    (("eval_data=", "patience=3"), "patience=3: early stopping needs eval_data"),
    (("eval_every=0", "patience=3"), "patience=3: with eval_every=0 the run is evaluated only at its end"),
    (('fields={"prompt": "question", "answer": "answer"}',), 'fields: {"answer": "answer"} — map "prompt"'),
    (("fields={}",), 'train.jsonl:1: missing key "prompt"'),
    (("early_stop_metric=eval/bleu",), "early_stop_metric=eval/bleu: must be one of"),
    (("num_beams=0",), "num_beams=0: must be >= 1"),
])
def test_bad_settings_are_one_line_and_write_nothing(capsys, tiny, tmp_path, extra, needle):
    out = tmp_path / "out"
    code, _, err = cli(capsys, args(tiny, out, *extra))
    one_error(code, err, needle)
    assert not out.exists()


def test_causal_model_is_refused(capsys, hf_causal, tiny, tmp_path):
    from _tok import make_bpe_tokenizer

    folder = tmp_path / "llama"
    shutil.copytree(hf_causal("lora_t5_llama"), folder)
    make_bpe_tokenizer(folder)
    code, _, err = cli(capsys, args(tiny, tmp_path / "out", f"model={folder}"))
    one_error(code, err, "is a causal LM (llama) — this recipe trains T5 / FLAN-T5; use recipes/sft_llama.py")


def test_recipe_help(capsys):
    code, out, _ = cli(capsys, [RECIPE, "--help"])
    assert code == 0
    for key in ("num_beams", "early_stop_metric", "patience", "min_delta", "added_tokens", "fields", "max_new_tokens"):
        assert f"  {key}:" in out
    assert "lora_targets: list[str] = q,k,v,o,wi,wi_0,wi_1,wo" in out


# ----------------------------------------------------------------------------- EarlyStopping


def test_min_delta_must_be_exceeded_and_gains_add_up():
    """Keras' rule: +0.0005 per eval against min_delta 0.001 resets patience every other eval."""
    es = EarlyStopping("eval/rougeL", patience=2, min_delta=0.001)
    news = [es.update(s, v) for s, v in ((1, 0.2000), (2, 0.2005), (3, 0.2010), (4, 0.2015))]
    assert news == [True, True, True, True]  # every gain is a new best (the adapter follows it)
    assert es.bad_evals == 0 and not es.should_stop  # 0.2015 beat the 0.2000 reference by 0.0015 > 0.001
    es.update(5, 0.2020)  # +0.0005 over the 0.2015 reference: no reset
    es.update(6, 0.2025)  # +0.001 exactly: not MORE than min_delta
    assert es.bad_evals == 2 and es.should_stop and es.best_step == 6


def test_ties_nan_and_patience_zero():
    es = EarlyStopping("eval/rouge1", patience=0)
    assert es.update(1, 0.5) and not es.update(2, 0.5)  # a tie is no improvement
    assert not es.update(3, float("nan"))
    assert es.bad_evals == 2 and not es.should_stop  # patience 0 never stops
    assert (es.best, es.best_step) == (0.5, 1)


def test_loss_is_minimised():
    es = EarlyStopping("eval/loss", patience=1)
    assert es.mode == "min"
    assert es.update(1, 2.0) and es.update(2, 1.5) and not es.update(3, 1.6)
    assert es.should_stop and es.best_step == 2


def test_replay_rebuilds_the_same_state():
    values = [(2, 0.1), (4, 0.3), (6, 0.25), (8, 0.31), (10, 0.2)]
    live = EarlyStopping("eval/rougeL", patience=3, min_delta=0.02)
    for s, v in values:
        live.update(s, v)
    rows = [{"step": s, "eval/rougeL": v} for s, v in values] + [{"step": 11, "loss": 1.0}]
    again = EarlyStopping("eval/rougeL", patience=3, min_delta=0.02)
    assert again.replay(rows, before_step=12) == 5
    assert again == live
    partial = EarlyStopping("eval/rougeL", patience=3, min_delta=0.02)
    assert partial.replay(rows, before_step=8) == 3 and partial.best_step == 4


# ----------------------------------------------------------------------------- GenerationEval on its own


class Scripted(torch.nn.Module):
    """A stand-in model whose `generate` returns scripted ids, one script per call."""

    def __init__(self, tok: Tokenizer, outputs: list[list[str]]):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.tok, self.outputs, self.calls = tok, outputs, 0

    def generate(self, model, ids, mask, *, max_new_tokens, num_beams):
        assert not model.training and mask.shape == ids.shape
        texts = self.outputs[self.calls][: ids.shape[0]]
        self.outputs[self.calls] = self.outputs[self.calls][ids.shape[0]:]
        if not self.outputs[self.calls]:
            self.calls += 1
        rows = [[0] + self.tok.encode(t, eos=True) for t in texts]
        width = max(map(len, rows)) + 1
        return torch.tensor([r + [1] * (width - len(r)) for r in rows])  # filled with eos after the end


def test_generation_eval_scores_keeps_best_and_stops(tmp_path):
    tok = Tokenizer.from_folder(make_t5_tokenizer(tmp_path / "tok"))
    refs = ["the cat sat on the mat", "police killed the gunman"]
    examples = [{"input_ids": tok.encode("copy " + r, eos=True), "labels": tok.encode(r, eos=True)} for r in refs]
    model = Scripted(tok, [["the cat", "police kill the gunman"], refs, ["", ""]])
    saved = []

    def save_best(m, folder: Path) -> None:
        folder.mkdir()
        (folder / "marker").write_text(str(model.calls))
        saved.append(model.calls)

    ev = GenerationEval(examples, tok, model.generate, out_dir=tmp_path, save_best=save_best,
                        stopper=EarlyStopping("eval/rougeL", patience=1), batch_size=1, max_new_tokens=9,
                        log=lambda s: None)
    model.train()
    first = ev(model, 2, {"eval/loss": 3.0})
    assert model.training  # put back
    want = [rouge_scorer.RougeScorer(["rougeL"]).score(r, p)["rougeL"].fmeasure
            for r, p in zip(refs, ["the cat", "police kill the gunman"])]
    assert set(first) == {"eval/rouge1", "eval/rouge2", "eval/rougeL"}
    assert first["eval/rougeL"] == pytest.approx(sum(want) / 2)
    assert ev(model, 4, {}) == {"eval/rouge1": 1.0, "eval/rouge2": 1.0, "eval/rougeL": 1.0}
    third = ev(model, 6, {})
    assert third["stop"] is True and third["eval/rougeL"] == 0.0
    assert saved == [1, 2]  # kept at steps 2 and 4, not at the worse step 6
    assert json.loads((tmp_path / "best_adapter" / "best.json").read_text())["step"] == 4
    assert (tmp_path / "best_adapter" / "marker").read_text() == "2"
    assert not list(tmp_path.glob(".best_adapter*"))
    preds = rows_of(tmp_path / "predictions" / "step_0000006.jsonl")
    assert [p["prediction"] for p in preds] == ["", ""] and [p["reference"] for p in preds] == refs


def test_generation_eval_resume_replays_and_drops_a_best_from_after_the_checkpoint(tmp_path):
    tok = Tokenizer.from_folder(make_t5_tokenizer(tmp_path / "tok"))
    examples = [{"input_ids": tok.encode("a b", eos=True), "labels": tok.encode("the cat", eos=True)}]
    # the interrupted run: evals at 2 (0.5) and 4 (0.9, best, saved), checkpoint at 2, metrics truncated to it
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n"
                                            + json.dumps({"step": 2, "eval/rougeL": 0.5}) + "\n")
    (tmp_path / "best_adapter").mkdir()
    (tmp_path / "best_adapter" / "best.json").write_text(json.dumps({"step": 4, "value": 0.9}))
    model = Scripted(tok, [["dog"]])
    logs: list[str] = []
    ev = GenerationEval(examples, tok, model.generate, out_dir=tmp_path, save_best=lambda m, f: f.mkdir(),
                        stopper=EarlyStopping("eval/rougeL", patience=1), batch_size=4, max_new_tokens=4,
                        log=logs.append)
    result = ev(model, 4, {})
    assert result["eval/rougeL"] == 0.0 and result["stop"] is True  # 0.0 after the replayed 0.5: patience 1 spent
    assert ev.stopper.best_step == 2
    assert not (tmp_path / "best_adapter").exists()
    assert any("was from step 4, after the checkpoint — removed" in line for line in logs)


def test_until_eos():
    assert until_eos([5, 6, 1, 7, 0], [1]) == [5, 6]
    assert until_eos([5, 6], [1]) == [5, 6]
    assert until_eos([5, 6], []) == [5, 6]
