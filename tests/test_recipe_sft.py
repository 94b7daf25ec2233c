"""recipes/sft_llama.py end to end on a tiny LLaMA saved by transformers.

One real `python -m minitrain recipes/sft_llama.py ...` run (module fixture) is checked for
what it writes; its output folder then serves the refusal tests. The adapter it saves is loaded
by PEFT onto the transformers model and must give our model's logits.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _tok import corpus, make_bpe_tokenizer

from minitrain.cli import run_cli
from minitrain.config import SFTConfig, from_json

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "sft_llama.py")
METRIC_KEYS = ("step", "loss", "lr", "grad_norm", "tokens", "target_tokens")


def write_rows(path: Path) -> Path:
    """12 rows mixing the three SFT shapes."""
    lines = corpus(36, seed=1)
    rows = []
    for i in range(12):
        a, b = lines[3 * i], lines[3 * i + 1]
        if i % 3 == 0:
            rows.append({"prompt": a, "completion": " " + b})
        elif i % 3 == 1:
            rows.append({"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b}]})
        else:
            rows.append({"text": a + " " + b})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tiny(hf_causal, tmp_path_factory) -> dict[str, Path]:
    """A model folder (tiny HF LLaMA + tiny BPE tokenizer) and a JSONL file."""
    root = tmp_path_factory.mktemp("sft_recipe")
    model = root / "model"
    shutil.copytree(hf_causal("sft_recipe_llama"), model)
    make_bpe_tokenizer(model)
    return {"root": root, "model": model, "data": write_rows(root / "train.jsonl")}


def args(tiny: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """The smoke run's command line, with `extra` key=value settings replacing its own."""
    keys = {"model": tiny["model"], "data": tiny["data"], "out": out, "max_steps": 3, "batch_size": 2,
            "grad_accum": 1, "lora_r": 4, "lora_alpha": 8, "chat_format": "mistral"}
    keys.update(e.split("=", 1) for e in extra)
    return [RECIPE] + [f"{k}={v}" for k, v in keys.items()]


@pytest.fixture(scope="module")
def smoke(tiny) -> tuple[subprocess.CompletedProcess, Path]:
    out = tiny["root"] / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-m", "minitrain", *args(tiny, out)], cwd=REPO, env=env,
                       capture_output=True, text=True)
    return p, out


