"""Full fine-tuning (`finetune=full`) through recipes/sft_llama.py on a tiny LLaMA saved by transformers.

- The run equals transformers' own model trained by a plain loop with `torch.optim.AdamW` on the
  same batches (same LR, weight decay on matrices, clipping), and `out/model` is an HF folder that
  `transformers.AutoModelForCausalLM` loads with our model's logits.
- Every parameter trains and the gradient-path audit checks all of them; no `modules_to_save`
  warning; `quantize` with full fine-tuning is one line, exit 2.
- A run stopped at step 2 and continued (`resume=true extend=true`, constant LR) ends bitwise equal
  to the straight run.
- Under `torch.distributed.run` with 2 processes (gloo; DDP and FSDP2), the saved model and its
  moving average (`ema_decay`) equal the one-process run's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _tok import make_bpe_tokenizer
from safetensors.torch import load_file

import models
from minitrain.cli import run_cli
from minitrain.config import SFTConfig
from minitrain.data.collate import collate_causal
from minitrain.run import load_examples, load_tokenizer
from minitrain.weights import load_pretrained

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "sft_llama.py")
DATA = REPO / "tests" / "bad_inputs" / "data" / "good.jsonl"  # 6 rows: one batch of 6 per step
KEYS = dict(max_steps=3, batch_size=6, grad_accum=1, lr=1e-3, warmup=0, schedule="constant", weight_decay=0.1,
            max_grad_norm=1.0, device="cpu", precision="fp32", chat_format="mistral", finetune="full")


@pytest.fixture(scope="module")
def model_dir(hf_causal, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("full_ft") / "model"
    shutil.copytree(hf_causal("full_ft_llama"), d)
    make_bpe_tokenizer(d)
    return d


def argv(model: Path, out: Path, **extra) -> list[str]:
    keys = {"model": model, "data": DATA, "out": out, **KEYS, **extra}
    return [RECIPE] + [f"{k}={v}" for k, v in keys.items()]


def the_batch(model: Path) -> dict[str, torch.Tensor]:
    """The run's one micro-batch (all 6 examples), as our reader and collator make it."""
    cfg = SFTConfig(model=str(model), data=str(DATA), chat_format="mistral")
    tok = load_tokenizer(cfg)
    examples, _ = load_examples(cfg, tok)
    return collate_causal(examples, pad_id=tok.pad_id)


