"""Adapters on the vision side of Qwen2.5-VL, Qwen3-VL, multimodal Qwen3.5, Gemma 3 and Gemma 4, and what reads
them, one table of the five families (the tiny checkpoints of tests/test_qwen2_5_vl.py, tests/test_qwen3_vl.py,
tests/test_qwen3_5_vl.py, tests/test_gemma3_vl.py and tests/test_gemma4_vl.py, saved by transformers):

- LoRA whose `lora_targets` is one regular expression naming the merger (Qwen; with the language model's
  projections) or the tower's last layer (Gemma 3, whose projector holds no linear; Gemma 4, whose embedder's
  one linear is left to full fine-tuning here) trains them: the adapter
  saved in peft's format loads in peft on transformers' class with our logits on an image batch;
- `minitrain merge` of that adapter writes a folder that transformers loads as the multimodal class with the
  logits of peft's `merge_and_unload` on the same batch (the tower and merger folded as well);
- the gradient audit: healthy with the vision side trained (LoRA there, or `finetune=full`), and a planted
  `.detach()` between the merger / projector / embedder and the language model is one problem naming that module, with
  the vision side's trained tensors unreachable. (A frozen tower gives no alarm through the CLI run's audit
  line: tests/test_image_rows.py, tests/test_gemma3_vl.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from test_gemma3_vl import SOFT
from test_gemma3_vl import batch as gemma_batch
from test_gemma3_vl import g3  # noqa: F401  (the session fixture)
from test_gemma3_vl import hf_logits as gemma_logits
from test_gemma4_vl import IMAGE as GEMMA4_IMAGE
from test_gemma4_vl import batch as gemma4_batch
from test_gemma4_vl import g4v  # noqa: F401  (the module fixture)
from test_gemma4_vl import hf_logits as gemma4_logits
from test_gemma4_vl import pixels as gemma4_pixels
from test_qwen2_5_vl import IMAGE, rel, vl  # noqa: F401  (vl: the session fixture)
from test_qwen2_5_vl import batch as qwen_batch
from test_qwen2_5_vl import hf_logits as qwen_logits
from test_qwen3_5_vl import vl35  # noqa: F401  (the session fixture)
from test_qwen3_vl import vl3  # noqa: F401  (the session fixture)

import models
from minitrain.adapters.lora import LoRAConfig, apply_lora, freeze_for_adapters
from minitrain.adapters.peft_format import save_adapter
from minitrain.audit import UNREACHABLE, audit
from minitrain.errors import UserError
from minitrain.objectives.sft import sft
from minitrain.weights import load_pretrained

LM = r"model\.language_model\.layers\.\d+\.(self_attn\.(q|v)_proj|mlp\.down_proj)"
# family -> (fixture, transformers' class, the regex, the module between the vision side and the language model)
FAMILIES = {
    "qwen2_5_vl": ("vl", "Qwen2_5_VLForConditionalGeneration", LM + r"|model\.visual\.merger\..*", "model.visual.merger"),
    "qwen3_vl": ("vl3", "Qwen3VLForConditionalGeneration", LM + r"|model\.visual\.merger\..*", "model.visual.merger"),
    "qwen3_5": ("vl35", "Qwen3_5ForConditionalGeneration", LM + r"|model\.visual\.merger\..*", "model.visual.merger"),
    "gemma3": ("g3", "Gemma3ForConditionalGeneration", LM + r"|model\.vision_tower\.encoder\.layers\.1\..*",
               "model.multi_modal_projector"),
    "gemma4": ("g4v", "Gemma4ForConditionalGeneration", LM + r"|model\.vision_tower\.encoder\.layers\.1\..*",
               "model.embed_vision"),
}
VISION = ("model.visual.", "model.vision_tower.", "model.multi_modal_projector.", "model.embed_vision.")


@pytest.fixture(params=list(FAMILIES))
def family(request) -> tuple[str, Path]:
    return request.param, request.getfixturevalue(FAMILIES[request.param][0])


def images(name: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """An image batch of the family's tests: ids, mask and the image inputs our forward takes."""
    if name == "gemma3":
        ids, mask, pixels = gemma_batch()
        return ids, mask, {"pixel_values": pixels}
    if name == "gemma4":
        (ids, mask), (pixels, positions) = gemma4_batch(), gemma4_pixels()
        return ids, mask, {"pixel_values": pixels, "image_position_ids": positions}
    ids, mask, pixels, grid = qwen_batch()
    return ids, mask, {"pixel_values": pixels, "image_grid_thw": grid}


def hf_logits(name: str, hf, ids, mask, inputs: dict) -> torch.Tensor:
    if name == "gemma3":
        return gemma_logits(hf, ids, mask, inputs["pixel_values"])
    if name == "gemma4":
        return gemma4_logits(hf, ids, mask, inputs["pixel_values"], inputs["image_position_ids"])
    return qwen_logits(hf, ids, mask, inputs["pixel_values"], inputs["image_grid_thw"])


def adapted(folder: Path, targets: str, out: Path | None = None, scale: float = 0.05):
    """Our model with LoRA on `targets` (B drawn at random, so the adapters change the logits), frozen around
    them; saved in peft's format to `out`."""
    model = load_pretrained(folder, models.from_hf_config)
    cfg = LoRAConfig(r=4, alpha=8, targets=[targets])  # a list of one, as lora_targets gives it
    apply_lora(model, cfg)
    freeze_for_adapters(model, cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, scale)
    if out is not None:
        save_adapter(model, out, cfg)
    return model.eval()


