"""Qwen2.5-VL (`models/qwen2_5_vl.py`) against transformers' `Qwen2_5_VLForConditionalGeneration`.

A tiny random checkpoint saved once per session by transformers 5 (fp32; the norms perturbed so that they
matter): a 3-layer tower (32 wide, 2 heads, patches of 4 pixels, merge 2, windows of 16 pixels = 2 merge
blocks a side, layer 1 full attention) and a 2-layer Qwen2 language model whose M-RoPE splits head dim 16
into sections (2, 3, 3). Compared: logits with images in the batch (two images in one row, one in
another, a padded text-only row; grids whose windows do not divide them), text-only logits, the config's
round trip.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

import models
from minitrain.weights import load_pretrained

IMAGE, VIDEO, START, END = 150, 151, 152, 153
TEXT = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1])


def tiny_config():
    return transformers.Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE,
                                         video_token_id=151, vision_start_token_id=START, vision_end_token_id=END)


@pytest.fixture(scope="session")
def vl(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(tiny_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.add_(0.1 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("qwen2_5_vl")
    model.save_pretrained(d)
    return d


def image_row(g: torch.Generator, grids: list[tuple[int, int, int]], T: int) -> list[int]:
    """Random text around each image's <|vision_start|> <|image_pad|> x n <|vision_end|>, T ids."""
    ids: list[int] = []
    for t, h, w in grids:
        ids += torch.randint(3, 140, (3,), generator=g).tolist() + [START] + [IMAGE] * (t * h * w // 4) + [END]
    return ids + torch.randint(3, 140, (T - len(ids),), generator=g).tolist()


def batch():
    """Row 0: two images (8 x 12 and 6 x 10 patches); row 1: one image (4 x 4); row 2: text, right-padded."""
    g = torch.Generator().manual_seed(0)
    grids = [(1, 8, 12), (1, 6, 10), (1, 4, 4)]
    T = 60
    rows = [image_row(g, grids[:2], T), image_row(g, grids[2:], T), torch.randint(3, 140, (T,), generator=g).tolist()]
    ids = torch.tensor(rows)
    mask = torch.ones_like(ids)
    mask[2, 40:] = 0
    ids[2, 40:] = 0
    grid = torch.tensor(grids)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4, generator=g)
    return ids, mask, pixels, grid


