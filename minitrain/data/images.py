"""Images: an image file -> the pixel values a Qwen2-VL / Qwen2.5-VL vision tower reads, its patch grid,
and how many placeholder tokens stand for it in the ids. The same numbers as transformers' Qwen2-VL image
processor (its Pillow path), which the checkpoints' `preprocessor_config.json` describe.

The steps, in the processor's order:
    decode      Pillow opens the file; an image with transparency is laid over white, every mode
                (grey L, palette, CMYK, 16-bit I;16) converted to 8-bit RGB by Pillow's own `convert`
    resize      `smart_resize`: both sides the nearest multiple of `patch_size * merge_size`, scaled down
                when the area is over `max_pixels` and up when under `min_pixels`, the aspect kept; then
                Pillow's bicubic resize (always, even to the same size)
    rescale     x / 255 in float64, stored as float32
    normalise   (x - mean) / std per channel (CLIP's mean and std by default), float32
    patchify    (C, H, W) -> one row per patch of C x temporal_patch_size x p x p values (an image repeats
                its one frame), patches ordered merge block by merge block (row-major), row-major inside
    grid        (1, H / p, W / p); the language model sees one token per merge block: grid product /
                merge_size**2 placeholders (`<|image_pad|>`) in the ids

Qwen3-VL's checkpoints use the same image processor, set by their own `preprocessor_config.json` (patches of 16
pixels, mean and std 0.5): `ImageSpec.from_preprocessor_config` reads either.

Pillow is the optional `vision` extra: without it, one line naming the extra (`pillow`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minitrain.errors import UserError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def pillow():
    """The `PIL.Image` module, or one clear line naming the extra that installs it."""
    try:
        from PIL import Image
    except ImportError:
        raise UserError("reading images needs Pillow — pip install 'minitrain[vision]' (or pip install pillow)") from None
    return Image


@dataclass(frozen=True)
class ImageSpec:
    """What a checkpoint's `preprocessor_config.json` says (the Qwen2-VL image processor's defaults)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD

    @classmethod
    def from_preprocessor_config(cls, d: dict, vision: dict | None = None) -> "ImageSpec":
        """From a `preprocessor_config.json` dict (`size.shortest_edge` / `longest_edge` or the older
        `min_pixels` / `max_pixels`); the patch sizes it does not give are the tower's (`vision`: config.json's
        `vision_config`), then the processor's defaults."""
        size, vision = d.get("size") or {}, vision or {}
        return cls(min_pixels=d.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels,
                   max_pixels=d.get("max_pixels") or size.get("longest_edge") or cls.max_pixels,
                   patch_size=d.get("patch_size", vision.get("patch_size", cls.patch_size)),
                   temporal_patch_size=d.get("temporal_patch_size", vision.get("temporal_patch_size",
                                                                               cls.temporal_patch_size)),
                   merge_size=d.get("merge_size", vision.get("spatial_merge_size", cls.merge_size)),
                   image_mean=tuple(d.get("image_mean", CLIP_MEAN)), image_std=tuple(d.get("image_std", CLIP_STD)))

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """The placeholder tokens of an image with patch grid `grid` (t, h, w)."""
        return grid[0] * grid[1] * grid[2] // self.merge_size ** 2


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) -> the size the image is resized to: multiples of `factor`, the area within
    [min_pixels, max_pixels] (as near as multiples allow), the aspect ratio kept as closely as possible.
    An aspect ratio over 200 is a ValueError, as transformers'."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is over 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def to_rgb(image):
    """A Pillow image as 8-bit RGB; transparency (an alpha band or a transparent colour) laid over white."""
    Image = pillow()
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image).convert("RGB")
    return image.convert("RGB")


