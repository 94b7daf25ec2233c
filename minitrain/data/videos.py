"""Videos: a video given as its frames -> the pixel values a Qwen vision tower reads, its patch grid and the
placeholder tokens that stand for it, with the same numbers as transformers 5's video processors that the
checkpoint's model type names (`VideoSpec.from_checkpoint`):

    Qwen2VLVideoProcessor   Qwen2.5-VL: `<|video_pad|>` x grid / merge**2 between the chat template's
                            `<|vision_start|>` and `<|vision_end|>`
    Qwen3VLVideoProcessor   Qwen3-VL (and -MoE): each temporal patch written as `<t seconds>` +
                            `<|vision_start|>` + `<|video_pad|>` x h w / merge**2 + `<|vision_end|>`, in place of
                            the template's `<|video_pad|>`

A video is a list of frame image files (`{"type": "video", "video": ["f0.png", ...]}`, TRL's and transformers'
shape), or an animated GIF / WebP, whose frames Pillow decodes. No container is read (.mp4 and the like need a
decoder minitrain does not install: one line says to give the frames). The frames are used as given, all of them
(transformers' `do_sample_frames=False`), and taken to be `fps` frames a second apart (the part's `"fps"`, else
`DEFAULT_FPS` = 2, the rate Qwen's pipelines sample videos at): Qwen3-VL's timestamps and Qwen2.5-VL's
`second_per_grid_ts` (temporal_patch_size / fps) come from it, as transformers' from the video's metadata.

The steps, in the processor's order:
    decode      each frame as an image (`images.to_rgb`: 8-bit RGB, transparency over white); all of one size
    resize      Qwen2.5-VL: `images.smart_resize` of one frame with the video's min / max pixels (`size`'s
                shortest_edge / longest_edge; defaults 128 x 28 x 28 and 768 x 28 x 28). Qwen3-VL: the same over the
                whole video (frames x height x width within the bounds; a side under one merge block scaled up first;
                fewer frames than `temporal_patch_size` refused, as transformers). Then torch's bicubic interpolation
                with antialiasing on the uint8 frames (torchvision's resize, which transformers calls)
    normalise   (x - mean / rescale) / (std / rescale) in float32 (transformers' fused rescale and normalise)
    patchify    frames padded to a multiple of `temporal_patch_size` by repeating the last; one row per patch of
                C x temporal_patch_size x p x p values, merge block by merge block, as an image's (images.py)
    grid        (frames / temporal_patch_size, H / p, W / p)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minitrain.data.collate import IGNORE_INDEX
from minitrain.data.images import CLIP_MEAN, CLIP_STD, opened, smart_resize, to_rgb
from minitrain.errors import UserError

DEFAULT_FPS = 2.0
ANIMATED = (".gif", ".webp")  # files Pillow decodes frame by frame

# the processors' defaults: transformers' Qwen2VLVideoProcessor, Qwen3VLVideoProcessor
QWEN2_VIDEO = dict(min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768, patch_size=14, image_mean=CLIP_MEAN,
                   image_std=CLIP_STD)
QWEN3_VIDEO = dict(min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768, patch_size=16, image_mean=(0.5, 0.5, 0.5),
                   image_std=(0.5, 0.5, 0.5))


@dataclass(frozen=True)
class VideoSpec:
    """A checkpoint's video processing. `whole` (Qwen3-VL): min / max pixels bound the whole video, and each
    temporal patch is written with its timestamp."""

    min_pixels: int = QWEN2_VIDEO["min_pixels"]
    max_pixels: int = QWEN2_VIDEO["max_pixels"]
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    whole: bool = False

    @classmethod
    def from_preprocessor_config(cls, d: dict | None, vision: dict | None = None, whole: bool = False) -> "VideoSpec":
        """From a video processor's config dict (`video_preprocessor_config.json`; without it transformers reads
        `preprocessor_config.json`) over the processor's defaults (Qwen3-VL's with `whole`); patch sizes it does
        not give are the tower's (`vision`). Qwen2's processor lets `min_pixels` / `max_pixels` override `size`."""
        d, vision = d or {}, vision or {}
        off = [k for k in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb") if d.get(k) is False]
        if off or d.get("cap_pixels_per_frame"):
            what = f"{off[0]}=false" if off else "cap_pixels_per_frame=true (a total pixel budget over the frames)"
            raise UserError(f"video_preprocessor_config.json: {what} is not supported yet — minitrain processes "
                            "videos as transformers' default (each frame resized within size, rescaled, normalised)")
        base = QWEN3_VIDEO if whole else QWEN2_VIDEO
        size = d.get("size") or {}
        lo, hi = size.get("shortest_edge", base["min_pixels"]), size.get("longest_edge", base["max_pixels"])
        if not whole:
            lo, hi = d.get("min_pixels") or lo, d.get("max_pixels") or hi
        return cls(min_pixels=int(lo), max_pixels=int(hi),
                   patch_size=int(d.get("patch_size", vision.get("patch_size", base["patch_size"]))),
                   temporal_patch_size=int(d.get("temporal_patch_size", vision.get("temporal_patch_size", 2))),
                   merge_size=int(d.get("merge_size", vision.get("spatial_merge_size", 2))),
                   image_mean=tuple(d.get("image_mean", base["image_mean"])),
                   image_std=tuple(d.get("image_std", base["image_std"])), whole=whole)

    def size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """The (height, width) every frame is resized to (ValueError: an aspect ratio over 200, or — Qwen3-VL —
        fewer frames than a temporal patch)."""
        factor = self.patch_size * self.merge_size
        if not self.whole:
            return smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        tp = self.temporal_patch_size
        if frames < tp:
            raise ValueError(f"{frames} frame(s): Qwen3-VL's video processor needs at least {tp}")
        if height < factor or width < factor:  # transformers' Qwen3-VL smart_resize: the short side to one block
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        if max(height, width) / min(height, width) > 200:
            raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is over 200")
        h, w, t = round(height / factor) * factor, round(width / factor) * factor, round(frames / tp) * tp
        if t * h * w > self.max_pixels:
            beta = math.sqrt(frames * height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif t * h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (frames * height * width))
            h = math.ceil(height * beta / factor) * factor
            w = math.ceil(width * beta / factor) * factor
        return h, w

    def grid_of(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The patch grid (t, h, w) of `frames` frames of (height, width) pixels."""
        H, W = self.size(frames, height, width)
        return -(-frames // self.temporal_patch_size), H // self.patch_size, W // self.patch_size

    def frame_tokens(self, grid: tuple[int, int, int]) -> int:
        """The `<|video_pad|>` tokens of one temporal patch."""
        return grid[1] * grid[2] // self.merge_size ** 2

    def seconds_per_patch(self, fps: float) -> float:
        """Qwen2.5-VL's `second_per_grid_ts` of a video of `fps` frames a second."""
        return self.temporal_patch_size / fps

    def timestamps(self, frames: int, fps: float) -> list[float]:
        """Qwen3-VL's time of each temporal patch (transformers' `_calculate_timestamps` over every frame given):
        the mean of its first and last frame's time, the frames padded as the pixels are."""
        tp = self.temporal_patch_size
        index = list(range(frames)) + [frames - 1] * (-frames % tp)
        return [(index[i] / fps + index[i + tp - 1] / fps) / 2 for i in range(0, len(index), tp)]

    def read(self, frames: list) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Pillow frames -> (pixel values (patches, C t p p) float32, grid (t, h, w))."""
        import torch
        import torch.nn.functional as F

        x = torch.from_numpy(np.stack([np.asarray(to_rgb(f)) for f in frames])).permute(0, 3, 1, 2)  # (n, C, H, W)
        n, C, H0, W0 = x.shape
        H, W = self.size(n, H0, W0)
        if (H, W) != (H0, W0):
            x = F.interpolate(x.contiguous(), size=(H, W), mode="bicubic", align_corners=False, antialias=True)
        scale = 1.0 / (1 / 255)
        mean = (torch.tensor(self.image_mean) * scale).view(-1, 1, 1)
        std = (torch.tensor(self.image_std) * scale).view(-1, 1, 1)
        x = (x.float() - mean) / std
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        if pad := -n % tp:
            x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
        t, h, w = x.shape[0] // tp, H // p, W // p
        x = x.view(t, tp, C, h // m, m, p, w // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return np.ascontiguousarray(x.reshape(t * h * w, C * tp * p * p).numpy()), (t, h, w)

    @staticmethod
    def batch(pixels: list[np.ndarray], grids: list, seconds: list[float]) -> dict:
        """A batch's videos, in order: `pixel_values_videos` (patches, C t p p), `video_grid_thw` (videos, 3),
        `second_per_grid_ts` (videos,)."""
        import torch

        return {"pixel_values_videos": torch.from_numpy(np.concatenate(pixels)),
                "video_grid_thw": torch.tensor(grids, dtype=torch.long),
                "second_per_grid_ts": torch.tensor(seconds, dtype=torch.float32)}


def frame_files(video, base: Path, where: str) -> list[Path] | Path:
    """A video as a row gives it -> its frame files (a list of paths) or its animated GIF / WebP file, resolved
    against `base` (the data file's folder). Any other file is one line saying to give the frames."""
    if isinstance(video, str) and video:
        path = Path(video) if Path(video).is_absolute() else base / video
        if path.suffix.lower() not in ANIMATED:
            raise UserError(f"{where}: video {video}: minitrain reads a video as its frames — give "
                            '"video": ["frame0.png", "frame1.png", ...] (or an animated .gif / .webp); decoding '
                            f"{path.suffix or 'this file'} needs a video reader that is not installed")
        return path
    if not isinstance(video, list) or not video or not all(isinstance(f, str) and f for f in video):
        raise UserError(f'{where}: a video must be a list of frame image paths (or an animated .gif / .webp), got '
                        f"{video!r} — fix the row")
    return [Path(f) if Path(f).is_absolute() else base / f for f in video]


def frames_of(files: list[Path] | Path, where: str = "") -> list:
    """The decoded frames (Pillow images) of `frame_files`' answer; a missing or unreadable file, or frames of
    different sizes, is one UserError naming it (and `where`, the data row)."""
    out = []
    if isinstance(files, Path):  # an animated GIF / WebP
        with opened(files, where) as image:
            for k in range(getattr(image, "n_frames", 1)):
                image.seek(k)
                out.append(image.convert("RGBA") if image.mode == "P" else image.copy())
        return out
    for f in files:
        with opened(f, where) as image:
            image.load()
            out.append(image.copy())
        same_size(f, out[-1].size, out[0].size, where)
    return out


def same_size(file: Path, size: tuple[int, int], first: tuple[int, int], where: str) -> None:
    """A frame of another (width, height) than the first: one line naming it."""
    if size != first:
        raise UserError(f"{where + ': ' if where else ''}video frame {file} is {size[0]}x{size[1]}, the first frame "
                        f"{first[0]}x{first[1]} — give frames of one size")


def frame_count_and_size(files: list[Path] | Path, where: str) -> tuple[int, int, int]:
    """(frames, height, width) of a video from its files' headers (no pixel decoded; an animated file's
    `n_frames`); every frame file's header read: a missing one, or one of another size, is one line."""
    if isinstance(files, Path):
        with opened(files, where) as image:
            n, (w, h) = getattr(image, "n_frames", 1), image.size
        return n, h, w
    sizes = []
    for f in files:
        with opened(f, where) as image:
            sizes.append(image.size)
        same_size(f, sizes[-1], sizes[0], where)
    w, h = sizes[0]
    return len(files), h, w


def video_ids(spec: VideoSpec, frames: int, grid: tuple[int, int, int], fps: float, pad: int, start: int, end: int,
              encode) -> list[int]:
    """The ids that take the place of a video's one `<|video_pad|>` (`pad`) in the chat's ids, as the checkpoint's
    processor writes them. Qwen2.5-VL: `pad` once per merge block of every temporal patch. Qwen3-VL (`whole`):
    per temporal patch, `<t seconds>` (`encode`d alone: special tokens on both sides) + `start` + `pad` x h w /
    merge**2 + `end`, t its time (`timestamps`, one decimal)."""
    n = spec.frame_tokens(grid)
    if not spec.whole:
        return [pad] * (grid[0] * n)
    out: list[int] = []
    for t in spec.timestamps(frames, fps):
        out += encode(f"<{t:.1f} seconds>") + [start] + [pad] * n + [end]
    return out


# --------------------------------------------------------------------------- video rows

# config.json's model_type -> whether its video processor is Qwen3-VL's (`VideoSpec.whole`); the families whose
# forward reads videos
VIDEO_FAMILIES = {"qwen2_5_vl": False, "qwen3_vl": True, "qwen3_vl_moe": True}


@dataclass(frozen=True)
class VideoRows:
    """How a vision-language checkpoint reads videos in chat rows: `placeholder`, the text the chat template
    writes for one video (`<|vision_start|><|video_pad|><|vision_end|>`), the ids `pad` (`video_token_id`),
    `start` and `end`, the processing (`spec`). A row's video is kept as `entry`: JSON text of its frame files
    (or animated file) and fps, which the token store keeps as it is; the frames are decoded per batch."""

    placeholder: str
    pad: int
    start: int
    end: int
    spec: VideoSpec

    @classmethod
    def from_checkpoint(cls, config: dict, processor: dict | None, decode) -> "VideoRows | None":
        """From config.json's dict and the video processor's config (None: the processor's defaults); None for a
        checkpoint whose forward reads no videos. `decode(id)` is the tokenizer's text of a token id."""
        whole = VIDEO_FAMILIES.get(config.get("model_type"))
        if whole is None or config.get("video_token_id") is None:
            return None
        pad, start, end = (int(config[k]) for k in ("video_token_id", "vision_start_token_id", "vision_end_token_id"))
        return cls(decode(start) + decode(pad) + decode(end), pad, start, end,
                   VideoSpec.from_preprocessor_config(processor, config.get("vision_config"), whole))

    @staticmethod
    def entry(files: list[Path] | Path, fps: float) -> str:
        """A video as an example keeps it: JSON text of {"frames": paths (or the animated file's), "fps"}."""
        return json.dumps({"frames": str(files) if isinstance(files, Path) else [str(f) for f in files], "fps": fps})

    @staticmethod
    def files(entry: str) -> tuple[list[Path] | Path, float]:
        """`entry`'s frame files (or animated file) and fps."""
        d = json.loads(entry)
        frames = d["frames"]
        return (Path(frames) if isinstance(frames, str) else [Path(f) for f in frames]), float(d["fps"])

    def grid(self, entry: str, where: str) -> tuple[int, tuple[int, int, int]]:
        """(frames, patch grid) of a video from its files' headers."""
        n, h, w = frame_count_and_size(self.files(entry)[0], where)
        try:
            return n, self.spec.grid_of(n, h, w)
        except ValueError as e:
            raise UserError(f"{where}: video {self.files(entry)[0]}: {e} — give more frames, or crop or pad them"
                            ) from None

    def expand(self, ids: list[int], labels: list[int], entries: list[str], tok, where: str
               ) -> tuple[list[int], list[int]]:
        """A chat's ids and labels with each video's `pad` replaced by its tokens (`video_ids`; -100 on all of
        them: a video is input, never a target). Placeholders unlike the videos in count: one line."""
        found = ids.count(self.pad)
        if found != len(entries):
            raise UserError(f"{where}: {found} video placeholder(s) in the text for {len(entries)} video(s) — give "
                            "one {\"type\": \"video\"} part per video")
        out_ids, out_labels, videos = [], [], iter(entries)
        for t, label in zip(ids, labels):
            if t != self.pad:
                out_ids.append(t)
                out_labels.append(label)
                continue
            entry = next(videos)
            n, grid = self.grid(entry, where)
            run = video_ids(self.spec, n, grid, self.files(entry)[1], self.pad, self.start, self.end,
                            lambda s: tok.encode(s, continuation=True))
            out_ids += run
            out_labels += [IGNORE_INDEX] * len(run)
        return out_ids, out_labels

    def read(self, entry: str, where: str) -> tuple[np.ndarray, tuple[int, int, int], float]:
        """A video decoded: (pixel values, grid, seconds per temporal patch)."""
        files, fps = self.files(entry)
        pixels, grid = self.spec.read(frames_of(files, where))
        return pixels, grid, self.spec.seconds_per_patch(fps)


def video_messages(messages: list[dict], column: list | None, base: Path, placeholder: str | None, where: str
                   ) -> tuple[list[dict], list[str]]:
    """A chat whose contents may hold video parts (`{"type": "video", "video": [frame paths] or "clip.gif",
    "fps": optional}`) -> (the messages with each video part a text part `placeholder`; the videos in order as
    `VideoRows.entry`, paths resolved against `base`). A part without "video" takes the next of the row's
    `videos` column; a column with no video parts puts its videos before the first user turn's text.
    `placeholder` None (a checkpoint that reads no videos, or a recipe that takes none): a video is one line."""
    column = list(column or [])
    entries: list[str] = []

    def take(video, fps, i) -> dict:
        if placeholder is None:
            raise UserError(f"{where}: messages[{i}] has a video, which is not read here: the checkpoint reads no "
                            "videos (Qwen2.5-VL and Qwen3-VL do, with a video_token_id in config.json), or this recipe "
                            "takes none yet (SFT does) — drop the video or use such a checkpoint with SFT")
        if not isinstance(fps, (int, float)) or isinstance(fps, bool) or fps <= 0:
            raise UserError(f'{where}: messages[{i}]: a video\'s "fps" must be a positive number, got {fps!r} — '
                            "fix it")
        entries.append(VideoRows.entry(frame_files(video, base, where), float(fps)))
        return {"type": "text", "text": placeholder}

    out, parts_seen = [], 0
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "video" for p in content):
            parts = []
            for p in content:
                if isinstance(p, dict) and p.get("type") == "video":
                    parts_seen += 1
                    video = p.get("video", p.get("path"))
                    if video is None:
                        if not column:
                            raise UserError(f'{where}: messages[{i}] has a video part without "video" and the row\'s '
                                            '"videos" column has no video left — give "video": [frame paths]')
                        video = column.pop(0)
                    p = take(video, p.get("fps", DEFAULT_FPS), i)
                parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    if column and parts_seen:
        raise UserError(f'{where}: {len(column)} video(s) of the "videos" column have no video part to go to — give '
                        'one {"type": "video"} part per video')
    if column:
        first = next((k for k, m in enumerate(out) if isinstance(m, dict) and m.get("role") == "user"), None)
        if first is None:
            raise UserError(f'{where}: the row has a "videos" column but no user message to put them in')
        content = out[first].get("content")
        parts = content if isinstance(content, list) else [{"type": "text", "text": str(content or "")}]
        out[first] = {**out[first], "content": [take(v, DEFAULT_FPS, first) for v in column] + parts}
    return out, entries