def video_batch(frames_apart: bool):
    """Row 0: an image (4 x 4 patches) then a video (2 temporal patches of 6 x 8); row 1: a video (3 of 4 x 4);
    row 2: text, right-padded. `frames_apart` (Qwen3-VL's processor): each temporal patch of a video its own
    run of <|video_pad|> between <|vision_start|> and <|vision_end|>, text (its timestamp) before each."""
    g = torch.Generator().manual_seed(1)
    words = lambda n: torch.randint(3, 140, (n,), generator=g).tolist()  # noqa: E731
    items = [[("image", (1, 4, 4)), ("video", (2, 6, 8))], [("video", (3, 4, 4))]]
    rows = []
    for row in items:
        ids: list[int] = []
        for kind, (t, h, w) in row:
            if kind == "image":
                ids += words(3) + [START] + [IMAGE] * (h * w // 4) + [END]
            elif frames_apart:
                ids += words(2) + [START] + sum((words(3) + [START] + [VIDEO] * (h * w // 4) + [END]
                                                 for _ in range(t)), []) + [END]
            else:
                ids += words(3) + [START] + [VIDEO] * (t * h * w // 4) + [END]
        rows.append(ids)
    T = max(map(len, rows)) + 4
    rows = [r + words(T - len(r)) for r in rows] + [words(T)]
    ids = torch.tensor(rows)
    mask = torch.ones_like(ids)
    mask[2, 30:] = 0
    ids[2, 30:] = 0
    image_grid, video_grid = torch.tensor([(1, 4, 4)]), torch.tensor([(2, 6, 8), (3, 4, 4)])
    pixels = torch.randn(16, 3 * 2 * 4 * 4, generator=g)
    videos = torch.randn(int(video_grid.prod(-1).sum()), 3 * 2 * 4 * 4, generator=g)
    return ids, mask, pixels, image_grid, videos, video_grid


def check_video_logits(hf, ours, frames_apart: bool) -> None:
    """`video_batch`'s logits (an image and a video in a row, a video alone in another, a padded text row; and
    the video rows with no image input at all) equal transformers'; seconds per temporal patch 2/3 and 1 (the
    first truncated on Qwen2.5-VL's temporal axis: 4 tokens a second x 2/3)."""
    ids, mask, pixels, grid, videos, vgrid = video_batch(frames_apart)
    seconds = torch.tensor([2 / 3, 1.0])
    kinds = lambda x: (x == IMAGE).long() + 2 * (x == VIDEO).long()  # noqa: E731  (the processor's mm_token_type_ids)
    real = mask.bool()
    # the 3-D positions: transformers' get_rope_index's, exactly (padding aside)
    from models.qwen2_5_vl import rope_index

    extra = {} if frames_apart else {"second_per_grid_ts": seconds}
    want = hf.model.get_rope_index(ids, kinds(ids), grid, vgrid, attention_mask=mask, **extra)[0]
    videos_walked, steps = ours.video_positions(vgrid, seconds)
    got = rope_index(ids, real, grid, IMAGE, 2, None, videos_walked, VIDEO, steps)
    assert torch.equal(got[:, real], want[:, real])
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid,
                 pixel_values_videos=videos, video_grid_thw=vgrid, second_per_grid_ts=seconds,
                 mm_token_type_ids=kinds(ids)).logits
        got = ours.lm_head(ours(ids, mask, pixel_values=pixels, image_grid_thw=grid, pixel_values_videos=videos,
                                video_grid_thw=vgrid, second_per_grid_ts=seconds))
        assert rel(got[real], ref[real]) <= 1e-4, rel(got[real], ref[real])
        # the video matters: other frames, other logits
        other = ours.lm_head(ours(ids, mask, pixel_values=pixels, image_grid_thw=grid,
                                  pixel_values_videos=videos.flip(0), video_grid_thw=vgrid, second_per_grid_ts=seconds))
        assert rel(other[:2], got[:2]) > 1e-3
        # a video alone (no image in the batch)
        one = vgrid[1:]
        alone = videos[-int(one.prod()):]
        ref = hf(input_ids=ids[1:2], pixel_values_videos=alone, video_grid_thw=one, second_per_grid_ts=seconds[1:],
                 mm_token_type_ids=kinds(ids[1:2])).logits
        got = ours.lm_head(ours(ids[1:2], pixel_values_videos=alone, video_grid_thw=one,
                                second_per_grid_ts=seconds[1:]))
        assert rel(got, ref) <= 1e-4, rel(got, ref)


def check_generation_after_videos(hf, ours, frames_apart: bool) -> None:
    """`video_batch`'s two rows with videos as prompts (an image too in row 0): greedy generation equals
    transformers', the tokens after the prompt counting on from its largest 3-D position."""
    ids, _, pixels, grid, videos, vgrid = video_batch(frames_apart)
    ids, seconds = ids[:2], torch.tensor([2 / 3, 1.0])
    media = dict(pixel_values=pixels, image_grid_thw=grid, pixel_values_videos=videos, video_grid_thw=vgrid,
                 **({} if frames_apart else {"second_per_grid_ts": seconds}))  # (Qwen3-VL's generate takes no seconds)
    ref = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **media, max_new_tokens=6, do_sample=False,
                      mm_token_type_ids=(ids == IMAGE).long() + 2 * (ids == VIDEO).long(), eos_token_id=None,
                      pad_token_id=0)
    got = models.family(ours).generate(ours, ids, torch.ones_like(ids), max_new_tokens=6, eos_token_id=[], **media)
    assert torch.equal(got, ref)


def check_packed_rows_equal_each_alone(ours) -> None:
    """The three sequences of `batch()` packed by the SFT collator (`collate_packed_causal`: row 0 holds
    sequences 0 and 2, row 1 sequence 1) with their images in the order they lie in the rows
    (`packed_order`): each sequence's logits equal its own forward's, on the CPU's per-sequence path and on the
    dense mask (a captured layer), with and without the images in place."""
    from minitrain.data.images import packed_order
    from minitrain.data.packing import collate_packed_causal

    ids, mask, pixels, grid = batch()
    lengths = [60, 60, 20]  # (20 of the text row's 40: two rows of 80 pack tighter than three of 60)
    seqs = [ids[b, :n].tolist() for b, n in enumerate(lengths)]
    per_image = grid.prod(-1).tolist()
    images_of = [[0, 1], [2], []]  # each sequence's images (grid rows)
    starts = [sum(per_image[:i]) for i in range(len(per_image))]
    packed = collate_packed_causal([{"input_ids": x, "labels": x} for x in seqs], pad_id=0, max_len=100)
    order = packed_order(packed["sequence_ids"])
    assert packed["input_ids"].shape[0] == 2 and order != sorted(order)  # two rows; not in the examples' order
    shuffled = [i for s in order for i in images_of[s]]
    p_pixels = torch.cat([pixels[starts[i]:starts[i] + per_image[i]] for i in shuffled])
    p_grid = grid[shuffled]
    from models.qwen2_5_vl import rope_index

    merge = ours.config.vision.spatial_merge_size
    pos = rope_index(packed["input_ids"], packed["document_ids"] >= 0, p_grid, IMAGE, merge, packed["document_ids"])
    for s in range(3):  # each sequence's 3-D positions start again, as its own (attention alone would not tell)
        own = rope_index(ids[s:s + 1, :lengths[s]], torch.ones(1, lengths[s], dtype=torch.bool),
                         grid[images_of[s]] if images_of[s] else None, IMAGE, merge)
        assert torch.equal(pos[:, packed["sequence_ids"] == s], own[:, 0])
    with torch.no_grad():
        alone = [ours.lm_head(ours(ids[s:s + 1, :lengths[s]], pixel_values=torch.cat(
                     [pixels[starts[i]:starts[i] + per_image[i]] for i in images_of[s]]) if images_of[s] else None,
                     image_grid_thw=grid[images_of[s]] if images_of[s] else None))[0] for s in range(3)]
        for layers in ((), (1,)):
            out = ours(packed["input_ids"], position_ids=packed["position_ids"], document_ids=packed["document_ids"],
                       pixel_values=p_pixels, image_grid_thw=p_grid, hidden_layers=layers)
            got = ours.lm_head(out.hidden if layers else out)
            for s in range(3):
                at = packed["sequence_ids"] == s
                assert rel(got[at], alone[s]) <= 1e-5, (layers, s, rel(got[at], alone[s]))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_logits_with_images_equal_transformers(vl):
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(vl, dtype=torch.float32).eval()
    ours = load_pretrained(vl, models.from_hf_config).eval()
    ids, mask, pixels, grid = batch()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid,
                 mm_token_type_ids=(ids == IMAGE).long()).logits
        got = ours.lm_head(ours(ids, mask, pixel_values=pixels, image_grid_thw=grid))
        real = mask.bool()
        assert rel(got[real], ref[real]) <= 1e-4
        # text alone (the three M-RoPE axes agree): Qwen2's RoPE
        text = ids[2:, :40]
        assert rel(ours.lm_head(ours(text)), hf(input_ids=text).logits) <= 1e-4
        # the images matter: other pixels, other logits
        other = ours.lm_head(ours(ids, mask, pixel_values=pixels.flip(0), image_grid_thw=grid))
        assert rel(other[:2], got[:2]) > 1e-3