def test_full_finetune_equals_transformers_trained_with_torch_adamw(model_dir, tmp_path, capsys):
    import transformers

    out = tmp_path / "run"
    assert run_cli(argv(model_dir, out)) == 0, capsys.readouterr().err
    log = capsys.readouterr().out
    assert "WARNING" not in log and "modules_to_save" not in log  # the LoRA-run warning is not for this
    n_tensors = len(list(transformers.AutoModelForCausalLM.from_pretrained(model_dir).parameters()))
    assert f"audit: healthy — {n_tensors} of {n_tensors} trainable tensors" in log  # every tensor audited
    assert "trainable: 98,624 of 98,624 parameters (100.00%)" in log
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint", "config.json", "metrics.jsonl", "model"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (out / "model").iterdir()}

    # the reference: the same model, a hand-written loop with full logits, torch's AdamW, the same 3 steps
    batch = the_batch(model_dir)
    ref = load_pretrained(model_dir, models.from_hf_config).train()
    hand_loop(ref, batch)
    ours = load_pretrained(out / "model", models.from_hf_config).eval()
    start = load_file(model_dir / "model.safetensors")
    want = ref.state_dict()
    assert set(ours.state_dict()) == set(want)
    assert min(float((want[k] - start[k]).abs().max()) for k in want) > 2e-3  # every tensor moved
    for k, v in ours.state_dict().items():
        assert close_moves(v, want[k], start[k]), k

    # transformers loads the saved folder and gives our model's logits
    saved = transformers.AutoModelForCausalLM.from_pretrained(out / "model").eval()
    with torch.no_grad():
        hf_logits = saved(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        our_logits = ours.output_projection(ours(batch["input_ids"], batch["attention_mask"]))
    keep = batch["attention_mask"].bool()
    torch.testing.assert_close(our_logits[keep], hf_logits[keep], rtol=0, atol=1e-4)

    # and transformers' own model, trained by the same loop, lands on the same weights
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    hand_loop(hf, batch, lambda b: hf(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits)
    for k, v in hf.state_dict().items():
        assert close_moves(v, want[k], start[k]), k


def close_moves(got: torch.Tensor, want: torch.Tensor, start: torch.Tensor) -> bool:
    """`got` is `want` up to float summation order: within 0.1% of the training move in norm.

    Not elementwise: Adam divides by sqrt(v) + 1e-8, so a gradient element near 1e-8 turns a
    last-bit difference (the loop scales the summed loss's gradients by 1 / count after backward;
    the hand loop divides the loss first) into a visible step: measured 4e-5 of a 3e-3 move on
    single elements, 1e-4 of the move in norm. A wrong LR, decay, clip or normalisation is O(1)."""
    return float((got - want).norm() / (want - start).norm()) < 1e-3


def hand_loop(model, batch, logits_of=None) -> None:
    """KEYS' run written out: token-mean CE over the whole batch, clip, torch.optim.AdamW (decay on matrices)."""
    logits_of = logits_of or (lambda b: model.output_projection(model(b["input_ids"], b["attention_mask"])))
    params = [p.requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": KEYS["weight_decay"]},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=KEYS["lr"])
    labels = batch["labels"][:, 1:]
    for _ in range(KEYS["max_steps"]):
        logits = logits_of(batch)[:, :-1].float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                               reduction="sum") / (labels != -100).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, KEYS["max_grad_norm"])
        opt.step()
        opt.zero_grad()


def test_a_tied_head_is_saved_once_and_transformers_loads_it(hf_causal, tmp_path, capsys):
    import transformers

    model_dir = tmp_path / "tied"
    shutil.copytree(hf_causal("full_ft_tied", tie_word_embeddings=True), model_dir)
    make_bpe_tokenizer(model_dir)
    assert run_cli(argv(model_dir, tmp_path / "run", max_steps=1)) == 0, capsys.readouterr().err
    folder = tmp_path / "run" / "model"
    assert "lm_head.weight" not in load_file(folder / "model.safetensors")  # written once, as HF does
    batch = the_batch(model_dir)
    ours = load_pretrained(folder, models.from_hf_config).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    with torch.no_grad():
        hf_logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        our_logits = ours.output_projection(ours(batch["input_ids"], batch["attention_mask"]))
    keep = batch["attention_mask"].bool()
    torch.testing.assert_close(our_logits[keep], hf_logits[keep], rtol=0, atol=1e-4)


def test_bf16_autocast_trains_fp32_master_weights(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(argv(model_dir, out, precision="bf16", max_steps=2)) == 0, capsys.readouterr().err
    assert "precision: torch.bfloat16" in capsys.readouterr().out  # autocast (CPU here, CUDA alike)
    for name in ("checkpoint/weights.safetensors", "model/model.safetensors"):
        saved = load_file(out / name)
        assert len(saved) == 21 and all(t.dtype == torch.float32 for t in saved.values()), name


def test_quantize_with_full_finetune_is_one_line(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_cli(argv(model_dir, out, quantize="nf4")) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err == ["error: quantize=nf4: finetune=full trains every weight, and quantized weights cannot train — use "
                   "quantize=none, or finetune=lora to train adapters on a quantized base"]
    assert not out.exists()


def test_continued_full_finetune_is_bitwise_the_straight_run(model_dir, tmp_path, capsys):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run_cli(argv(model_dir, straight, max_steps=4)) == 0
    assert run_cli(argv(model_dir, split, max_steps=2)) == 0
    assert run_cli(argv(model_dir, split, max_steps=4, resume="true", extend="true")) == 0, capsys.readouterr().err
    for name in ("model/model.safetensors", "checkpoint/weights.safetensors", "checkpoint/optimizer.safetensors"):
        a, b = load_file(straight / name), load_file(split / name)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_save_the_one_process_model(model_dir, tmp_path, capsys, parallel):
    one, two = tmp_path / "one", tmp_path / "two"
    assert run_cli(argv(model_dir, one, ema_decay=0.5)) == 0, capsys.readouterr().err
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "minitrain",
                        *argv(model_dir, two, parallel=parallel, ema_decay=0.5)], cwd=REPO, env=env,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-4000:]
    assert p.stdout.count("done: step 3/3") == 1  # rank 0 alone prints
    for folder in ("model", "model_ema"):  # and the moving average (ema_decay), kept per shard under FSDP
        want, got = load_file(one / folder / "model.safetensors"), load_file(two / folder / "model.safetensors")
        assert set(got) == set(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=k)


def test_distill_trains_the_whole_student_and_saves_it(model_dir, hf_causal, tmp_path, capsys):
    teacher = tmp_path / "teacher"
    shutil.copytree(hf_causal("full_ft_teacher", num_hidden_layers=3), teacher)
    make_bpe_tokenizer(teacher)
    out = tmp_path / "run"
    recipe = str(REPO / "recipes" / "distill_llama.py")
    keys = {**KEYS, "model": model_dir, "teacher": teacher, "data": DATA, "out": out, "max_steps": 2}
    assert run_cli([recipe] + [f"{k}={v}" for k, v in keys.items()]) == 0, capsys.readouterr().err
    assert "audit: healthy — 21 of 21 trainable tensors" in capsys.readouterr().out
    start, got = load_file(model_dir / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    assert set(got) == set(start) and all(not torch.equal(got[k], start[k]) for k in start)  # every tensor trained
