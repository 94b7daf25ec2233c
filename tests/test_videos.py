"""Video processing (`minitrain/data/videos.py`) against transformers 5's video processors inside the whole
`Qwen2_5_VLProcessor` / `Qwen3VLProcessor` (tokenizer, image and video processors), frames given explicitly
(`do_sample_frames=False`, the metadata's fps ours: 2 frames a second, every frame used): pixel values, grids,
`second_per_grid_ts` and the input ids (Qwen3-VL's timestamp text included) equal, on videos of awkward sizes and
frame counts (3 frames, 1 frame, very wide, one over max_pixels scaled down, 5 frames tall). An animated GIF
reads as its frames; an .mp4, a missing frame and frames of two sizes are one line each.

transformers' video processors need torchvision (its resize, which ours reproduces with torch's bicubic
interpolation): without it the parity tests skip.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _tok import add_special_tokens, make_qwen_tokenizer
from PIL import Image

from minitrain.data.videos import VideoSpec, frame_files, frames_of, video_ids
from minitrain.errors import UserError
from minitrain.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
FPS = 2.0
# video processor configs (small sizes, so that the big video is scaled down): Qwen2.5-VL's keys, Qwen3-VL's
QWEN2 = {"size": {"shortest_edge": 8 * 8 * 2, "longest_edge": 16 * 16 * 6}, "patch_size": 4}
QWEN3 = {"size": {"shortest_edge": 8 * 8 * 2, "longest_edge": 16 * 16 * 12}, "patch_size": 4,
         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
# name -> (frames, height, width)
VIDEOS = {"odd": (3, 30, 50), "one": (1, 20, 20), "wide": (4, 12, 200), "big": (2, 90, 120), "tall": (5, 70, 14)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("videos")
    make_qwen_tokenizer(d)
    add_special_tokens(d, TOKENS)
    rng = np.random.default_rng(0)
    for name, (n, h, w) in VIDEOS.items():
        for k in range(n):
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(d / f"{name}{k}.png")
    return d


def paths(folder, name):
    return [folder / f"{name}{k}.png" for k in range(VIDEOS[name][0])]


def reference(folder, kind: str):
    """(transformers' whole processor, our spec) for `kind`."""
    pytest.importorskip("torchvision")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    image = transformers.Qwen2VLImageProcessorPil(patch_size=4)
    if kind == "qwen2_5_vl":
        video = transformers.Qwen2VLVideoProcessor(**QWEN2, cap_pixels_per_frame=False)
        return transformers.Qwen2_5_VLProcessor(image_processor=image, tokenizer=tok, video_processor=video), \
            VideoSpec.from_preprocessor_config(QWEN2)
    video = transformers.Qwen3VLVideoProcessor(**QWEN3, cap_pixels_per_frame=False)
    return transformers.Qwen3VLProcessor(image_processor=image, tokenizer=tok, video_processor=video), \
        VideoSpec.from_preprocessor_config(QWEN3, whole=True)


def processed(proc, frames: list, text: str):
    from transformers.video_utils import VideoMetadata

    meta = VideoMetadata(total_num_frames=len(frames), fps=FPS, frames_indices=list(range(len(frames))))
    return proc(text=[text], videos=[frames], do_sample_frames=False, video_metadata=[meta], return_tensors="pt")


KINDS = pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
TEXT = "Look: <|vision_start|><|video_pad|><|vision_end|> what moves?"


@KINDS
@pytest.mark.parametrize("name", list(VIDEOS))
def test_pixels_grid_and_ids_equal_the_processor(folder, kind, name):
    proc, spec = reference(folder, kind)
    frames = frames_of(paths(folder, name))
    if kind == "qwen3_vl" and name == "one":  # fewer frames than a temporal patch: transformers refuses too
        with pytest.raises(ValueError):
            processed(proc, frames, TEXT)
        with pytest.raises(ValueError, match="at least 2"):
            spec.read(frames)
        return
    ref = processed(proc, frames, TEXT)
    pixels, grid = spec.read(frames)
    assert grid == tuple(ref["video_grid_thw"][0].tolist()) == spec.grid_of(*VIDEOS[name])
    assert torch.equal(torch.from_numpy(pixels), ref["pixel_values_videos"])
    if kind == "qwen2_5_vl":
        assert torch.equal(torch.tensor([spec.seconds_per_patch(FPS)]), torch.as_tensor(ref["second_per_grid_ts"]))
    tok = Tokenizer.from_folder(folder)
    ids = tok.encode(TEXT)
    pad, start, end = (tok.token_to_id(t) for t in ("<|video_pad|>", "<|vision_start|>", "<|vision_end|>"))
    at = ids.index(pad)
    ours = ids[:at] + video_ids(spec, len(frames), grid, FPS, pad, start, end,
                                lambda s: tok.encode(s, continuation=True)) + ids[at + 1:]
    assert ours == ref["input_ids"][0].tolist()


@KINDS
def test_an_animated_gif_reads_as_its_frames(folder, tmp_path, kind):
    """Frames of few colours (a GIF's palette keeps them exact) written as PNGs and as one GIF: the same pixels."""
    rng = np.random.default_rng(1)
    frames = [Image.fromarray((rng.integers(0, 4, (18, 26, 3)) * 80).astype(np.uint8)) for _ in range(3)]
    frames[0].save(tmp_path / "clip.gif", save_all=True, append_images=frames[1:], duration=500, loop=0)
    files = frame_files("clip.gif", tmp_path, "rows.jsonl:1")
    spec = reference(folder, kind)[1] if kind == "qwen3_vl" else VideoSpec.from_preprocessor_config(QWEN2)
    a, b = spec.read(frames_of(files)), spec.read(frames)
    assert a[1] == b[1] and np.array_equal(a[0], b[0])


def test_a_container_file_a_missing_frame_and_mixed_sizes_are_one_line(folder, tmp_path):
    with pytest.raises(UserError, match=r"rows.jsonl:2: video clip.mp4: minitrain reads a video as its frames"):
        frame_files("clip.mp4", tmp_path, "rows.jsonl:2")
    with pytest.raises(UserError, match=r"rows.jsonl:3: image .*gone.png does not exist"):
        frames_of(frame_files(["odd0.png", "gone.png"], folder, "rows.jsonl:3"), "rows.jsonl:3")
    with pytest.raises(UserError, match=r"video frame .*wide0.png is 200x12, the first frame 50x30 — give frames"):
        frames_of(frame_files(["odd0.png", "wide0.png"], folder, "x"), "x")
    with pytest.raises(UserError, match="a video must be a list of frame image paths"):
        frame_files([], folder, "x")


HUB_QWEN2_5_VL = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                  "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                  "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor",
                  "processor_class": "Qwen2_5_VLProcessor"}  # the Hub's Qwen2.5-VL preprocessor_config.json


