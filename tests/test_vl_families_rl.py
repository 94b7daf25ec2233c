"""DPO, KTO and GRPO with images on a tiny multimodal Gemma 3 (the folder of tests/test_gemma3_vl.py), a tiny
Qwen3-VL, Qwen3-VL-MoE and multimodal Qwen3.5 (tests/test_image_rows.py's) and a tiny multimodal Gemma 4
(tests/test_gemma4_vl.py's), the rows of tests/test_vl_preference.py, tests/test_vl_kto.py and
tests/test_vl_grpo.py (whose TRL parity runs on Qwen2.5-VL; the code is the same for every family: only the
image processing, the placeholders and the tower differ).

- Image prompts read by `read_prompts` are the ids transformers' `Gemma3Processor` makes of the same chats and
  images (`\\n\\n<start_of_image>` + soft tokens + `<end_of_image>\\n\\n`), and greedy sampling (G = 2 rows per
  prompt from one prefill) equals transformers' `generate` given the pixel values.
- The three recipes train LoRA on each folder from the command line; DPO's first loss is ln 2 and KTO's 0.5
  exactly (policy == reference), which holds only if the reference saw the images the policy saw.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_gemma3_vl import g3_folder
from test_gemma4_vl import g4_folder
from test_image_rows import vl_folder, write_images
from test_vl_grpo import PROMPTS, REWARDS
from test_vl_kto import ROWS
from test_vl_preference import PAIRS, cli_run

import models
from minitrain.data.images import ImageRows
from minitrain.data.readers import read_prompts
from minitrain.objectives.grpo import collate_prompts
from minitrain.objectives.sampling import sample
from minitrain.objectives.sft import image_inputs
from minitrain.run import with_images
from minitrain.text.tokenizer import Tokenizer

DATA = {"prefs.jsonl": [ours for ours, _ in PAIRS], "rows.jsonl": [ours for ours, _ in ROWS], "prompts.jsonl": PROMPTS}


def rl_files(root: Path, folder) -> dict[str, Path]:
    """root/data: the images and the three data files; root/rewards.py; root/model: `folder(root / "model")`."""
    write_images(root / "data")
    for name, rows in DATA.items():
        (root / "data" / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "rewards.py").write_text(REWARDS)
    return {"root": root, "model": folder(root / "model")}


@pytest.fixture(scope="module")
def g3(tmp_path_factory) -> dict[str, Path]:
    return rl_files(tmp_path_factory.mktemp("vl_gemma3_rl"), g3_folder)


@pytest.fixture(scope="module")
def g4(tmp_path_factory) -> dict[str, Path]:
    return rl_files(tmp_path_factory.mktemp("vl_gemma4_rl"), g4_folder)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> dict[str, Path]:
    return rl_files(tmp_path_factory.mktemp("vl_qwen3_rl"), lambda d: vl_folder(d, "qwen3_vl"))


@pytest.fixture(scope="module")
def qwen3moe(tmp_path_factory) -> dict[str, Path]:
    return rl_files(tmp_path_factory.mktemp("vl_qwen3_vl_moe_rl"), lambda d: vl_folder(d, "qwen3_vl_moe"))


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory) -> dict[str, Path]:
    return rl_files(tmp_path_factory.mktemp("vl_qwen3_5_rl"), lambda d: vl_folder(d, "qwen3_5"))


def test_image_prompts_and_greedy_sampling_equal_transformers(g3):
    import transformers
    from PIL import Image

    tok = Tokenizer.from_folder(g3["model"])
    config = json.loads((g3["model"] / "config.json").read_text())
    pre = json.loads((g3["model"] / "preprocessor_config.json").read_text())
    images = ImageRows.from_checkpoint(config, pre, lambda i: tok.decode([i], skip_special=False))
    examples = read_prompts(g3["root"] / "data" / "prompts.jsonl", tok, max_len=256, images=images)
    batch = with_images(lambda ex: collate_prompts(ex, pad_id=tok.pad_id), images, group=2)(examples)
    ids, mask = batch["prompt_ids"], batch["prompt_attention_mask"]

    processor = transformers.AutoProcessor.from_pretrained(g3["model"])
    chats = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Count."}]}],
             [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                           {"type": "text", "text": "Which is taller, and why so?"}]}]]
    pics = [[Image.open(g3["root"] / "data" / "img" / n).convert("RGB") for n in names]
            for names in (["a.png"], ["c.png", "b.png"])]
    texts = [processor.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    ref = processor(text=texts, images=pics, padding=True, padding_side="left", return_tensors="pt",
                    add_special_tokens=False)
    assert torch.equal(ids, ref["input_ids"]) and torch.equal(mask, ref["attention_mask"])
    assert torch.allclose(batch["pixel_values"], ref["pixel_values"], atol=1e-6)

    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(g3["model"], dtype=torch.float32).eval()
    want = hf.generate(input_ids=ids, attention_mask=mask, pixel_values=batch["pixel_values"],
                       token_type_ids=(ids == images.token_id).long(), max_new_tokens=6, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[:, ids.shape[1]:]
    from minitrain.weights import load_pretrained

    ours = load_pretrained(g3["model"], models.from_hf_config)
    got = sample(ours, ids, mask, new_cache=models.family(ours).KVCache, num_generations=2, max_new_tokens=6,
                 greedy=True, images=image_inputs(batch))
    assert torch.equal(got.ids, want.repeat_interleave(2, 0))


@pytest.mark.parametrize("recipe,data,args,first", [
    ("dpo_mistral.py", "prefs.jsonl", ["batch_size=2"], math.log(2)),
    ("kto_mistral.py", "rows.jsonl", ["batch_size=3"], 0.5),
    ("grpo_qwen.py", "prompts.jsonl", ["batch_size=2", "num_generations=2", "max_completion_length=4",
                                       "rewards={root}/rewards.py:image_count"], None)])
@pytest.mark.parametrize("family", ["g3", "qwen3", "qwen3moe", "qwen35", "g4"])
def test_lora_from_the_cli_with_images(request, capsys, family, recipe, data, args, first):
    g3 = request.getfixturevalue(family)
    out = g3["root"] / recipe.removesuffix(".py")
    rows = cli_run(recipe, [f"model={g3['model']}", f"data={g3['root'] / 'data' / data}", "max_steps=2",
                            *(a.format(root=g3["root"]) for a in args)], out, capsys)
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    if first is not None:
        assert rows[0]["loss"] == pytest.approx(first, abs=1e-6)
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("family", ["g4", "qwen35"])
def test_full_fine_tuning_on_text_rows_keeps_the_towers_frozen(request, capsys, family):
    """`finetune=full` of ORPO (DPO's recipe; a reference-free loss, as full fine-tuning needs) on text-only pairs
    of a vision-language folder: no loss reaches the towers, so they stay frozen (the audit healthy, not an
    unreachable tower) and the written folder holds them bit for bit, while the language model trains."""
    from safetensors.torch import load_file

    vl = request.getfixturevalue(family)
    root = vl["root"] / "text_orpo"
    root.mkdir()
    rows = [{"prompt": "Say yes.", "chosen": "yes", "rejected": "no"},
            {"prompt": "Say no.", "chosen": "no", "rejected": "yes"}]
    (root / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    cli_run("dpo_mistral.py", [f"model={vl['model']}", f"data={root / 'rows.jsonl'}", "max_steps=1", "batch_size=2",
                               "finetune=full", "loss_type=orpo"], root / "out", capsys)
    model = models.from_hf_config(json.loads((vl["model"] / "config.json").read_text()))
    towers = tuple(f"{t}." for t in model.towers)
    before = load_file(vl["model"] / "model.safetensors")
    after = load_file(next((root / "out").rglob("model.safetensors")))
    frozen = [k for k in before if k.startswith(towers)]
    assert frozen and all(torch.equal(after[k], before[k]) for k in frozen)
    assert any(not torch.equal(after[k], before[k]) for k in before if ".language_model." in k)