def one_error(code: int, err: str, needle: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert needle in lines[0], lines[0]
    return lines[0]


def cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = run_cli(argv)
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------- the run


def test_smoke_run_writes_metrics_config_adapter(smoke, tiny):
    p, out = smoke
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert all(k in r for k in METRIC_KEYS), r
        assert math.isfinite(r["loss"]) and r["loss"] > 0 and r["lr"] > 0 and r["target_tokens"] > 0

    cfg = from_json((out / "config.json").read_text(), SFTConfig)  # the recipe's class
    assert (cfg.max_steps, cfg.batch_size, cfg.lora_r, cfg.chat_format) == (3, 2, 4, "mistral")
    assert cfg.model == str(tiny["model"]) and cfg.out == str(out)
    assert cfg.lr == 2e-4  # the recipe's own value where not overridden

    adapter = out / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file()
    acfg = json.loads((adapter / "adapter_config.json").read_text())
    assert acfg["peft_type"] == "LORA" and acfg["r"] == 4 and acfg["lora_alpha"] == 8
    assert set(acfg["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert (out / "checkpoint" / "state.json").is_file()
    assert f"adapter (PEFT format): {adapter}" in p.stdout


def test_saved_adapter_loads_in_peft_with_our_logits(smoke, tiny):
    """The adapter the recipe wrote is PEFT's format: PEFT + transformers reproduce our model."""
    import peft
    import transformers

    import models
    from minitrain.adapters.peft_format import load_adapter
    from minitrain.weights import load_pretrained

    _, out = smoke
    ours = load_pretrained(tiny["model"], models.from_hf_config).eval()
    load_adapter(ours, out / "adapter")
    assert any(m.lora_B.weight.abs().max() > 0 for m in ours.modules() if hasattr(m, "lora_B")), \
        "training moved no lora_B away from zero: the comparison would not test the adapter"
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny["model"], torch_dtype=torch.float32)
    ref = peft.PeftModel.from_pretrained(ref, out / "adapter").eval()
    ids = torch.tensor([[1, 17, 42, 99, 5, 63, 2]])
    with torch.no_grad():
        got = ours.output_projection(ours(ids, torch.ones_like(ids)))
        want = ref(input_ids=ids).logits
        base = ref.get_base_model()
        with ref.disable_adapter():
            without = base(input_ids=ids).logits
    assert not torch.allclose(without, want, atol=1e-5)  # the adapter changes the output
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- the output folder


def test_refuses_a_different_run_and_touches_nothing(capsys, smoke, tiny):
    _, out = smoke
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    code, _, err = cli(capsys, args(tiny, out, "lr=1e-3", "seed=3"))
    one_error(code, err, f"{out}: holds a different run (config differs in lr, seed) — pass overwrite=true")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_refuses_to_rerun_the_same_config_silently(capsys, smoke, tiny):
    _, out = smoke
    code, _, err = cli(capsys, args(tiny, out))
    one_error(code, err, f"{out}: holds a run of this same config")


def test_overwrite_replaces_the_previous_run(capsys, smoke, tiny, tmp_path):
    _, out = smoke
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    code, stdout, err = cli(capsys, args(tiny, copy, "max_steps=1", "lr=1e-3", "overwrite=true"))
    assert code == 0, err
    rows = (copy / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1]
    cfg = json.loads((copy / "config.json").read_text())
    assert cfg["max_steps"] == 1 and cfg["lr"] == 1e-3
    assert (copy / "adapter" / "adapter_config.json").is_file()
    assert "done: step 1/1" in stdout


def test_refuses_a_folder_that_is_not_a_run(capsys, tiny, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    code, _, err = cli(capsys, args(tiny, tmp_path))
    one_error(code, err, f"{tmp_path}: is not empty and holds no minitrain run")


def test_resume_without_checkpoint(capsys, tiny, tmp_path):
    code, _, err = cli(capsys, args(tiny, tmp_path / "fresh", "resume=true"))
    one_error(code, err, "holds no checkpoint to resume from — run without resume=true")
    assert not (tmp_path / "fresh").exists()


# ----------------------------------------------------------------------------- bad input: one line, nothing written


def bad_rows(tmp_path: Path) -> Path:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "a b", "completion": " c"}\n{"prompt": "a b"}\n')
    return p


@pytest.mark.parametrize("override,needle", [
    (lambda t, tmp: "model=", "model: not set"),
    (lambda t, tmp: f"model={tmp / 'nowhere'}", "nowhere: no such model folder"),
    (lambda t, tmp: "data=", "data: not set"),
    (lambda t, tmp: f"data={tmp / 'none.jsonl'}", "none.jsonl: no such file"),
    (lambda t, tmp: f"data={bad_rows(tmp)}", 'bad.jsonl:2: missing key "completion"'),
    (lambda t, tmp: "chat_format=auto", "no chat template — give the template the model was trained with"),  # {"messages"} rows, tokenizer without one
    (lambda t, tmp: "lora_targets=qq_proj", "match no module of the model"),
    (lambda t, tmp: "device=cuda:7" if not torch.cuda.is_available() else "device=cuda:99", "device=cuda:"),
])
def test_bad_input_is_one_line_and_writes_nothing(capsys, tiny, tmp_path, override, needle):
    out = tmp_path / "out"
    code, _, err = cli(capsys, args(tiny, out, override(tiny, tmp_path)))
    one_error(code, err, needle)
    assert not out.exists()


def test_recipe_help(capsys):
    code, out, _ = cli(capsys, [RECIPE, "--help"])
    assert code == 0
    assert "SFT: supervised fine-tuning" in out and "python -m minitrain recipes/sft_llama.py model=" in out
    assert "  lora_targets: list[str] = q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj" in out
