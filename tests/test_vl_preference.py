"""DPO on pairs whose prompt carries images, against TRL 1.16's own vision path, on a tiny Qwen2.5-VL.

The reference: `trl.DPOTrainer` given the model, a `Qwen2_5_VLProcessor` (built without its video processor,
which needs torchvision) and a LoRA `peft_config`: its `DataCollatorForVisionPreference` renders and tokenizes
the pairs and processes the images (each pair's images in its chosen and its rejected row), its `_compute_loss`
scores the policy and the reference (the adapter disabled). The same pairs are read by `read_preference` from a
JSON-lines file (paths beside it; TRL's shapes: an `images` column with `{"type": "image"}` parts, image parts
with a path, an `images` column beside plain-text messages) and collated by the DPO recipe's collator. Compared,
to 1e-5: the token ids, the loss, TRL's metrics and every LoRA gradient, with the adapter moved off its
initialisation (B = 0 would make policy and reference equal). Then one LoRA run of recipes/dpo_mistral.py from
the command line on the folder (its first loss ln 2 exactly: the reference saw the images the policy saw), and
the one-line refusals of `shared_prompt=true` and `packing=true` with image pairs.
"""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path

import pytest
import torch
from test_image_rows import PRE, REPO, vl_folder, write_images

import models
from minitrain.adapters.peft_format import load_adapter
from minitrain.cli import run_cli
from minitrain.data.images import ImageRows
from minitrain.data.readers import read_preference
from minitrain.objectives.dpo import collate_with_reference, make_dpo_objective
from minitrain.objectives.reference import BaseReference
from minitrain.run import with_images
from minitrain.text.tokenizer import Tokenizer
from minitrain.weights import load_pretrained

pytest.importorskip("trl")

# the chat template of the folder and the processor: Qwen2-VL's rendering of content parts (minitrain renders the
# string contents it makes of them), ChatML otherwise, without the newline after <|im_end|>: TRL scores every token
# after the prompt, minitrain's chat mask the assistant's turn up to its end token
TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
            "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
            "{%- for part in message['content'] %}{%- if part['type'] == 'image' %}"
            "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- else %}{{- part['text'] }}{%- endif %}"
            "{%- endfor %}{%- endif %}{{- '<|im_end|>' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
TRL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def text(s: str) -> dict:
    return {"type": "text", "text": s}


# (ours: the row in the file, TRL: the row with its images column) of three pairs
PAIRS = [
    ({"images": ["img/a.png"], "prompt": user({"type": "image"}, text("What is it?")),
      "chosen": [{"role": "assistant", "content": "A red cat."}],
      "rejected": [{"role": "assistant", "content": [text("Nothing at all here.")]}]},
     {"images": ["img/a.png"], "prompt": user({"type": "image"}, text("What is it?")),
      "chosen": [{"role": "assistant", "content": "A red cat."}],
      "rejected": [{"role": "assistant", "content": "Nothing at all here."}]}),
    ({"prompt": user(text("Compare "), {"type": "image", "image": "img/c.png"}, text(" and "),
                     {"type": "image", "image": "img/b.png"}),
      "chosen": [{"role": "assistant", "content": "The second is taller."}],
      "rejected": [{"role": "assistant", "content": "Same."}]},
     {"images": ["img/c.png", "img/b.png"], "prompt": user(text("Compare "), {"type": "image"}, text(" and "),
                                                             {"type": "image"}),
      "chosen": [{"role": "assistant", "content": "The second is taller."}],
      "rejected": [{"role": "assistant", "content": "Same."}]}),
    ({"images": ["img/b.png"], "prompt": [{"role": "user", "content": "Describe it."}],
      "chosen": [{"role": "assistant", "content": "Blue."}],
      "rejected": [{"role": "assistant", "content": "Green and very tall."}]},
     {"images": ["img/b.png"], "prompt": [{"role": "user", "content": "Describe it."}],
      "chosen": [{"role": "assistant", "content": "Blue."}],
      "rejected": [{"role": "assistant", "content": "Green and very tall."}]}),
]


