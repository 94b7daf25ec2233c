"""Image processing (`minitrain/data/images.py`) against transformers' Qwen2-VL image processor (its Pillow
path, `Qwen2VLImageProcessorPil`), on awkward images made here with Pillow: 1x1, very wide, very tall,
grey (L), RGBA, a palette image with a transparent colour, a CMYK JPEG, a 16-bit PNG, one over
`max_pixels` (resized down, not refused). Pixel values and grids equal to the bit; the ids with each
`<|image_pad|>` expanded equal the text expanded by the processor's own `replace_image_token`, tokenized. (The
whole `Qwen2_5_VLProcessor` / `Qwen3VLProcessor` cannot be built here: its video processor needs torchvision.)

Gemma 4's (`Gemma4ImageProcessorPil`: each image within a patch budget, patches padded to it) on the same
images: pixel values, patch positions and soft-token counts to the bit.

Each Qwen check runs for two checkpoints' processors: Qwen2.5-VL's (the Qwen2-VL image processor's defaults,
patches of 14, CLIP's mean and std) and Qwen3-VL's (the same image processor as the Hub's Qwen3-VL
`preprocessor_config.json` sets it: patches of 16, mean and std 0.5; its sizes made small here), our
`ImageSpec` read from the same dict transformers' processor is built from.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from minitrain.data.images import ImageSpec, expand_placeholders, load_image
from minitrain.errors import UserError

transformers = pytest.importorskip("transformers")

MAX = 28 * 28 * 16  # small, so that the big image is scaled down and the test stays fast
# the Hub's Qwen3-VL preprocessor_config.json (Qwen/Qwen3-VL-*-Instruct), its sizes small as MAX
QWEN3_VL = {"size": {"longest_edge": 32 * 32 * 16, "shortest_edge": 32 * 32 * 2}, "patch_size": 16,
            "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
            "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast"}


def qwen2_5_vl():
    hf = transformers.Qwen2VLImageProcessorPil(max_pixels=MAX)
    return hf, ImageSpec(max_pixels=MAX), transformers.Qwen2_5_VLProcessor


def qwen3_vl():
    hf = transformers.Qwen2VLImageProcessorPil(**{k: v for k, v in QWEN3_VL.items() if not k.endswith("_type")
                                                  and k != "processor_class"})
    return hf, ImageSpec.from_preprocessor_config(QWEN3_VL), transformers.Qwen3VLProcessor


PROCESSORS = pytest.mark.parametrize("processor", [qwen2_5_vl, qwen3_vl], ids=["qwen2_5_vl", "qwen3_vl"])


def awkward(folder: Path) -> dict[str, Path]:
    rng = np.random.default_rng(0)
    rgb = lambda h, w: Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))  # noqa: E731
    out = {}

    def save(name: str, image, **kw) -> None:
        out[name] = folder / name
        image.save(out[name], **kw)

    save("one.png", rgb(1, 1))
    save("wide.png", rgb(3, 500))
    save("tall.png", rgb(420, 5))
    save("grey.png", Image.fromarray(rng.integers(0, 256, (37, 61), dtype=np.uint8), "L"))
    save("rgba.png", Image.fromarray(rng.integers(0, 256, (45, 33, 4), dtype=np.uint8), "RGBA"))
    pal = rgb(30, 40).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    save("palette.png", pal, transparency=3)
    save("cmyk.jpg", rgb(50, 70).convert("CMYK"), quality=90)
    save("deep.png", Image.fromarray(rng.integers(0, 65536, (29, 43), dtype=np.uint16)))  # mode I;16
    save("big.jpg", rgb(300, 420), quality=90)
    return out


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return awkward(tmp_path_factory.mktemp("images"))


@PROCESSORS
def test_pixel_values_and_grids_equal_the_processor(images, processor):
    assert Image.open(images["deep.png"]).mode.startswith("I;16") and Image.open(images["cmyk.jpg"]).mode == "CMYK"
    hf, spec, _ = processor()
    assert (spec.patch_size, spec.image_mean) == (hf.patch_size, tuple(hf.image_mean))
    for name, path in images.items():
        with Image.open(path) as im:
            ref = hf(images=[im], return_tensors="np")
        pixels, grid = load_image(path, spec)
        assert grid == tuple(ref["image_grid_thw"][0]), name
        assert pixels.dtype == np.float32 and np.array_equal(pixels, ref["pixel_values"]), name
        assert grid[1] * grid[2] * spec.patch_size ** 2 <= spec.max_pixels or name in ("wide.png", "tall.png"), name


@PROCESSORS
def test_expanded_ids_equal_the_processor(images, tmp_path, processor):
    sys.path.insert(0, str(Path(__file__).parent))
    from _tok import make_qwen_tokenizer

    tok = transformers.AutoTokenizer.from_pretrained(make_qwen_tokenizer(tmp_path / "tok"))
    tok.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]})
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    hf, spec, hf_processor = processor()
    paths = [images["wide.png"], images["big.jpg"], images["one.png"]]
    inputs = hf(images=[Image.open(p) for p in paths], return_tensors="np")
    fake = types.SimpleNamespace(image_processor=hf, image_token="<|image_pad|>")
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    parts = ["Look at ", image, " and ", image, image, " then say what you see."]
    expanded, n = "", 0
    for part in parts:
        if part == image:
            part = part.replace("<|image_pad|>", hf_processor.replace_image_token(fake, inputs, n))
            n += 1
        expanded += part
    counts = [spec.tokens(load_image(p, spec)[1]) for p in paths]
    ids, starts = expand_placeholders(tok("".join(parts))["input_ids"], pad, counts)
    assert ids == tok(expanded)["input_ids"]
    assert [ids[s:s + c] == [pad] * c for s, c in zip(starts, counts)] == [True] * 3


# Gemma 4's image processor (`Gemma4ImageProcessorPil`) with the smallest budget it takes, at the Hub's patches of
# 16 pooled 3 x 3, and at patches of 8 pooled 2 x 2 (as a small tower would have them)
GEMMA4 = [dict(max_soft_tokens=70), dict(max_soft_tokens=70, patch_size=8, pooling_kernel_size=2)]


@pytest.mark.parametrize("kw", GEMMA4, ids=["p16k3", "p8k2"])
def test_gemma4_pixel_values_and_positions_equal_the_processor(images, kw):
    """Each awkward image resized within the patch budget, its aspect kept (the wide and tall ones at one pooled
    row / column), cut into patches and padded to the budget: pixel values, patch positions and soft-token
    counts (from the header alone) equal to the bit."""
    from minitrain.data.images import BudgetSpec, processor_spec

    hf = transformers.Gemma4ImageProcessorPil(**kw)
    spec = processor_spec({"image_processor_type": "Gemma4ImageProcessor", **kw}, {"model_type": "gemma4"})
    assert spec == BudgetSpec(**kw)
    for name, path in images.items():
        with Image.open(path) as im:
            ref = hf(images=[im], return_tensors="np")
            count = spec.count(im.height, im.width)
        pixels, positions = load_image(path, spec)
        assert pixels.dtype == np.float32 and np.array_equal(pixels, ref["pixel_values"][0]), name
        assert np.array_equal(positions, ref["image_position_ids"][0]), name
        assert count == ref["num_soft_tokens_per_image"][0] == (positions[:, 0] >= 0).sum() // spec.pooling_kernel_size ** 2


def test_gemma4_processor_settings_we_cannot_honour_are_one_line():
    from minitrain.data.images import processor_spec

    gemma4 = {"model_type": "gemma4", "vision_config": {"patch_size": 16, "pooling_kernel_size": 3}}
    with pytest.raises(UserError, match="max_soft_tokens=100"):
        processor_spec({"image_processor_type": "Gemma4ImageProcessor", "max_soft_tokens": 100}, gemma4)
    with pytest.raises(UserError, match="patch_size=14 is not the tower's 16"):
        processor_spec({"image_processor_type": "Gemma4ImageProcessor", "patch_size": 14}, gemma4)
    with pytest.raises(UserError, match="do_resize=false"):
        processor_spec({"image_processor_type": "Gemma4ImageProcessorPil", "do_resize": False}, gemma4)


def test_a_missing_or_broken_image_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"rows.jsonl:3: image .*nope.png does not exist"):
        load_image(tmp_path / "nope.png", ImageSpec(), "rows.jsonl:3")
    (tmp_path / "bad.png").write_bytes(b"not a png")
    with pytest.raises(UserError, match="cannot be read"):
        load_image(tmp_path / "bad.png", ImageSpec(), "rows.jsonl:4")
    with pytest.raises(UserError, match="2 image placeholder"):
        expand_placeholders([5, 9, 9], 9, [4])


def test_without_pillow_one_line(tmp_path):
    """Pillow hidden: one line naming the `vision` extra, exit 2 for the CLI (a UserError)."""
    code = ("import sys; sys.modules['PIL'] = None\n"
            "from minitrain.data.images import load_image, ImageSpec\n"
            "from minitrain.errors import UserError\n"
            "try:\n    load_image('x.png', ImageSpec())\nexcept UserError as e:\n    print(e); sys.exit(e.exit_code)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2 and "pip install 'minitrain[vision]'" in r.stdout


def test_spec_from_the_checkpoint_files():
    vision = {"patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2}
    assert ImageSpec.from_preprocessor_config({}, vision) == ImageSpec(patch_size=4)
    spec = ImageSpec.from_preprocessor_config({"size": {"shortest_edge": 100, "longest_edge": 900}, "patch_size": 14}, vision)
    assert (spec.min_pixels, spec.max_pixels, spec.patch_size, spec.merge_size) == (100, 900, 14, 2)
    assert ImageSpec.from_preprocessor_config({"min_pixels": 5, "max_pixels": 7}).max_pixels == 7