def test_tower_loaded_key_for_key(vl):
    ours = load_pretrained(vl, models.from_hf_config)
    from safetensors import safe_open

    with safe_open(vl / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert {k for k in ours.state_dict() if k.startswith("model.visual.")} == {"model." + k for k in keys
                                                                                 if k.startswith("visual.")}
        assert torch.equal(ours.state_dict()["model.visual.patch_embed.proj.weight"],
                           f.get_tensor("visual.patch_embed.proj.weight"))


def test_the_nested_layout_loads_too(vl, tmp_path):
    """transformers 4.52-4.5x saved `model.visual.*` and `model.language_model.*`: the same model."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(vl / "model.safetensors")
    nested = {("model." + k if k.startswith("visual.") else k.replace("model.", "model.language_model.", 1)): v
              for k, v in tensors.items()}
    save_file(nested, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((vl / "config.json").read_text())
    a, b = (load_pretrained(d, models.from_hf_config).state_dict() for d in (vl, tmp_path))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_config_round_trip(vl):
    d = json.loads((vl / "config.json").read_text())
    cfg = models.config_from_hf(d)
    assert cfg.mrope_section == [2, 3, 3] and cfg.vision.fullatt_block_indexes == [1]
    again = cfg.to_hf()
    assert again["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]
    assert models.config_from_hf(again) == cfg
    assert transformers.Qwen2_5_VLConfig(**again).text_config.hidden_size == 64


def hf_logits(hf, ids: torch.Tensor, mask: torch.Tensor, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """transformers' logits of a batch with images (its processor's `mm_token_type_ids` made from the ids)."""
    return hf(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid,
              mm_token_type_ids=(ids == IMAGE).long()).logits


def check_lora_in_peft(folder: Path, hf_classes, tmp_path: Path) -> None:
    """LoRA on the language model's projections (B drawn at random), saved in peft's format: peft puts it on each
    of transformers' `hf_classes` (the same module names) with our logits on a batch with images; no adapter on
    the tower, whose MLP may have the same leaf names."""
    peft = pytest.importorskip("peft")
    from minitrain.adapters.lora import LoRAConfig, apply_lora
    from minitrain.adapters.peft_format import save_adapter

    ours = load_pretrained(folder, models.from_hf_config).eval()
    cfg = LoRAConfig(r=4, alpha=8, targets=("q_proj", "v_proj", "gate_proj", "down_proj"))
    apply_lora(ours, cfg)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    assert not [n for n, _ in ours.named_parameters() if "lora_" in n and "visual" in n]
    save_adapter(ours, tmp_path, cfg)
    ids, mask, pixels, grid = batch()
    real = mask.bool()
    with torch.no_grad():
        b = ours.lm_head(ours(ids, mask, pixel_values=pixels, image_grid_thw=grid))
    for cls in hf_classes:
        ref = peft.PeftModel.from_pretrained(cls.from_pretrained(folder, dtype=torch.float32), tmp_path).eval()
        assert not [n for n, _ in ref.named_parameters() if "lora_" in n and "visual" in n]
        with torch.no_grad():
            a = hf_logits(ref, ids, mask, pixels, grid)
            with ref.disable_adapter():
                plain = hf_logits(ref, ids, mask, pixels, grid)
        assert rel(b[real], a[real]) <= 1e-5 and rel(plain[real], a[real]) > 1e-3


def check_saved_folder(ours, folder: Path, hf_class, tmp_path: Path) -> None:
    """`save_pretrained` of `ours` (loaded from `folder`; full fine-tuning, merge) writes a folder that loads again
    to the same tensors, and in transformers' `hf_class` with our logits."""
    from minitrain.weights import save_pretrained

    config = dict(json.loads((folder / "config.json").read_text()), vocab_size=160)  # as full fine-tuning writes it
    save_pretrained(ours, tmp_path / "saved", config)
    again = load_pretrained(tmp_path / "saved", models.from_hf_config)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in ours.state_dict().items())
    hf = hf_class.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
    ids, mask, pixels, grid = batch()
    with torch.no_grad():
        a = hf_logits(hf, ids, mask, pixels, grid)
        b = ours.lm_head(ours(ids, mask, pixel_values=pixels, image_grid_thw=grid))
    assert rel(b[mask.bool()], a[mask.bool()]) <= 1e-4