@pytest.mark.parametrize("case", ["saved_qwen2", "saved_qwen3", "hub_qwen2_5_vl"])
def test_the_video_config_is_read_as_transformers_reads_it(tmp_path, case):
    """A folder with transformers' own `video_preprocessor_config.json` (Qwen2-VL's, Qwen3-VL's processor saved),
    or only the Hub's Qwen2.5-VL `preprocessor_config.json` (which transformers' video processor reads then): our
    spec has the sizes, patches, mean and std of `AutoVideoProcessor.from_pretrained`."""
    pytest.importorskip("torchvision")
    import json

    if case == "saved_qwen2":
        transformers.Qwen2VLVideoProcessor(**QWEN2).save_pretrained(tmp_path)
    elif case == "saved_qwen3":
        transformers.Qwen3VLVideoProcessor(**QWEN3).save_pretrained(tmp_path)
    else:
        (tmp_path / "preprocessor_config.json").write_text(json.dumps(HUB_QWEN2_5_VL))
    ref = transformers.AutoVideoProcessor.from_pretrained(tmp_path)
    name = "video_preprocessor_config.json" if case.startswith("saved") else "preprocessor_config.json"
    spec = VideoSpec.from_preprocessor_config(json.loads((tmp_path / name).read_text()), whole=case == "saved_qwen3")
    assert type(ref).__name__ == ("Qwen3VLVideoProcessor" if case == "saved_qwen3" else "Qwen2VLVideoProcessor")
    assert (spec.min_pixels, spec.max_pixels) == (ref.size["shortest_edge"], ref.size["longest_edge"])
    assert (spec.patch_size, spec.temporal_patch_size, spec.merge_size) == (ref.patch_size, ref.temporal_patch_size,
                                                                           ref.merge_size)
    assert spec.image_mean == tuple(ref.image_mean) and spec.image_std == tuple(ref.image_std)


def test_settings_minitrain_does_not_follow_are_one_line():
    for bad in ({"cap_pixels_per_frame": True}, {"do_normalize": False}):
        with pytest.raises(UserError, match="video_preprocessor_config.json: .* is not supported yet"):
            VideoSpec.from_preprocessor_config(bad)