def vl_files(root: Path, name: str, rows: list[dict]) -> dict[str, Path]:
    """root/data/img/*.png (`write_images`), root/data/<name> (`rows` as JSON lines) and root/model: the tiny
    Qwen2.5-VL folder of tests/test_image_rows.py with `TEMPLATE` as its chat template."""
    write_images(root / "data")
    data = root / "data" / name
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    model = vl_folder(root / "model")
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return {"root": root, "model": model, "data": data}


@pytest.fixture(scope="module")
def vl(tmp_path_factory) -> dict[str, Path]:
    return vl_files(tmp_path_factory.mktemp("vl_preference"), "prefs.jsonl", [ours for ours, _ in PAIRS])


def processor(folder: Path):
    """transformers' Qwen2.5-VL processor of the folder: its tokenizer, the Pillow image processor with the
    folder's settings, `TEMPLATE`; no video processor (it needs torchvision)."""
    import transformers

    class Processor(transformers.Qwen2_5_VLProcessor):
        def check_argument_for_proper_class(self, name, arg):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, arg)

    image = transformers.Qwen2VLImageProcessorPil(**{k: v for k, v in PRE.items() if k != "image_processor_type"})
    return Processor(image_processor=image, tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
                     chat_template=TEMPLATE)


def with_pictures(root: Path, rows: list[dict]) -> list[dict]:
    """TRL's rows: each row's `images` column of paths as the Pillow images."""
    from PIL import Image

    return [{**row, "images": [Image.open(root / "data" / p).convert("RGB") for p in row["images"]]} for row in rows]


def trl_rows(root: Path) -> list[dict]:
    return with_pictures(root, [row for _, row in PAIRS])