def check_generation_after_images(hf, ours) -> None:
    """A prompt with an image (left-padded beside a row with two): the prompt's positions are 3-D, the tokens
    after it continue from its largest position, as transformers' generation does."""
    ids, _, pixels, grid = batch()
    ids, mask = ids[:2, :52].clone(), torch.ones(2, 52, dtype=torch.long)
    ids[1] = torch.cat([torch.zeros(52 - 40, dtype=torch.long), ids[1, :40]])  # row 1 left-padded
    mask[1, :12] = 0
    ref = hf.generate(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid,
                      mm_token_type_ids=(ids == IMAGE).long(), max_new_tokens=6, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    got = models.family(ours).generate(ours, ids, mask, max_new_tokens=6, eos_token_id=[], pixel_values=pixels,
                                       image_grid_thw=grid)
    assert torch.equal(got, ref)
    # the logits of two tokens after the prompt, through the cache, equal a forward over the whole sequence
    # (greedy tokens alone barely notice the positions on a random model)
    nxt = torch.tensor([[5, 6], [7, 8]])
    full_ids, full_mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
    with torch.no_grad():
        whole = hf_logits(hf, full_ids, full_mask, pixels, grid)[:, -2:]
        cache = models.family(ours).KVCache(60)
        ours(ids, mask, cache=cache, pixel_values=pixels, image_grid_thw=grid)
        stepped = ours.lm_head(ours(nxt, torch.ones_like(nxt), cache=cache))
    assert rel(stepped, whole) <= 1e-4


def test_lora_adapter_loads_in_peft_with_images(vl, tmp_path):
    check_lora_in_peft(vl, [transformers.Qwen2_5_VLForConditionalGeneration], tmp_path)


def test_a_saved_folder_loads_in_transformers(vl, tmp_path):
    check_saved_folder(load_pretrained(vl, models.from_hf_config).eval(), vl,
                       transformers.Qwen2_5_VLForConditionalGeneration, tmp_path)


def test_greedy_generation_of_text_equals_transformers(vl):
    """A text prompt (no image) decodes through the KV cache as transformers' greedy generation does."""
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(vl, dtype=torch.float32).eval()
    ours = load_pretrained(vl, models.from_hf_config).eval()
    ids = torch.randint(3, 140, (1, 12), generator=torch.Generator().manual_seed(1))
    ref = hf.generate(input_ids=ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = models.family(ours).generate(ours, ids, max_new_tokens=8, eos_token_id=[])
    assert torch.equal(got, ref)


def test_greedy_generation_after_images_equals_transformers(vl):
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(vl, dtype=torch.float32).eval()
    check_generation_after_images(hf, load_pretrained(vl, models.from_hf_config).eval())


def test_logits_with_videos_equal_transformers(vl):
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(vl, dtype=torch.float32).eval()
    check_video_logits(hf, load_pretrained(vl, models.from_hf_config).eval(), frames_apart=False)


def test_greedy_generation_after_videos_equals_transformers(vl):
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(vl, dtype=torch.float32).eval()
    check_generation_after_videos(hf, load_pretrained(vl, models.from_hf_config).eval(), frames_apart=False)


def test_packed_rows_with_images_equal_each_sequence_alone(vl):
    """Packing (`packing=true` on image rows): each sequence's 3-D positions start again, its images in place."""
    check_packed_rows_equal_each_alone(load_pretrained(vl, models.from_hf_config).eval())


@pytest.mark.slow
def test_fsdp_reads_the_layout_transformers_5_saves(tmp_path, capsys):
    """The demo's model in the layout transformers 5 saves (`visual.*`, `model.*`: other names of our parameters)
    under `python -m torch.distributed.run ... parallel=fsdp` on 2 ranks: each rank reads its rows of each renamed
    tensor, and the run's losses and gradient norms are one process's on the nested layout."""
    import shutil

    from safetensors.torch import load_file, save_file
    from test_fsdp_load import size_after
    from test_torchrun_resume import launch

    from minitrain.cli import run_cli

    demo = Path(__file__).resolve().parents[1] / "demo" / "vl_colours"
    hub = tmp_path / "hub"
    shutil.copytree(demo / "model", hub)
    (weights,) = hub.glob("*.safetensors")
    tensors = load_file(weights)
    assert any(k.startswith("model.language_model.") for k in tensors)
    renamed = {(k.removeprefix("model.") if k.startswith("model.visual.")
                else k.replace("model.language_model.", "model.", 1)): v for k, v in tensors.items()}
    save_file(renamed, weights, metadata={"format": "pt"})
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "sft.py"
    args = [str(recipe), f"config={demo / 'run.json'}", "max_steps=3", "eval_every=0", "eval_data=", "save_every=0"]
    assert run_cli([*args, f"model={demo / 'model'}", f"out={tmp_path / 'one'}"]) == 0, capsys.readouterr().err
    p = launch(2, [*args, f"model={hub}", f"out={tmp_path / 'two'}", "parallel=fsdp"])  # the ranks' collectives equal
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("sharded load:"))
    assert size_after(line, " read ") <= 0.55 * size_after(line, " model's "), line

    def logged(run: str) -> list[tuple[float, float]]:
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [(r["loss"], r["grad_norm"]) for r in rows if "loss" in r and "grad_norm" in r]

    one, two = logged("one"), logged("two")
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        assert a == pytest.approx(b, rel=1e-5)
