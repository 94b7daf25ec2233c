"""minitrain merge (merged folder loads in transformers with the adapted model's logits) and
minitrain generate (base + adapter, one prompt or stdin)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minitrain.cli import ENGINE_COMMANDS
import torch

import models
from minitrain.adapters.lora import LoRAConfig, apply_lora
from minitrain.adapters.peft_format import save_adapter
from minitrain.weights import load_pretrained

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "demo" / "model"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    """A LoRA adapter on the demo model with non-zero B (so merging changes the weights)."""
    model = load_pretrained(DEMO, models.from_hf_config)
    cfg = LoRAConfig(r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))
    apply_lora(model, cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.05)
    folder = tmp_path_factory.mktemp("adapter")
    save_adapter(model, folder, cfg)
    return folder


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, env=env, cwd=REPO)


def test_merge_gives_an_hf_folder_with_the_adapted_logits(adapter, tmp_path):
    transformers = pytest.importorskip("transformers")
    from minitrain.adapters.peft_format import load_adapter

    out = tmp_path / "merged"
    p = _run("-m", "minitrain", "merge", "--model", str(DEMO), "--adapter", str(adapter), "--out", str(out), "--dtype", "float32")
    assert p.returncode == 0, p.stderr
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    ours = load_pretrained(DEMO, models.from_hf_config)
    load_adapter(ours, adapter)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours.output_projection(ours(ids))
        got = hf(ids).logits
        base = load_pretrained(DEMO, models.from_hf_config)
        unchanged = base.output_projection(base(ids))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (want - unchanged).abs().max() > 1e-3  # the adapter really changes the model


def test_merge_bad_input_is_one_line(tmp_path):
    p = _run("-m", "minitrain", "merge", "--model", str(tmp_path / "nope"), "--adapter", str(tmp_path), "--out", str(tmp_path / "o"))
    assert p.returncode == 2 and p.stderr.startswith("error: ") and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_generate_one_prompt_and_stdin_agree(adapter):
    prompt = "Note: Ana, 34, has asthma, takes salbutamol. Summarise."
    one = _run("-m", "minitrain", "generate", "--model", str(DEMO), "--adapter", str(adapter), "--prompt", prompt,
               "--max-new-tokens", "12")
    assert one.returncode == 0, one.stderr
    assert one.stdout.strip()
    piped = _run("-m", "minitrain", "generate", "--model", str(DEMO), "--adapter", str(adapter), "--max-new-tokens", "12",
                 stdin=prompt + "\n")
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.strip() == one.stdout.strip()  # greedy: the same answer either way


def _closed_pipe_run(args: list[str]) -> subprocess.CompletedProcess:
    """Run `args` with a stdout pipe that the reader closes at once (`... | head` at its limit)."""
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    p.stdout.close()  # before the process writes: its first write or flush meets a closed pipe
    err = p.stderr.read().decode()
    return subprocess.CompletedProcess(args, p.wait(), "", err)


@pytest.mark.parametrize("cmd", [
    *[[f"tools/{t.name}", "--help"] for t in sorted((REPO / "tools").glob("*.py"))],
    *[["-m", "minitrain", name, "--help"] for name in ENGINE_COMMANDS],
    ["-m", "minitrain", "plan", "recipes/sft_mistral.py", "--all"],
    ["-m", "minitrain", "--help"],
    ["-m", "minitrain", "recipes/sft_llama.py", "--help"],
    ["-m", "minitrain", "--version"],
], ids=lambda c: " ".join(c))
def test_a_closed_pipe_ends_every_tool_and_the_cli_quietly(cmd):
    """`minitrain plan ... | head`: no BrokenPipeError traceback, no 'Exception ignored', exit 0."""
    p = _closed_pipe_run([sys.executable, *cmd])
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr
    assert p.returncode == 0, p.stderr


def test_generate_raw_prompt_on_a_tokenizer_without_bos(tmp_path):
    """Qwen's tokenizer has no bos: a raw prompt is encoded as the training rows begin (bos only
    where the tokenizer adds one), not refused for a missing bos."""
    import argparse
    import importlib

    from _tok import make_qwen_tokenizer

    from minitrain.text.tokenizer import Tokenizer
    from models.llama import generate

    tool = importlib.import_module("minitrain.commands.generate")
    tok = Tokenizer.from_folder(make_qwen_tokenizer(tmp_path / "qwen"))
    assert tok.bos_id is None and tok.vocab_size <= 320
    model = load_pretrained(DEMO, models.from_hf_config).eval()
    args = argparse.Namespace(format="raw", max_new_tokens=4, temperature=0.0, top_p=1.0, seed=0, num_beams=1)
    got = tool.complete(model, tok, "hello there", args)
    ids = torch.tensor([tok.encode("hello there")])
    want = generate(model, ids, torch.ones_like(ids), max_new_tokens=4, do_sample=False, eos_token_id=tok.eos_id,
                    pad_token_id=tok.pad_id)
    assert got == tok.decode(want[0, ids.shape[1]:].tolist())


@pytest.mark.parametrize("mode", ["raw", "chat"])
def test_generate_queries_in_the_format_the_run_trained(tmp_path, mode):
    """Prompt / completion strings on a model with a chat template: trained as plain text by default,
    through the template with prompt_completion=chat; the log says which, out/config.json records it,
    and minitrain generate follows it unless told otherwise."""
    rows = tmp_path / "pc.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Note: Ana, {30 + i}, has asthma. Summarise.",
                                        "completion": f" Ana, {30 + i}, asthma."}) + "\n" for i in range(8)))
    out = tmp_path / "run"
    p = _run("-m", "minitrain", "recipes/sft_mistral.py", f"model={DEMO}", f"data={rows}", f"out={out}", "max_steps=1",
             "batch_size=2", f"prompt_completion={mode}")
    assert p.returncode == 0, p.stderr
    said = {"raw": "prompt / completion: 8 rows trained as plain text, not through the chat template — "
                   "prompt_completion=chat renders them through it as one user / assistant turn",
            "chat": "prompt / completion: 8 rows rendered as one user and one assistant turn by the checkpoint's "
                    "chat template (prompt_completion=chat)"}[mode]
    assert said in p.stdout and "chats:" not in p.stdout
    trained = json.loads((out / "config.json").read_text())["trained_format"]
    assert trained["prompts"] == mode and trained["rows"]["pair" if mode == "raw" else "pair_chat"] == 8
    prompt = "Note: Ben, 41, has gout. Summarise."
    auto = _run("-m", "minitrain", "generate", "--model", str(DEMO), "--adapter", str(out / "adapter"), "--prompt", prompt,
                "--max-new-tokens", "6")
    assert auto.returncode == 0, auto.stderr
    assert auto.stderr.startswith("note: prompts sent as " + ("plain text" if mode == "raw" else "the chat template"))
    chosen = _run("-m", "minitrain", "generate", "--model", str(DEMO), "--adapter", str(out / "adapter"), "--prompt", prompt,
                  "--max-new-tokens", "6", "--format", mode)
    other = _run("-m", "minitrain", "generate", "--model", str(DEMO), "--adapter", str(out / "adapter"), "--prompt", prompt,
                 "--max-new-tokens", "6", "--format", {"raw": "chat", "chat": "raw"}[mode])
    assert auto.stdout == chosen.stdout != other.stdout


def test_chat_template_key_trains_chats_on_a_model_without_one_and_travels_with_it(tmp_path):
    """A ChatML vocabulary without a template: chats are refused with advice naming chatml; with
    chat_template=chatml they train, and the full fine-tune's folder carries the template (transformers
    then renders the same ids)."""
    transformers = pytest.importorskip("transformers")
    from _tok import make_qwen_tokenizer
    from conftest import save_hf_causal

    from minitrain.text.chat_template import CHATML

    model = save_hf_causal(tmp_path / "qwen", model_type="qwen2", vocab_size=320)
    make_qwen_tokenizer(model)
    rows = tmp_path / "chats.jsonl"
    chat = [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi there"}]
    rows.write_text((json.dumps({"messages": chat}) + "\n") * 4)
    common = ["-m", "minitrain", "recipes/sft_llama.py", f"model={model}", f"data={rows}", "max_steps=1", "batch_size=2"]
    refused = _run(*common, f"out={tmp_path / 'refused'}")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "no chat template — give the template the model was trained with" in refused.stderr
    assert "chat_template=chatml" in refused.stderr and "chat_format" not in refused.stderr
    assert not (tmp_path / "refused").exists()
    out = tmp_path / "full"
    p = _run(*common, f"out={out}", "chat_template=chatml", "finetune=full")
    assert p.returncode == 0, p.stderr
    assert "chats: 4 rows rendered by the chat template chat_template=chatml" in p.stdout
    saved = out / "model" / "chat_template.jinja"
    assert saved.read_text() == CHATML
    ref = transformers.AutoTokenizer.from_pretrained(out / "model")
    from minitrain.text.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(out / "model")
    assert tok.encode_chat(chat)[0] == ref.apply_chat_template(chat, tokenize=True, return_dict=False)


def test_merge_keeps_the_base_dtype_and_notes_a_quantized_run(adapter, tmp_path):
    from safetensors.torch import load_file, save_file

    from minitrain.weights import read_header

    base = tmp_path / "bf16_base"
    shutil.copytree(DEMO, base)
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(base / "model.safetensors").items()},
              base / "model.safetensors")
    run = tmp_path / "run"
    shutil.copytree(adapter, run / "adapter")
    for dtype, want in (("auto", "BF16"), ("float32", "F32")):
        out = tmp_path / f"merged_{dtype}"
        p = _run("-m", "minitrain", "merge", "--model", str(base), "--adapter", str(run / "adapter"), "--out", str(out),
                 "--dtype", dtype)
        assert p.returncode == 0, p.stderr
        assert {i["dtype"] for i in read_header(out / "model.safetensors")[0].values()} == {want}
        assert json.loads((out / "config.json").read_text())["torch_dtype"] == {"BF16": "bfloat16", "F32": "float32"}[want]
    assert (tmp_path / "merged_float32" / "model.safetensors").stat().st_size > 1.9 * (
        tmp_path / "merged_auto" / "model.safetensors").stat().st_size

    (run / "config.json").write_text(json.dumps({"quantize": "nf4"}))  # what a QLoRA run writes beside its adapter
    p = _run("-m", "minitrain", "merge", "--model", str(base), "--adapter", str(run / "adapter"), "--out", str(tmp_path / "q"))
    assert p.returncode == 0 and p.stderr.startswith("note: the adapter was trained on a nf4 base")
    (run / "config.json").write_text(json.dumps({"quantize": "nf4", "lrc_rank": 0.15}))  # an LRC run
    p = _run("-m", "minitrain", "merge", "--model", str(base), "--adapter", str(run / "adapter"), "--out", str(tmp_path / "l"))
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "pass --quantize nf4" in p.stderr
    assert not (tmp_path / "l").exists()


def test_bench_data_measures_the_store_at_a_tiny_size(tmp_path):
    """tools/bench_data.py end to end on 300 rows (no datasets): builds with 1 and 2 workers, a cache hit,
    the in-memory path; its table names every figure. (The figures themselves are BENCHMARKS.md's.)"""
    p = subprocess.run([sys.executable, str(REPO / "tools" / "bench_data.py"), "--rows", "300", "--memory-rows", "300",
                        "--no-datasets", "--keep", str(tmp_path)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout
    for what in ("first build, 1 worker |", "first build, 2 workers |", "cache hit: open_or_build |",
                 "beyond the mapped store pages (RssAnon) |", "in memory (data_cache=false), 300 rows |"):
        assert what in out, out
    hit = json.loads(out.split("cache hit: ")[1].splitlines()[0].replace("'", '"'))
    assert hit["rows"] == 300 and hit["tokens"] > 300
    assert len([d for d in (tmp_path / "cache-w2").iterdir() if d.is_dir()]) == 1  # the hit built nothing new
