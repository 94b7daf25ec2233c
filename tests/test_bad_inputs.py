"""A corpus of bad inputs to `python -m minitrain recipes/sft_llama.py`: one line, exit 2, nothing written.

Each case in `tests/bad_inputs/cases.json` names its inputs (data files and recipes live in
`tests/bad_inputs/`; broken model folders are made here from the `hf_causal` fixture) and the
regex its one `error:` line must match. The contract is the user's (docs/design.md rule 9): exit code
2, exactly one line on stderr starting `error: `, no traceback, and the output folder absent or
unchanged byte for byte. Cases marked `"subprocess": true` run as a real `python -m minitrain`
process; the rest call `minitrain.cli.run_cli` in-process (the same code path minus interpreter
start-up, which costs seconds per case). Set MINITRAIN_BAD_INPUTS_SUBPROCESS=1 to run every case
as a subprocess.

Two inputs are accepted rather than refused, and their policy is tested here (see
`minitrain.data.readers`): a prompt longer than `max_len` is cut to `max_len // 2` tokens on
`truncation_side` and the completion fills the rest; a row left with no target token after
truncation is skipped and counted, and training goes on with finite losses.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _tok import make_bpe_tokenizer
from safetensors.torch import load_file, save_file

from test_moe import mxfp4_checkpoint  # noqa: F401  (a fixture)

from minitrain.cli import run_cli

REPO = Path(__file__).resolve().parents[1]
CASES_DIR = Path(__file__).resolve().parent / "bad_inputs"
CASES = json.loads((CASES_DIR / "cases.json").read_text(encoding="utf-8"))
RECIPE = str(REPO / "recipes" / "sft_llama.py")
ALL_SUBPROCESS = os.environ.get("MINITRAIN_BAD_INPUTS_SUBPROCESS") == "1"

# the command line every case starts from; a case's key=value args replace these
BASE = {"max_steps": "1", "batch_size": "2", "grad_accum": "1", "lora_r": "4", "lora_alpha": "8",
        "chat_format": "mistral", "device": "cpu"}


# ----------------------------------------------------------------------------- inputs


@pytest.fixture(scope="module")
def models_dir(hf_causal, tmp_path_factory, mxfp4_checkpoint) -> Path:  # noqa: F811
    """A good model folder (tiny HF LLaMA + BPE tokenizer, vocab 128) and broken copies of it; a tiny
    Qwen3-MoE and gpt-oss (MXFP4 experts) and broken copies of the MoE."""
    root = tmp_path_factory.mktemp("bad_models")
    good = root / "good"
    shutil.copytree(hf_causal("bad_inputs_llama"), good)
    make_bpe_tokenizer(good)

    def variant(name: str) -> Path:
        d = root / name
        shutil.copytree(good, d)
        return d

    config = json.loads((good / "config.json").read_text())
    d = variant("gpt2")
    (d / "config.json").write_text(json.dumps({**config, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    d = variant("gemma3")
    (d / "config.json").write_text(json.dumps({**config, "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}))
    d = variant("config_not_json")
    (d / "config.json").write_text((good / "config.json").read_text()[:40])
    d = variant("pickle_only")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    d = variant("truncated")
    data = (good / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    d = variant("no_tokenizer")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / f).unlink(missing_ok=True)

    tensors = load_file(good / "model.safetensors")
    d = variant("wrong_shape")
    key = "model.layers.0.mlp.gate_proj.weight"
    save_file({**tensors, key: tensors[key].t().contiguous()}, d / "model.safetensors", metadata={"format": "pt"})
    d = variant("small_embedding")  # 100 rows for a 128-id tokenizer
    small = {k: (t[:100].contiguous() if k in ("model.embed_tokens.weight", "lm_head.weight") else t)
             for k, t in tensors.items()}
    save_file(small, d / "model.safetensors", metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))

    d = variant("int_weight")  # a float weight saved as integers
    save_file({**tensors, key: tensors[key].to(torch.int64)}, d / "model.safetensors", metadata={"format": "pt"})
    d = variant("other_weights")  # the same shapes and tokenizer, other values (another fine-tune)
    save_file({k: t + 0.01 for k, t in tensors.items()}, d / "model.safetensors", metadata={"format": "pt"})
    d = variant("other_tokenizer")  # the same weights, tokenizer files that differ
    tc = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tc, "model_max_length": 77}))

    from test_moe import hub_checkpoint

    def moe(name: str, src: Path) -> Path:
        d = root / name
        shutil.copytree(src, d)
        make_bpe_tokenizer(d)
        return d

    moe("gpt_oss_mxfp4", mxfp4_checkpoint)
    from test_qwen3_5 import QWEN35

    moe("qwen3_5", hf_causal("qwen3_5", **QWEN35))  # (the same folder as tests/test_qwen3_5.py's)
    d = moe("moe_unknown_field", hub_checkpoint(hf_causal, "qwen3_moe"))  # a field that would change the routing
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), "moe_layer_freq": 2}))
    d = moe("moe_missing_expert", hub_checkpoint(hf_causal, "qwen3_moe"))
    experts = load_file(d / "model.safetensors")
    del experts["model.layers.0.mlp.experts.5.up_proj.weight"]
    save_file(experts, d / "model.safetensors", metadata={"format": "pt"})

    import models
    from minitrain.weights import load_pretrained, save_pretrained

    d = root / "missing_shard"
    save_pretrained(load_pretrained(good, models.from_hf_config), d, config, max_shard_bytes=160_000)
    for f in good.glob("tokenizer*"):
        shutil.copy(f, d / f.name)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values()))[-1] == "model-00003-of-00003.safetensors", index
    (d / "model-00002-of-00003.safetensors").unlink()
    return root


@pytest.fixture(scope="module")
def adapter_other_base(tmp_path_factory) -> Path:
    """A LoRA adapter saved for a LLaMA of hidden size 32 (ours is 64), same vocabulary."""
    import models
    from minitrain.adapters.lora import LoRAConfig, apply_lora
    from minitrain.adapters.peft_format import save_adapter

    cfg = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
           "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    model = models.from_hf_config(cfg)
    lcfg = LoRAConfig(r=4, alpha=8, targets=["q_proj", "v_proj"])
    apply_lora(model, lcfg)
    return save_adapter(model, tmp_path_factory.mktemp("other_base") / "adapter", lcfg)


def base_args(model: Path, out: Path) -> dict[str, str]:
    return {"model": str(model), "data": str(CASES_DIR / "data" / "good.jsonl"), "out": str(out), **BASE}


@pytest.fixture(scope="module")
def trained(models_dir, tmp_path_factory) -> Path:
    """A finished one-step run of the base command line (config.json, metrics, checkpoint, adapter)."""
    out = tmp_path_factory.mktemp("trained") / "out"
    argv = [RECIPE] + [f"{k}={v}" for k, v in base_args(models_dir / "good", out).items()]
    assert run_cli(argv) == 0
    assert (out / "checkpoint" / "state.json").is_file() and (out / "adapter").is_dir()
    return out


def fake_bitsandbytes(folder: Path) -> Path:
    """A `bitsandbytes` package that fails to import, to put first on PYTHONPATH."""
    pkg = folder / "no_bnb" / "bitsandbytes"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text('raise ImportError("No module named \'bitsandbytes\' (simulated by tests)")\n')
    return pkg.parent


def snapshot(path: Path):
    """Everything under `path`, byte for byte (None if it does not exist)."""
    if not path.exists():
        return None
    if path.is_file():
        return path.read_bytes()
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else "<dir>") for p in sorted(path.rglob("*"))}


# ----------------------------------------------------------------------------- the corpus


def command_line(case: dict, model: Path, out: Path, fill) -> list[str]:
    keys = base_args(model, out)
    raw: list[str] = []
    for arg in case.get("args", []):
        arg = fill(arg)
        if case.get("raw"):
            raw.append(arg)
        else:
            k, _, v = arg.partition("=")
            keys[k] = v
    recipe = fill(case["recipe"]) if "recipe" in case else RECIPE
    return [recipe] + [f"{k}={v}" for k, v in keys.items()] + raw


def test_corpus_is_well_formed():
    ids = [c["id"] for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    for c in CASES:
        assert set(c) <= {"id", "what", "args", "model", "recipe", "out", "env", "subprocess", "raw", "error"}, c
        re.compile(c["error"])
        for arg in c.get("args", []):
            m = re.search(r"\{cases\}/([^ ]+)", arg)
            if m:
                assert (CASES_DIR / m.group(1)).exists(), arg
    assert any(c.get("subprocess") for c in CASES)


def as_two_parts(ck: Path) -> None:
    """Lay a one-process checkpoint out as 2 FSDP ranks save it (each rank's rows in its own part)."""
    from safetensors.torch import load_file

    from minitrain.parallel import checkpoint_shards as shards

    for stem in ("weights", "optimizer"):
        whole = load_file(ck / f"{stem}.safetensors")
        for r in (0, 1):
            part, rows = {}, {}
            for name, t in whole.items():
                a, b = shards.chunk_rows(t.shape[0], 2, r)
                if b > a:
                    part[name], rows[name] = t[a:b].contiguous(), [a, *t.shape]
            shards.write_part(ck / shards.part_file(stem, r), part, rows, r, 2)
        (ck / f"{stem}.safetensors").unlink()
    shutil.copy(ck / "rng.safetensors", ck / "rng.rank1.safetensors")
    state = json.loads((ck / "state.json").read_text())
    state.update(parts=2, world_size=2, rng=state["rng"] * 2)
    (ck / "state.json").write_text(json.dumps(state))


def test_the_two_part_layout_resumes_as_the_whole_files_do(models_dir, trained, tmp_path, capsys):
    """The layout `resume_missing_part` damages, whole: a CLI resume (one more step, extend=true) from it
    trains the same adapter, bitwise, as from the whole files it was made of, and says the world changed."""
    adapters = []
    for name in ("whole", "parts"):
        out = tmp_path / name
        shutil.copytree(trained, out)
        if name == "parts":
            as_two_parts(out / "checkpoint")
        keys = {**base_args(models_dir / "good", out), "resume": "true", "extend": "true",
                "max_steps": str(int(BASE["max_steps"]) + 1)}
        assert run_cli([RECIPE] + [f"{k}={v}" for k, v in keys.items()]) == 0, capsys.readouterr().err
        printed = capsys.readouterr().out
        assert ("saved by 2 processes, this run has 1" in printed) == (name == "parts")
        adapters.append(load_file(out / "adapter" / "adapter_model.safetensors"))
    assert adapters[0].keys() == adapters[1].keys()
    assert all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])
    before = load_file(trained / "adapter" / "adapter_model.safetensors")
    assert not all(torch.equal(before[k], adapters[0][k]) for k in before)  # the extra step moved it


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_bad_input(case, models_dir, adapter_other_base, trained, tmp_path, capsys):
    model = models_dir / case.get("model", "good")
    out = tmp_path / "out"
    kind = case.get("out", "fresh")
    if kind == "trained":
        shutil.copytree(trained, out)
    elif kind == "no_checkpoint":  # killed after logging step 1, before saving it
        out.mkdir()
        for name in ("config.json", "metrics.jsonl"):
            shutil.copy(trained / name, out / name)
    elif kind == "not_a_run":
        out.mkdir()
        (out / "notes.txt").write_text("my notes")
    elif kind == "file":
        out.write_text("not a folder")
    elif kind in ("damaged_state", "state_without_optimizer_scalars", "damaged_weights"):
        shutil.copytree(trained, out)
        ck = out / "checkpoint"
        if kind == "damaged_state":
            (ck / "state.json").write_text((ck / "state.json").read_text()[:50])
        elif kind == "state_without_optimizer_scalars":
            state = json.loads((ck / "state.json").read_text())
            del state["optimizer_scalars"]
            (ck / "state.json").write_text(json.dumps(state))
        else:
            (ck / "weights.safetensors").write_bytes((ck / "weights.safetensors").read_bytes()[:100])
    elif kind == "missing_part":  # a checkpoint of 2 FSDP ranks whose rank 1 weights part is not there
        shutil.copytree(trained, out)
        as_two_parts(out / "checkpoint")
        (out / "checkpoint" / "weights.rank1.safetensors").unlink()
    else:
        assert kind == "fresh", kind
    before = snapshot(out)

    def fill(text: str) -> str:
        return text.format(cases=CASES_DIR, tmp=tmp_path, adapter_other_base=adapter_other_base, repo=REPO)

    argv = command_line(case, model, out, fill)
    if case.get("subprocess") or case.get("env") or ALL_SUBPROCESS:
        path = [str(REPO)]
        if case.get("env") == "no_bitsandbytes":
            path.insert(0, str(fake_bitsandbytes(tmp_path)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        p = subprocess.run([sys.executable, "-m", "minitrain", *argv], cwd=REPO, env=env,
                           capture_output=True, text=True)
        code, err = p.returncode, p.stderr
    else:
        code = run_cli(argv)
        err = capsys.readouterr().err

    assert "Traceback" not in err, err
    assert code == 2, f"exit code {code}, stderr:\n{err}"
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"expected one error line, got:\n{err}"
    assert re.search(case["error"], lines[0]), f"\n{lines[0]}\ndoes not match\n{case['error']}"
    assert snapshot(out) == before, "the output folder was created or changed"


# ----------------------------------------------------------------------------- accepted with a policy


def test_long_prompt_truncated_and_targetless_row_skipped(models_dir, tmp_path, capsys):
    """A prompt longer than max_len loses tokens on truncation_side (right: its end) down to what
    leaves room for the completion, but not below max_len // 2; it is counted. A chat row left
    with no assistant token is skipped and counted; training runs on the rest with finite losses."""
    from minitrain.data.collate import IGNORE_INDEX
    from minitrain.data.readers import read_sft
    from minitrain.text.tokenizer import Tokenizer

    data = CASES_DIR / "data" / "truncation.jsonl"
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    tok = Tokenizer.from_folder(models_dir / "good", chat_format="mistral")
    max_len = 48
    ex = read_sft(data, tok, max_len=max_len, truncation_side="right")
    assert (len(ex), ex.truncated, ex.skipped) == (3, 2, 1)  # the long chat: truncated, then skipped
    long = ex[2]
    prompt = [tok.bos_id] + tok.encode(rows[2]["prompt"])
    completion = tok.encode(rows[2]["completion"], continuation=True) + [tok.eos_id]
    assert len(prompt) > max_len  # the case really is a prompt longer than max_len
    keep = max(max_len - len(completion), max_len // 2)
    assert long["input_ids"] == prompt[:keep] + completion[: max_len - keep]  # the prompt's beginning
    assert long["labels"] == [IGNORE_INDEX] * keep + completion[: max_len - keep]
    # and with a completion that leaves less than half: the prompt keeps max_len // 2
    short = read_sft(data, tok, max_len=8, truncation_side="left")
    p8 = [tok.bos_id] + tok.encode(rows[2]["prompt"])
    assert short[2]["input_ids"][:4] == p8[:1] + p8[-3:]  # left: bos kept, then the prompt's end
    assert short[2]["labels"][4:] == completion[:4]

    out = tmp_path / "out"
    args = {**base_args(models_dir / "good", out), "data": str(data), "max_len": str(max_len),
            "truncation_side": "right", "max_steps": "2"}
    code = run_cli([RECIPE] + [f"{k}={v}" for k, v in args.items()])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    assert f"data (train): 3 examples from {data}, 2 truncated to max_len=48, 1 skipped (no target token left)" in stdout
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses


def test_an_all_padding_batch_is_never_trained_on(models_dir):
    """The skip is what keeps a batch from being all -100 (a 0/0 NaN loss): every example kept
    by the reader has a target after the causal shift."""
    from minitrain.data.collate import IGNORE_INDEX
    from minitrain.data.readers import read_sft
    from minitrain.text.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(models_dir / "good", chat_format="mistral")
    for max_len in (2, 3, 8, 16):
        for side in ("left", "right"):
            ex = read_sft(CASES_DIR / "data" / "truncation.jsonl", tok, max_len=max_len, truncation_side=side)
            assert all(any(x != IGNORE_INDEX for x in e["labels"][1:]) for e in ex), (max_len, side)
            assert len(ex) + ex.skipped == 4


def test_identical_dpo_pairs_dropped_on_request_and_counted(models_dir, tmp_path, capsys):
    """drop_identical_pairs=true: the identical pair is left out and counted; the run trains on the
    rest. Such a pair is worthless by the formula: -log sigmoid(beta * 0) = ln 2 whatever the
    policy, so its gradient is exactly zero (checked with autograd)."""
    import torch.nn.functional as F

    from minitrain.data.readers import read_preference
    from minitrain.text.tokenizer import Tokenizer

    data = CASES_DIR / "data" / "identical_pair.jsonl"
    tok = Tokenizer.from_folder(models_dir / "good", chat_format="mistral")
    ex = read_preference(data, tok, max_len=64, drop_identical=True)
    assert (len(ex), ex.identical) == (2, 1)
    logp = torch.tensor(-3.0, requires_grad=True)  # the same answer: the same log-prob on both sides
    loss = -F.logsigmoid(0.1 * ((logp - (-3.5)) - (logp - (-3.5))))
    loss.backward()
    assert float(loss.detach()) == pytest.approx(math.log(2)) and float(logp.grad) == 0.0

    out = tmp_path / "out"
    args = {**base_args(models_dir / "good", out), "data": str(data), "drop_identical_pairs": "true", "eval_data": ""}
    code = run_cli([str(REPO / "recipes" / "dpo_mistral.py")] + [f"{k}={v}" for k, v in args.items()])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    assert f"data (train): 2 examples from {data}, 1 dropped (chosen == rejected)" in stdout
