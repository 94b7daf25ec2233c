"""GRPO on prompts with images, on a tiny Qwen2.5-VL (the folder and processor of tests/test_vl_preference.py).

- The prompts read by `read_prompts` (an image part with a path; an `images` column beside plain text) are the ids
  transformers' processor makes of the same chats and images.
- The sampler prefills each prompt with its images: greedy completions equal transformers' `generate` given the
  pixel values (G = 2 rows per prompt from one prefill, prompts left-padded).
- On fixed completions, the loss and every parameter's gradient (the vision tower's too) equal
  `trl.GRPOTrainer._compute_loss` (TRL 1.16 with the processor: its forward splits the pixel values by row) to
  1e-5, with and without the KL term and old log-probs.
- A short LoRA run of recipes/grpo_qwen.py from the command line with a reward file: the rewards see the images
  column as paths, the held-out greedy reward is computed with the images, and the adapter moves.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch
from test_image_rows import PRE
from test_vl_preference import cli_run, processor, vl_files

import models
from minitrain.data.images import ImageRows
from minitrain.data.readers import read_prompts
from minitrain.objectives.grpo import collate_prompts, completion_logps, grpo_loss
from minitrain.objectives.sampling import sample
from minitrain.objectives.sft import image_inputs
from minitrain.run import with_images
from minitrain.text.tokenizer import Tokenizer
from minitrain.weights import load_pretrained

G, TEMPERATURE, MAX_COMPLETION = 2, 0.7, 6
PROMPTS = [
    {"prompt": [{"role": "user", "content": [{"type": "image", "image": "img/a.png"}, {"type": "text", "text": "Count."}]}],
     "answer": "3"},
    {"images": ["img/c.png", "img/b.png"], "prompt": [{"role": "user", "content": "Which is taller, and why so?"}],
     "answer": "7"},
]
REWARDS = '''
def image_count(prompts, completions, images=None, **kw):
    """One point per image of the row (paths, as the column holds them), less a little per character."""
    images = images or [None] * len(completions)  # (a batch of rows without the column)
    assert all(isinstance(p, str) for row in images if row for p in row), images
    return [float(len(row or [1])) - 0.01 * len(c[0]["content"]) for row, c in zip(images, completions)]
'''


@pytest.fixture(scope="module")
def vl(tmp_path_factory) -> dict[str, Path]:
    vl = vl_files(tmp_path_factory.mktemp("vl_grpo"), "prompts.jsonl", PROMPTS)
    (vl["root"] / "rewards.py").write_text(REWARDS)
    return vl


def our_batch(vl) -> tuple[dict, ImageRows]:
    tok = Tokenizer.from_folder(vl["model"])
    config = json.loads((vl["model"] / "config.json").read_text())
    images = ImageRows.from_checkpoint(config, PRE, lambda i: tok.decode([i], skip_special=False))
    examples = read_prompts(vl["data"], tok, max_len=256, images=images)
    collate = with_images(lambda ex: collate_prompts(ex, pad_id=tok.pad_id), images, group=G)
    return collate(examples), images


def trl_prompts(vl) -> tuple[list[str], list[list]]:
    """The prompts as transformers' processor renders them, with their images (TRL's shape: an images column)."""
    from PIL import Image

    proc = processor(vl["model"])
    chats = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Count."}]}],
             [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                           {"type": "text", "text": "Which is taller, and why so?"}]}]]
    texts = [proc.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    images = [[Image.open(vl["root"] / "data" / "img" / n).convert("RGB") for n in names]
              for names in (["a.png"], ["c.png", "b.png"])]
    return texts, images


def test_image_prompts_are_the_processors_ids(vl):
    batch, images = our_batch(vl)
    texts, pics = trl_prompts(vl)
    ref = processor(vl["model"])(text=texts, images=pics, padding=True, padding_side="left", return_tensors="pt")
    assert torch.equal(batch["prompt_ids"], ref["input_ids"])
    assert torch.equal(batch["prompt_attention_mask"], ref["attention_mask"])
    assert torch.allclose(batch["pixel_values"], ref["pixel_values"], atol=1e-6)
    assert torch.equal(batch["image_grid_thw"], ref["image_grid_thw"])
    # each prompt's images in its G rows, in row order
    assert batch["group_image_grid_thw"].tolist() == [[1, 4, 8]] * G + [[1, 2, 2], [1, 10, 4]] * G
    assert batch["columns"]["images"] == [None, ["img/c.png", "img/b.png"]]


def test_greedy_sampling_on_image_prompts_equals_generate(vl):
    import transformers

    batch, images = our_batch(vl)
    ids, mask = batch["prompt_ids"], batch["prompt_attention_mask"]
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(vl["model"], dtype=torch.float32).eval()
    ref = hf.generate(input_ids=ids, attention_mask=mask, pixel_values=batch["pixel_values"],
                      image_grid_thw=batch["image_grid_thw"], mm_token_type_ids=(ids == images.token_id).long(),
                      max_new_tokens=MAX_COMPLETION, do_sample=False, eos_token_id=None, pad_token_id=0)
    ours = load_pretrained(vl["model"], models.from_hf_config)
    cache = models.family(ours).KVCache
    got = sample(ours, ids, mask, new_cache=cache, num_generations=G, max_new_tokens=MAX_COMPLETION, greedy=True,
                 images=image_inputs(batch))
    assert torch.equal(got.ids, ref[:, ids.shape[1]:].repeat_interleave(G, 0))
    blind = sample(ours, ids, mask, new_cache=cache, max_new_tokens=MAX_COMPLETION, greedy=True)
    assert not torch.equal(blind.ids, ref[:, ids.shape[1]:])  # the images change the completions


@pytest.fixture(scope="module")
def trl_grpo(vl):
    """TRL's GRPOTrainer on the folder's model (every parameter trains) with the processor."""
    import datasets
    import transformers
    import trl

    texts, pics = trl_prompts(vl)
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(vl["model"], dtype=torch.float32)
    args = trl.GRPOConfig(output_dir=str(vl["root"] / "trl"), report_to=[], use_cpu=True, bf16=False,
                          per_device_train_batch_size=4, num_generations=G, max_completion_length=MAX_COMPLETION,
                          temperature=TEMPERATURE, disable_tqdm=True, gradient_checkpointing=False)
    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "Count."}], "images": pics[0]}] * 4)
    t = trl.GRPOTrainer(model=hf, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                        train_dataset=ds, processing_class=processor(vl["model"]))
    t.model.train()
    return t


COMPLETIONS = [[5, 6, 7, 2, 0, 0], [8, 9, 2, 0, 0, 0], [10, 11, 12, 13, 14, 2], [15, 16, 17, 18, 19, 20]]


@pytest.mark.parametrize("loss_type,beta,old", [("grpo", 0.0, False), ("dapo", 0.04, True)])
def test_grpo_loss_and_gradients_on_image_prompts_equal_trl(vl, trl_grpo, loss_type, beta, old):
    batch, images = our_batch(vl)
    prompt_ids = batch["prompt_ids"].repeat_interleave(G, 0)
    prompt_mask = batch["prompt_attention_mask"].repeat_interleave(G, 0)
    completion_ids = torch.tensor(COMPLETIONS)
    completion_mask = torch.tensor([[1] * (c.index(2) + 1 if 2 in c else 6) + [0] * (6 - (c.index(2) + 1 if 2 in c else 6))
                                    for c in COMPLETIONS])
    advantages = torch.tensor([1.3, -0.7, 0.4, -1.1])
    rows = image_inputs(batch, "group_")
    ours = load_pretrained(vl["model"], models.from_hf_config)
    ours.train()
    with torch.no_grad():
        now, _ = completion_logps(ours, prompt_ids, prompt_mask, completion_ids, completion_mask, TEMPERATURE,
                                  images=rows)
    g = torch.Generator().manual_seed(1)
    old_logps = now + 0.3 * torch.randn(now.shape, generator=g) if old else None
    ref_logps = now + 0.5 * torch.randn(now.shape, generator=g) if beta else None

    t = trl_grpo
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": advantages,
              "num_items_in_batch": completion_mask.sum(), **rows, "num_images": [1] * G + [2] * G,
              "mm_token_type_ids": torch.cat([(prompt_ids == images.token_id).long(),
                                              torch.zeros_like(completion_ids)], 1)}
    if old:
        inputs["old_per_token_logps"] = old_logps
    if beta:
        inputs["ref_per_token_logps"] = ref_logps
    t.loss_type, t.beta = loss_type, beta
    t.epsilon_low, t.epsilon_high = 0.2, 0.2
    t.current_gradient_accumulation_steps = 1
    t._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    t.model.zero_grad(set_to_none=True)
    expected = t._compute_loss(t.model, inputs)
    expected.backward()
    expected_grads = {n: p.grad for n, p in t.model.named_parameters() if p.grad is not None}

    for p in ours.parameters():
        p.requires_grad_(True)
    logps, _ = completion_logps(ours, prompt_ids, prompt_mask, completion_ids, completion_mask, TEMPERATURE,
                                group=G, images=rows)
    loss_sum, count, _ = grpo_loss(logps, advantages, completion_mask, old_logps=old_logps, ref_logps=ref_logps,
                                   loss_type=loss_type, epsilon=0.2, beta=beta)
    (loss_sum / count).backward()
    assert (loss_sum / count).item() == pytest.approx(expected.item(), abs=1e-5, rel=1e-5)
    grads = {n: p.grad for n, p in ours.named_parameters()}
    assert set(expected_grads) <= set(grads)
    assert any("visual" in n and float(v.abs().max()) > 0 for n, v in expected_grads.items())  # through the tower
    for n, ref in expected_grads.items():
        torch.testing.assert_close(grads[n], ref, atol=1e-5, rtol=1e-4, msg=n)


def test_grpo_from_the_cli_on_image_prompts(vl, capsys, monkeypatch):
    from models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as VL

    seen = []  # images per forward that has them: a batch's 3 (the prefill, the held-out pass), 6 in its G rows
    features = VL.image_features
    monkeypatch.setattr(VL, "image_features", lambda self, px, grid: (seen.append(len(grid)), features(self, px, grid))[1])
    out = vl["root"] / "out"
    rows = cli_run("grpo_qwen.py", [f"model={vl['model']}", f"data={vl['data']}", f"eval_data={vl['data']}",
                                    f"rewards={vl['root'] / 'rewards.py'}:image_count", "max_steps=2", "batch_size=2",
                                    "num_generations=2", "max_completion_length=4", "eval_every=2",
                                    "log_completions_every=1"], out, capsys)
    assert {3, 6} <= set(seen) <= {1, 2, 3, 4, 6}, seen
    assert [r["step"] for r in rows if "reward" in r] == [1, 2]
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2]
    # the reward: 1 or 2 points for the images, less 0.01 a character of at most 4 tokens
    assert all(1.3 < r["reward"] < 1.5 + 1e-6 for r in rows if "reward" in r)
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert samples and all(isinstance(s["prompt"], list) for s in samples)
    from safetensors.torch import load_file

    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert any("lora_B" in k and float(v.abs().max()) > 0 for k, v in adapter.items())


def test_the_sampler_never_draws_an_image_placeholder(vl):
    """A head that favours `<|image_pad|>` above all: the completions never hold it (a completion with one would have
    no features in the forward with the batch's images), and their log-probs are scored with the images."""
    batch, images = our_batch(vl)
    ours = load_pretrained(vl["model"], models.from_hf_config)
    assert ours.placeholder_ids == (images.token_id,)

    def favour(module, args, out):
        out[..., images.token_id] += 1e4

    ours.lm_head.register_forward_hook(favour)
    ids, mask = batch["prompt_ids"], batch["prompt_attention_mask"]
    for greedy in (True, False):
        got = sample(ours, ids, mask, new_cache=models.family(ours).KVCache, num_generations=G,
                     max_new_tokens=MAX_COMPLETION, greedy=greedy, images=image_inputs(batch))
        assert got.ids.shape == (2 * G, MAX_COMPLETION) and not (got.ids == images.token_id).any()
    with torch.no_grad():
        completion_logps(ours, ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0), got.ids, got.mask,
                         images=image_inputs(batch, "group_"))