def sft_batch(name: str) -> dict:
    ids, mask, inputs = images(name)
    image = {"gemma3": SOFT, "gemma4": GEMMA4_IMAGE}.get(name, IMAGE)
    labels = ids.masked_fill((mask == 0) | (ids == image), -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, **inputs}


def test_a_regex_adapts_the_merger_and_peft_loads_it(family, tmp_path):
    """The regex wraps the vision side's linears (its norms and containers skipped) and the language model's; peft
    puts the saved adapter on the same modules of transformers' class, with our logits on an image batch."""
    peft = pytest.importorskip("peft")
    name, folder = family
    ours = adapted(folder, FAMILIES[name][2], tmp_path)
    vision = {n for n, _ in ours.named_parameters() if "lora_" in n and n.startswith(VISION)}
    assert vision and all(p.requires_grad for n, p in ours.named_parameters() if n in vision)
    hf = getattr(transformers, FAMILIES[name][1]).from_pretrained(folder, dtype=torch.float32)
    ref = peft.PeftModel.from_pretrained(hf, tmp_path).eval()
    assert {n.removeprefix("base_model.model.").replace(".default", "") for n, _ in ref.named_parameters()
            if "lora_" in n and any(v in n for v in (".visual.", ".vision_tower.", ".embed_vision."))} == vision
    ids, mask, inputs = images(name)
    real = mask.bool()
    with torch.no_grad():
        a = hf_logits(name, ref, ids, mask, inputs)
        b = ours.lm_head(ours(ids, mask, **inputs))
        with ref.disable_adapter():
            plain = hf_logits(name, ref, ids, mask, inputs)
    assert rel(b[real], a[real]) <= 1e-5 and rel(plain[real], a[real]) > 1e-3


def test_merge_equals_peft_merge_and_unload(family, tmp_path):
    """`minitrain merge` folds the adapter (the vision side's too) into a folder transformers loads as the
    multimodal class, with the logits of peft's merge_and_unload of the same adapter."""
    peft = pytest.importorskip("peft")
    from minitrain.commands.merge import main as merge

    name, folder = family
    adapted(folder, FAMILIES[name][2], tmp_path / "adapter")
    assert merge(["--model", str(folder), "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged")]) == 0
    cls = getattr(transformers, FAMILIES[name][1])
    merged = cls.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ref = peft.PeftModel.from_pretrained(cls.from_pretrained(folder, dtype=torch.float32), tmp_path / "adapter")
    ref = ref.merge_and_unload().eval()
    plain = cls.from_pretrained(folder, dtype=torch.float32).eval()
    ids, mask, inputs = images(name)
    real = mask.bool()
    with torch.no_grad():
        a, b, c = (hf_logits(name, m, ids, mask, inputs) for m in (merged, ref, plain))
    assert rel(a[real], b[real]) <= 1e-5 and rel(c[real], b[real]) > 1e-3


def test_audit_of_a_trained_vision_side_is_healthy(family):
    """LoRA on the merger / tower through the regex, and full fine-tuning: every trained tensor reached."""
    name, folder = family
    report = audit(adapted(folder, FAMILIES[name][2], scale=0.0).train(), sft, sft_batch(name))
    assert report.ok and not report.problems, report.problems
    full = load_pretrained(folder, models.from_hf_config).train()
    for p in full.parameters():
        p.requires_grad_(True)
    report = audit(full, sft, sft_batch(name))
    assert report.ok and not report.problems, report.problems


@pytest.mark.parametrize("how", ["lora", "full"])
def test_a_detached_merger_is_caught(family, how, monkeypatch):
    """The merger's (Gemma 3: the projector's) output detached before the language model reads it: the vision
    side's trained tensors are unreachable (on Qwen3-VL the tower still reaches the loss through DeepStack, the
    merger does not), and the one problem names the module whose output stopped requiring grad."""
    name, folder = family
    module = FAMILIES[name][3]
    if how == "lora":
        model = adapted(folder, FAMILIES[name][2], scale=0.0).train()
    else:
        model = load_pretrained(folder, models.from_hf_config).train()
        for p in model.parameters():
            p.requires_grad_(True)
    cut = model.get_submodule(module)
    inner = cut.forward
    monkeypatch.setattr(cut, "forward", lambda *a: inner(*a).detach())
    report = audit(model, sft, sft_batch(name))
    assert not report.ok and len(report.problems) == 1, report.problems
    assert f"the output of {module} does not require grad" in report.problems[0]
    dead = {t.name for t in report.tensors if t.status == UNREACHABLE}
    assert dead and all(n.startswith(VISION) for n in dead)
    assert any(n.startswith(module + ".") for n in dead) or name in ("gemma3", "gemma4") and how == "lora"


def test_a_regex_must_be_the_only_target():
    with pytest.raises(UserError, match="must be the only target"):
        LoRAConfig(targets=["q_proj", r"model\.visual\..*"])
    with pytest.raises(UserError, match="not a regular expression"):
        LoRAConfig(targets=[r"model\.visual\.(merger"])
