"""The vision-language demo (demo/vl_colours/, tools/make_vl_demo.py) and its accuracy tool
(tools/answer_accuracy.py).

References: transformers loads the demo folder with our logits on an image batch and our chat ids; the maker,
rerun, writes the committed tokenizer, config, images and rows bytes; greedy generation writes the answer
exactly when the accuracy tool counts it answered. The demo runs as a user runs it
(`python -m minitrain recipes/sft.py config=demo/vl_colours/run.json`, in a subprocess, one thread): the
held-out accuracy goes from chance to >= 0.9, and the same run on rows whose answers are shuffled among the
pictures (the control: the same words, no link to the picture) stays near chance.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import models
from minitrain.weights import load_pretrained

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "demo" / "vl_colours"
sys.path.insert(0, str(ROOT / "tools"))

from answer_accuracy import accuracy, answered  # noqa: E402


def first_rows(n: int) -> list[dict]:
    return [json.loads(line) for line in (DEMO / "eval.jsonl").read_text().splitlines()[:n]]


def eval_batch(n: int):
    """The first `n` held-out rows as the SFT run collates them, and the job (model with a fresh adapter)."""
    from minitrain.config import SFTConfig
    from minitrain.run import sft_job

    job = sft_job(SFTConfig(model=str(DEMO / "model"), data=str(DEMO / "eval.jsonl"), device="cpu",
                            precision="fp32", data_cache="false"), models.from_hf_config)
    return job.collate(list(job.train_examples[:n])), job


def test_demo_folder_loads_in_transformers_with_our_logits_and_ids():
    import transformers

    batch, job = eval_batch(4)
    rows = first_rows(4)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(DEMO / "model"))
    for row, ids in zip(rows, batch["input_ids"].tolist()):
        chat = [{**m, "content": ("<|vision_start|><|image_pad|><|vision_end|>" if m["role"] == "user" else "")
                 + m["content"]} for m in row["messages"]]
        theirs = hf_tok.apply_chat_template(chat, tokenize=True)
        theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
        image = job.tok.token_to_id("<|image_pad|>")
        assert [i for k, i in enumerate(ids) if i != image or ids[k - 1] != image] == list(theirs)  # one per image
    ours = load_pretrained(DEMO / "model", models.from_hf_config).eval()
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(DEMO / "model", dtype=torch.float32).eval()
    with torch.no_grad():
        a = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], pixel_values=batch["pixel_values"],
               image_grid_thw=batch["image_grid_thw"],
               mm_token_type_ids=(batch["input_ids"] == ours.config.image_token_id).long()).logits
        b = ours.lm_head(ours(batch["input_ids"], batch["attention_mask"], pixel_values=batch["pixel_values"],
                              image_grid_thw=batch["image_grid_thw"]))
    real = batch["attention_mask"].bool()
    assert float((b[real] - a[real]).norm() / a[real].norm()) <= 1e-5


def test_make_vl_demo_rewrites_the_committed_files(tmp_path):
    """Everything but the pre-trained weights is independent of the pre-training: a rerun without it writes
    the committed bytes."""
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_vl_demo.py"), "--out", str(tmp_path / "a"), "--steps",
                    "0"], check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                                  "PYTHONPATH": str(ROOT)})
    committed = sorted(p.relative_to(DEMO) for p in DEMO.rglob("*") if p.is_file())
    assert committed == sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    for f in committed:
        if f.name != "model.safetensors":
            assert (tmp_path / "a" / f).read_bytes() == (DEMO / f).read_bytes(), f
    assert sum((DEMO / f).stat().st_size for f in committed) < 2**20


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "minitrain", *args], cwd=cwd, env=env, capture_output=True, text=True)


def run_demo(tmp_path: Path, data: Path, out: str) -> Path:
    res = cli(str(ROOT / "recipes" / "sft.py"), f"config={DEMO / 'run.json'}", f"model={DEMO / 'model'}",
              f"data={data}", f"eval_data={DEMO / 'eval.jsonl'}", f"out={out}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    return tmp_path / out / "adapter"


def test_the_demo_learns_the_colours_and_the_control_does_not(tmp_path):
    model, held_out = str(DEMO / "model"), str(DEMO / "eval.jsonl")
    before, n = accuracy(model, held_out)
    assert n == 100 and before / n <= 0.3  # chance is 0.2: the base names one colour whatever it sees

    adapter = run_demo(tmp_path, DEMO / "train.jsonl", "runs/vl_colours")
    after, _ = accuracy(model, held_out, str(adapter))
    assert after / n >= 0.9

    rows = [json.loads(line) for line in (DEMO / "train.jsonl").read_text().splitlines()]
    answers = [r["messages"][1]["content"] for r in rows]
    random.Random(0).shuffle(answers)
    shuffled = tmp_path / "shuffled.jsonl"
    shuffled.write_text("".join(json.dumps({"images": [str(DEMO / r["images"][0])], "messages": [
        r["messages"][0], {"role": "assistant", "content": a}]}) + "\n" for r, a in zip(rows, answers)))
    control = run_demo(tmp_path, shuffled, "runs/control")
    assert accuracy(model, held_out, str(control))[0] / n <= 0.4

    # the tool's count is greedy decoding's: the answer written, then <|im_end|>, on the first rows
    from minitrain.commands.generate import load

    trained, tok = load(model, str(adapter))
    batch, _ = eval_batch(8)
    counted = answered(trained, batch).tolist()
    for i, row in enumerate(first_rows(8)):
        first_target = int((batch["labels"][i] != -100).nonzero()[0])
        prompt = batch["input_ids"][i, :first_target]  # up to the assistant's header
        rows_images = batch["image_grid_thw"][i:i + 1]
        start = int(batch["image_grid_thw"][:i].prod(-1).sum())
        pixels = batch["pixel_values"][start:start + int(rows_images.prod())]
        out = models.family(trained).generate(trained, prompt[None], max_new_tokens=4, pixel_values=pixels,
                                              image_grid_thw=rows_images)[0, len(prompt):].tolist()
        wrote = tok.decode(out, skip_special=False)
        assert (wrote == row["messages"][1]["content"] + "<|im_end|>") == counted[i], (i, wrote)
    assert any(counted)