def trl_lora_trainer(name: str, vl: dict[str, Path], rows: list[dict], seed: int, **settings):
    """TRL's `<name>Trainer` (DPO, KTO) on the folder's model with the processor and a fresh LoRA on q_proj / v_proj,
    its B drawn at random (`seed`) and saved in root/moved (a fresh B = 0 would make policy and reference equal)."""
    import datasets
    import peft
    import transformers
    import trl

    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(vl["model"], dtype=torch.float32)
    args = getattr(trl, f"{name}Config")(output_dir=str(vl["root"] / "trl"), report_to=[], use_cpu=True, bf16=False,
                                         beta=0.1, gradient_checkpointing=False, disable_tqdm=True, max_length=None,
                                         **settings)
    trainer = getattr(trl, f"{name}Trainer")(
        model=model, args=args, train_dataset=datasets.Dataset.from_list(rows[:1] * 3),
        processing_class=processor(vl["model"]),
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    trainer.model.save_pretrained(str(vl["root"] / "moved"))
    return trainer


def trl_step(trainer, inputs: dict, metrics: tuple[str, ...]) -> tuple[torch.Tensor, dict, dict]:
    """TRL's loss on `inputs` (its `_compute_loss`, backward run), the metrics it logged, its LoRA gradients by
    our parameter names."""
    trainer.model.zero_grad()
    trainer._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    loss = trainer._compute_loss(trainer.model, inputs, False)
    loss.backward()
    grads = {n.replace("base_model.model.", "").replace(".default", ""): p.grad
             for n, p in trainer.model.named_parameters() if p.requires_grad}
    return loss, {k: trainer._metrics["train"][k][-1] for k in metrics}, grads


def moved_model(vl: dict[str, Path]):
    """Our model of the folder with TRL's moved adapter (`trl_lora_trainer`) loaded to train."""
    model = load_pretrained(vl["model"], models.from_hf_config)
    load_adapter(model, vl["root"] / "moved", trainable=True)
    return model


def assert_same_grads(model, theirs: dict) -> None:
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert sorted(grads) == sorted(theirs) and len(grads) == 8
    for n, g in grads.items():
        assert float(theirs[n].abs().max()) > 0, n
        assert float((g - theirs[n]).abs().max()) <= 1e-5 * max(1.0, float(theirs[n].abs().max())), n


@pytest.fixture(scope="module")
def trl_dpo(vl):
    return trl_lora_trainer("DPO", vl, trl_rows(vl["root"]), seed=3)


def our_batch(vl, pairs=slice(None)) -> tuple[dict, ImageRows, Tokenizer]:
    tok = Tokenizer.from_folder(vl["model"])
    config = json.loads((vl["model"] / "config.json").read_text())
    images = ImageRows.from_checkpoint(config, PRE, lambda i: tok.decode([i], skip_special=False))
    examples = read_preference(vl["data"], tok, max_len=256, images=images)[pairs]
    collate = with_images(lambda ex: collate_with_reference(ex, pad_id=tok.pad_id), images, copies=2)
    return collate(examples), images, tok


def test_pairs_with_images_read_as_trl_collates_them(vl, trl_dpo):
    ours, images, tok = our_batch(vl)
    theirs = trl_dpo.data_collator(trl_rows(vl["root"]))
    for i in range(6):  # [chosen; rejected]: each row's real tokens, and the completion it scores
        real = ours["attention_mask"][i].bool()
        assert ours["input_ids"][i][real].tolist() == theirs["input_ids"][i][theirs["attention_mask"][i].bool()].tolist()
        assert ours["labels"][i][real].ne(-100).tolist() == theirs["completion_mask"][i][
            theirs["attention_mask"][i].bool()].bool().tolist()
    assert torch.equal(ours["image_grid_thw"], theirs["image_grid_thw"])
    assert torch.allclose(ours["pixel_values"], theirs["pixel_values"], atol=1e-6)
    examples = read_preference(vl["data"], tok, max_len=256, images=images)
    data = vl["data"].parent
    assert [ex["images"] for ex in examples] == [[str(data / "img" / n) for n in names]
                                                 for names in (["a.png"], ["c.png", "b.png"], ["b.png"])]


def test_dpo_loss_metrics_and_lora_gradients_equal_trl(vl, trl_dpo):
    expected, metrics, theirs = trl_step(trl_dpo, trl_dpo.data_collator(trl_rows(vl["root"])), TRL_METRICS)
    model = moved_model(vl)
    batch, _, _ = our_batch(vl)
    loss_sum, count, ours = make_dpo_objective(0.1, "sigmoid", reference=BaseReference())(model, batch)
    (loss_sum / count).backward()
    assert (loss_sum / count).item() == pytest.approx(expected.item(), abs=1e-5)
    assert abs(expected.item() - math.log(2)) > 1e-3  # the adapter has moved: the reference matters
    for k in TRL_METRICS:
        assert ours[k] == pytest.approx(metrics[k], abs=1e-5), k
    assert_same_grads(model, theirs)


LORA_RUN = ["device=cpu", "max_len=256", "lora_r=4", "lora_alpha=8", "checkpointing=false", "log_every=1",
            "grad_accum=1", "lr=1e-2"]


def cli_run(recipe: str, args: list[str], out: Path, capsys) -> list[dict]:
    """recipes/<recipe> run from the command line with LoRA on the folder (`LORA_RUN`, then `args`) into `out`:
    the audit healthy; its metrics.jsonl rows."""
    code = run_cli([str(REPO / "recipes" / recipe), *LORA_RUN, *args, f"out={out}"])
    log, err = capsys.readouterr()
    assert code == 0, err
    assert "audit: healthy" in log + err
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("precompute", ["false", "true"])
def test_dpo_from_the_cli_on_image_pairs(vl, capsys, precompute):
    """With precompute_ref=true the reference log-probs are computed with the images before step 1 and cached."""
    out = vl["root"] / f"out_{precompute}"
    data = [f"model={vl['model']}", f"data={vl['data']}"]
    rows = cli_run("dpo_mistral.py", data + ["max_steps=2", "batch_size=2", f"precompute_ref={precompute}",
                                             f"eval_data={vl['data']}", "eval_every=2"], out, capsys)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2] and evals[0]["eval/loss"] == pytest.approx(math.log(2), abs=1e-6)
    rows = [r for r in rows if "loss" in r]
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference, images on both
    assert rows[1]["loss"] != pytest.approx(math.log(2), abs=1e-4)
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "ref_logps" / "train.safetensors").is_file() == (precompute == "true")
    for key, what in (("shared_prompt", "shared-prompt row"), ("packing", "packed")):
        code = run_cli([str(REPO / "recipes" / "dpo_mistral.py"), *LORA_RUN, *data, f"out={vl['root'] / key}",
                        "max_steps=1", f"{key}=true"])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and f"{key}=true" in lines[0] and what in lines[0], lines
        assert not (vl["root"] / key).exists()