def process(image, spec: ImageSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """A Pillow image -> (pixel values (patches, C t p p) float32, grid (1, h, w))."""
    Image = pillow()
    image = to_rgb(image)
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    H, W = smart_resize(image.height, image.width, p * m, spec.min_pixels, spec.max_pixels)
    x = np.asarray(image.resize((W, H), resample=Image.BICUBIC)).transpose(2, 0, 1)  # (C, H, W) uint8
    x = (x.astype(np.float64) * (1 / 255)).astype(np.float32)
    x = (x - np.array(spec.image_mean, np.float32)[:, None, None]) / np.array(spec.image_std, np.float32)[:, None, None]
    C, h, w = x.shape[0], H // p, W // p
    x = x.reshape(C, h // m, m, p, w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (h/m, w/m, m, m, C, p, p)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], tp, p, p))  # the frame repeated
    return np.ascontiguousarray(x.reshape(h * w, C * tp * p * p)), (1, h, w)


def load_image(path: str | Path, spec: ImageSpec, where: str = "") -> tuple[np.ndarray, tuple[int, int, int]]:
    """`process` of the image file `path`; a missing or unreadable file is one UserError naming it (and
    `where`, the data row it came from)."""
    Image = pillow()
    at = f"{where}: " if where else ""
    try:
        with Image.open(path) as image:
            image.load()
            return process(image, spec)
    except FileNotFoundError:
        raise UserError(f"{at}image {path} does not exist — fix the path (relative paths are read from the data "
                        "file's folder)") from None
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise UserError(f"{at}image {path} cannot be read ({e}) — replace or remove it") from None


def expand_placeholders(ids: list[int], image_token_id: int, counts: list[int], where: str = "") -> tuple[list[int], list[int]]:
    """Each `image_token_id` of `ids` (one per image, in order) repeated `counts[i]` times -> (the ids, the
    positions where each image's run starts). A count of placeholders unlike the count of images is one
    UserError naming `where`."""
    found = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(found) != len(counts):
        raise UserError(f"{where + ': ' if where else ''}{len(found)} image placeholder(s) in the text for "
                        f"{len(counts)} image(s) — give one image per image content part")
    out, starts, prev = [], [], 0
    for i, n in zip(found, counts):
        out += ids[prev:i]
        starts.append(len(out))
        out += [image_token_id] * n
        prev = i + 1
    return out + ids[prev:], starts


# --------------------------------------------------------------------------- image rows


@dataclass(frozen=True)
class ImageRows:
    """How a vision-language checkpoint reads images in chat rows: `placeholder`, the text its chat template
    writes for one image (Qwen2.5-VL: `<|vision_start|><|image_pad|><|vision_end|>`), `token_id` (the one
    placeholder token that stands for the image's features, repeated once per feature), `spec` (the image
    processing)."""

    placeholder: str
    token_id: int
    spec: ImageSpec

    @classmethod
    def from_checkpoint(cls, config: dict, preprocessor: dict | None, decode) -> "ImageRows | None":
        """From a checkpoint's config.json and preprocessor_config.json dicts (None: a text-only checkpoint,
        no `image_token_id`); `decode(id)` is the tokenizer's text of a token id."""
        image = config.get("image_token_id")
        if image is None:
            return None
        start, end = config.get("vision_start_token_id"), config.get("vision_end_token_id")
        text = "".join(decode(i) for i in (start, image, end) if i is not None)
        return cls(text, int(image), ImageSpec.from_preprocessor_config(preprocessor or {}, config.get("vision_config")))

    def grid(self, path: Path, where: str) -> tuple[int, int, int]:
        """The patch grid of the image file `path` from its header alone (no pixel is decoded)."""
        Image = pillow()
        try:
            with Image.open(path) as image:
                w, h = image.size
        except FileNotFoundError:
            raise UserError(f"{where}: image {path} does not exist — fix the path (relative paths are read from the "
                            "data file's folder)") from None
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise UserError(f"{where}: image {path} cannot be read ({e}) — replace or remove it") from None
        s = self.spec
        try:
            H, W = smart_resize(h, w, s.patch_size * s.merge_size, s.min_pixels, s.max_pixels)
        except ValueError as e:
            raise UserError(f"{where}: image {path}: {e} — crop or pad it") from None
        return 1, H // s.patch_size, W // s.patch_size


def image_messages(messages: list[dict], column: list | None, base: Path, placeholder: str, where: str
                   ) -> tuple[list[dict], list[Path]]:
    """A chat whose contents may be lists of parts (`{"type": "text", "text"}`, `{"type": "image", "image":
    path}`: TRL's shape) -> (the messages with string contents, each image part as `placeholder`; the image
    paths in order, resolved against `base`). A part `{"type": "image"}` without a path takes the next path
    of the row's `images` column; a column with no image parts puts its images before the first user turn's
    text."""
    column = list(column or [])
    paths: list[Path] = []
    out, parts_seen = [], 0
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None  # (a malformed message: the chat's checks say so)
        if isinstance(content, list):
            text = ""
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    text += str(part.get("text", ""))
                elif kind == "image":
                    parts_seen += 1
                    src = part.get("image") or part.get("path")
                    if src is None:
                        if not column:
                            raise UserError(f"{where}: messages[{i}] has an image part without a path and the row's "
                                            f'"images" column has no image left — give "image": "path"')
                        src = column.pop(0)
                    if not isinstance(src, str) or not src:
                        raise UserError(f"{where}: messages[{i}]: an image part's \"image\" must be a path, got "
                                        f"{src!r} — fix the row")
                    paths.append(Path(src))
                    text += placeholder
                else:
                    raise UserError(f"{where}: messages[{i}]: content part {part!r} — use {{\"type\": \"text\", "
                                    f"\"text\": ...}} or {{\"type\": \"image\", \"image\": \"path\"}}")
            m = {**m, "content": text}
        out.append(m)
    if column and parts_seen:
        raise UserError(f'{where}: {len(column)} image(s) of the "images" column have no image part to go to — give '
                        "one {\"type\": \"image\"} part per image")
    if column:  # images beside plain-text messages: before the first user message's text
        first = next((k for k, m in enumerate(out) if m.get("role") == "user"), None)
        if first is None:
            raise UserError(f'{where}: the row has an "images" column but no user message to put them in')
        out[first] = {**out[first], "content": placeholder * len(column) + out[first]["content"]}
        paths = [Path(p) for p in column]
    return out, [p if p.is_absolute() else base / p for p in paths]


def collate_images(examples, collate, spec: ImageSpec) -> dict:
    """`collate(examples)` plus, when the examples carry images, `pixel_values` (patches, C t p p) float32
    and `image_grid_thw` (images, 3): each image decoded now, for this batch only, in order."""
    import torch

    batch = collate(examples)
    pixels, grids = [], []
    for ex in examples:
        for path in ex.get("images", ()):
            p, g = load_image(path, spec, ex.get("where", ""))
            pixels.append(p)
            grids.append(g)
    if pixels:
        batch["pixel_values"] = torch.from_numpy(np.concatenate(pixels))
        batch["image_grid_thw"] = torch.tensor(grids, dtype=torch.long)
    return batch
