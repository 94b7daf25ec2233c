"""KTO on rows whose prompt carries images, against TRL 1.16's own vision path, on a tiny Qwen2.5-VL (the folder,
processor and chat template of tests/test_vl_preference.py).

The reference: `trl.KTOTrainer` with the processor and a LoRA `peft_config`: its `DataCollatorForVisionUnpaired`
renders the rows, processes the images and makes each row's KL row (its prompt and images with the previous row's
completion, the first row taking the batch's last), its `_compute_loss` scores the policy and the reference
(adapter disabled). The same rows read by `read_unpaired` (image parts with paths, an images column) with
`add_kl_rows` over one block of the batch's size and the KTO recipe's collator. Compared, to 1e-5: the ids, the
loss, TRL's metrics and every LoRA gradient (the adapter moved off its initialisation). Then one run of
recipes/kto_mistral.py from the command line, whose first loss is 0.5 exactly (policy == reference: every row's
reward and the KL point 0), which it is only if the reference saw each row's images, its KL row's too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_image_rows import PRE
from test_vl_preference import (assert_same_grads, cli_run, moved_model, trl_lora_trainer, trl_step, vl_files,
                                with_pictures)

from minitrain.data.images import ImageRows
from minitrain.data.readers import read_unpaired
from minitrain.objectives.kto import KTOObjective, add_kl_rows, collate_kto
from minitrain.objectives.reference import BaseReference
from minitrain.run import with_images
from minitrain.text.tokenizer import Tokenizer

TRL_METRICS = ("kl", "rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected")


def turn(role: str, *parts) -> list[dict]:
    return [{"role": role, "content": list(parts)}]


# (ours: the row in the file, TRL: the row with its images column)
ROWS = [
    ({"prompt": turn("user", {"type": "image", "image": "img/a.png"}, {"type": "text", "text": "What is it?"}),
      "completion": [{"role": "assistant", "content": "A red cat."}], "label": True},
     {"images": ["img/a.png"], "prompt": turn("user", {"type": "image"}, {"type": "text", "text": "What is it?"}),
      "completion": [{"role": "assistant", "content": "A red cat."}], "label": True}),
    ({"images": ["img/c.png", "img/b.png"], "prompt": [{"role": "user", "content": "Compare them."}],
      "completion": [{"role": "assistant", "content": "They are the same."}], "label": False},
     {"images": ["img/c.png", "img/b.png"], "prompt": [{"role": "user", "content": "Compare them."}],
      "completion": [{"role": "assistant", "content": "They are the same."}], "label": False}),
    ({"images": ["img/b.png"], "prompt": [{"role": "user", "content": "Describe it."}],
      "completion": [{"role": "assistant", "content": "Blue and tall."}], "label": True},
     {"images": ["img/b.png"], "prompt": [{"role": "user", "content": "Describe it."}],
      "completion": [{"role": "assistant", "content": "Blue and tall."}], "label": True}),
]


@pytest.fixture(scope="module")
def vl(tmp_path_factory) -> dict[str, Path]:
    return vl_files(tmp_path_factory.mktemp("vl_kto"), "rows.jsonl", [ours for ours, _ in ROWS])


def trl_rows(root: Path) -> list[dict]:
    return with_pictures(root, [row for _, row in ROWS])


@pytest.fixture(scope="module")
def trl_kto(vl):
    return trl_lora_trainer("KTO", vl, trl_rows(vl["root"]), seed=5, per_device_train_batch_size=3)


def our_batch(vl) -> dict:
    tok = Tokenizer.from_folder(vl["model"])
    config = json.loads((vl["model"] / "config.json").read_text())
    images = ImageRows.from_checkpoint(config, PRE, lambda i: tok.decode([i], skip_special=False))
    examples = add_kl_rows(read_unpaired(vl["data"], tok, max_len=256, images=images), 3)
    return with_images(lambda ex: collate_kto(ex, pad_id=tok.pad_id), images, copies=2)(list(examples))


def test_kto_rows_with_images_equal_trl(vl, trl_kto):
    trainer = trl_kto
    inputs = trainer.data_collator(trl_rows(vl["root"]))
    batch = our_batch(vl)
    for i in range(3):  # the rows, then their KL rows: the real tokens and the completion they score
        for ours, (ids, mask, completion) in ((i, ("input_ids", "attention_mask", "completion_mask")),
                                              (3 + i, ("KL_input_ids", "KL_attention_mask", "KL_completion_mask"))):
            real, theirs = batch["attention_mask"][ours].bool(), inputs[mask][i].bool()
            assert batch["input_ids"][ours][real].tolist() == inputs[ids][i][theirs].tolist()
            assert batch["labels"][ours][real].ne(-100).tolist() == inputs[completion][i][theirs].bool().tolist()
    assert torch.allclose(batch["pixel_values"][: len(batch["pixel_values"]) // 2], inputs["pixel_values"], atol=1e-6)

    expected, metrics, theirs = trl_step(trainer, inputs, TRL_METRICS)
    model = moved_model(vl)
    loss_sum, count, ours = KTOObjective(0.1, reference=BaseReference())(model, batch)
    (loss_sum / count).backward()
    assert (loss_sum / count).item() == pytest.approx(expected.item(), abs=1e-5)
    assert abs(expected.item() - 0.5) > 1e-3  # the adapter has moved: the reference matters
    for k in TRL_METRICS:
        assert ours[k] == pytest.approx(metrics[k], abs=1e-5), k
    assert_same_grads(model, theirs)


@pytest.mark.parametrize("precompute", ["false", "true"])
def test_kto_from_the_cli_on_image_rows(vl, capsys, precompute):
    """With precompute_ref=true the reference log-probs (the rows' and the KL rows') are computed with the images
    before step 1 and cached."""
    out = vl["root"] / f"out_{precompute}"
    rows = cli_run("kto_mistral.py", [f"model={vl['model']}", f"data={vl['data']}", "max_steps=2", "batch_size=3",
                                      f"precompute_ref={precompute}", f"eval_data={vl['data']}", "eval_every=2"],
                   out, capsys)
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2] and evals[0]["eval/loss"] == pytest.approx(0.5, abs=1e-6)
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["loss"] == pytest.approx(0.5, abs=1e-6) and rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert rows[1]["loss"] != pytest.approx(0.5, abs=1e-4)
    assert (out / "ref_logps" / "train.safetensors").is_file() == (precompute == "true")