IMAGE_PROMPT = [{"role": "user", "content": [{"type": "image", "image": "img/a.png"}, {"type": "text", "text": "Hi"}]}]
BAD_ROWS = [  # (reader, row, max_len, what the one line says)
    ("preference", {"images": ["img/a.png"], "prompt": "Hi", "chosen": "A", "rejected": "B"}, 256,
     '"prompt" is a string'),
    ("preference", {"prompt": [{"role": "user", "content": "Hi"}],
                    "chosen": [{"role": "assistant", "content": [{"type": "image", "image": "img/a.png"}]}],
                    "rejected": "B"}, 256, '"chosen" has an image'),
    ("preference", {"prompt": IMAGE_PROMPT, "chosen": "A", "rejected": "B"}, 12, "never cut"),
    ("unpaired", {"prompt": IMAGE_PROMPT, "completion": "A", "label": True}, 12, "never cut"),
    ("unpaired", {"prompt": [{"role": "user", "content": "Hi"}], "label": False,
                  "completion": [{"role": "assistant", "content": [{"type": "image", "image": "img/a.png"}]}]}, 256,
     '"completion" has an image'),
    ("prompts", {"prompt": IMAGE_PROMPT}, 24, "never cut"),
]


@pytest.mark.parametrize("reader,row,max_len,says", BAD_ROWS)
def test_image_rows_a_reader_refuses_in_one_line(vl, reader, row, max_len, says):
    from minitrain.data.readers import read_prompts, read_unpaired
    from minitrain.errors import UserError

    _, images, tok = our_batch(vl, slice(0, 1))
    path = vl["data"].parent / f"bad_{reader}.jsonl"
    path.write_text(json.dumps(row) + "\n")
    read = {"preference": read_preference, "unpaired": read_unpaired, "prompts": read_prompts}[reader]
    with pytest.raises(UserError, match=f"{path}:1: .*{says}"):
        read(path, tok, max_len=max_len, images=images)


def test_orpo_nll_on_image_pairs_leaves_the_image_tokens_out(vl):
    """ORPO's NLL covers the chosen row's prompt, but not its image placeholders: the `nll_loss` of each pair equals
    the mean NLL of the chosen row's real tokens (the first and the image tokens left out) from transformers' logits
    given the same ids and pixels (TRL's ORPOTrainer takes no images)."""
    import transformers

    from minitrain.objectives.preference import ReferenceFreeObjective

    batch, images, _ = our_batch(vl)
    ours = load_pretrained(vl["model"], models.from_hf_config).eval()
    stats = ReferenceFreeObjective("orpo", beta=0.1, sft_weight=1.0).pair_stats(ours, batch)
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(vl["model"], dtype=torch.float32).eval()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=mask, pixel_values=batch["pixel_values"],
                    image_grid_thw=batch["image_grid_thw"], mm_token_type_ids=(ids == images.token_id).long()).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    scored = mask[:, 1:].bool() & (ids[:, 1:] != images.token_id)
    want = -(logp * scored).sum(1) / scored.sum(1)
    assert torch.allclose(stats["nll_loss"], want[:3], atol=1e-5)
