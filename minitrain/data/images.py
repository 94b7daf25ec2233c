"""Images: an image file -> the pixel values a vision tower reads and how many placeholder tokens stand for
it in the ids, with the same numbers as transformers' image processor (its Pillow path) that the checkpoint's
`preprocessor_config.json` names (`image_processor_type`; `processor_spec`):

    Qwen2VLImageProcessor   Qwen2-VL / Qwen2.5-VL (`ImageSpec`): each image at its own size, in patches
    Gemma3ImageProcessor    Gemma 3 (`SquareSpec`): every image resized to one square, a fixed token count
    Gemma4ImageProcessor    Gemma 4 (`BudgetSpec`): each image at its own size within a patch budget, padded to it

The steps, in the processor's order (the first, third and fourth shared: `normalised`):
    decode      Pillow opens the file; an image with transparency is laid over white, every mode
                (grey L, palette, CMYK, 16-bit I;16) converted to 8-bit RGB by Pillow's own `convert`
    resize      Qwen: `smart_resize`: both sides the nearest multiple of `patch_size * merge_size`, scaled
                down when the area is over `max_pixels` and up when under `min_pixels`, the aspect kept;
                Pillow's bicubic resize (always, even to the same size). Gemma 3: to `size` (height x width,
                the tower's image_size), the aspect not kept, with the config's `resample` (bilinear). Gemma 4:
                the largest size, the aspect kept, within `max_soft_tokens * pooling_kernel_size**2` patches
                whose sides are multiples of `pooling_kernel_size * patch_size` (`budget_size`), bicubic
    rescale     x * rescale_factor (1 / 255) in float64, stored as float32
    normalise   (x - mean) / std per channel (Qwen: CLIP's mean and std; Gemma 3: 0.5 and 0.5; Gemma 4: none,
                its tower maps [0, 1] itself), float32
    Qwen:
    patchify    (C, H, W) -> one row per patch of C x temporal_patch_size x p x p values (an image repeats
                its one frame), patches ordered merge block by merge block (row-major), row-major inside
    grid        (1, H / p, W / p); the language model sees one token per merge block: grid product /
                merge_size**2 placeholders (`<|image_pad|>`) in the ids
    Gemma 3:    pixel values (3, H, W) per image; `mm_tokens_per_image` soft tokens, which the processor
                writes as `\n\n<start_of_image>` + `<image_soft_token>` x n + `<end_of_image>\n\n` in place
                of the `<start_of_image>` the chat template writes (`ImageRows.expand`). Pan-and-scan crops
                (`do_pan_and_scan: true`) are refused.
    Gemma 4:    (H / p) (W / p) patches, each a row of p x p x C values (row-major patches, channels last),
                zero rows after them up to the budget (`pixel_values` (images, budget, p p C)); each patch's (x, y)
                in its grid, (-1, -1) on the padding (`image_position_ids`); patches / pooling_kernel_size**2
                soft tokens, which the processor writes as `<|image>` + `<|image|>` x n + `<image|>` in place of
                the `<|image|>` the chat template writes (`ImageRows.wrap`).

Qwen3-VL's and multimodal Qwen3.5's checkpoints use the same image processor, set by their own `preprocessor_config.json` (patches of 16
pixels, mean and std 0.5): `ImageSpec.from_preprocessor_config` reads either.

Pillow is the optional `vision` extra: without it, one line naming the extra (`pillow`).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minitrain.data.collate import IGNORE_INDEX
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

    def grid_of(self, height: int, width: int) -> tuple[int, int, int]:
        """The patch grid of an image of (height, width) pixels (ValueError: an aspect ratio over 200)."""
        H, W = smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)
        return 1, H // self.patch_size, W // self.patch_size

    def count(self, height: int, width: int) -> int:
        """The placeholder tokens of an image of (height, width) pixels."""
        return self.tokens(self.grid_of(height, width))

    def read(self, image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """`process`: (pixel values (patches, C t p p), grid (1, h, w))."""
        return process(image, self)

    @staticmethod
    def batch(pixels: list[np.ndarray], grids: list) -> dict:
        """A batch's images, in order: `pixel_values` (patches, C t p p), `image_grid_thw` (images, 3)."""
        import torch

        return {"pixel_values": torch.from_numpy(np.concatenate(pixels)),
                "image_grid_thw": torch.tensor(grids, dtype=torch.long)}


@dataclass(frozen=True)
class SquareSpec:
    """Gemma 3's image processor (`Gemma3ImageProcessor`, its Pillow path): every image resized to `height` x
    `width` (the tower's image_size) with Pillow's `resample` filter (2: bilinear), rescaled, normalised
    with mean and std 0.5; `tokens_per_image` (config.json's `mm_tokens_per_image`) soft tokens each."""

    height: int = 896
    width: int = 896
    resample: int = 2
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    tokens_per_image: int = 256

    @classmethod
    def from_preprocessor_config(cls, d: dict, config: dict | None = None) -> "SquareSpec":
        """From a `preprocessor_config.json` dict and config.json's (`vision_config.image_size`, the size when
        the processor gives none; `mm_tokens_per_image`). Pan-and-scan, or a step switched off, is one line."""
        where = "preprocessor_config.json"
        if d.get("do_pan_and_scan"):
            raise UserError(f"{where}: do_pan_and_scan=true (Gemma 3's pan-and-scan crops) is not supported yet — "
                            "set it to false")
        off = [k for k in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb") if d.get(k) is False]
        if off:
            raise UserError(f"{where}: {off[0]}=false is not supported — minitrain resizes, rescales, normalises "
                            "and converts to RGB as the checkpoint was trained; remove it")
        config = config or {}
        side = (config.get("vision_config") or {}).get("image_size", cls.height)
        size = d.get("size") or {"height": side, "width": side}
        if not isinstance(size, dict) or "height" not in size or "width" not in size:
            raise UserError(f"{where}: size {size!r} — Gemma 3's processor resizes to {{'height', 'width'}}")
        if (size["height"], size["width"]) != (side, side):
            raise UserError(f"{where}: size {size['height']}x{size['width']} is not the tower's image_size {side} — "
                            "restore the checkpoint's file")
        return cls(height=int(size["height"]), width=int(size["width"]), resample=int(d.get("resample", cls.resample)),
                   rescale_factor=float(d.get("rescale_factor", cls.rescale_factor)),
                   image_mean=tuple(d.get("image_mean", cls.image_mean)), image_std=tuple(d.get("image_std", cls.image_std)),
                   tokens_per_image=int(config.get("mm_tokens_per_image", cls.tokens_per_image)))

    def count(self, height: int, width: int) -> int:
        """The soft tokens of any image: `tokens_per_image`."""
        return self.tokens_per_image

    def read(self, image) -> tuple[np.ndarray, None]:
        """A Pillow image -> (pixel values (C, height, width) float32, None)."""
        return normalised(image, (self.height, self.width), self.resample, self.rescale_factor, self.image_mean,
                          self.image_std), None

    @staticmethod
    def batch(pixels: list[np.ndarray], grids: list) -> dict:
        """A batch's images, in order: `pixel_values` (images, C, H, W)."""
        import torch

        return {"pixel_values": torch.from_numpy(np.stack(pixels))}


GEMMA4_SOFT_TOKENS = (70, 140, 280, 560, 1120)  # the budgets transformers' Gemma 4 image processor accepts


@dataclass(frozen=True)
class BudgetSpec:
    """Gemma 4's image processor (`Gemma4ImageProcessor`, its Pillow path): each image resized, its aspect kept,
    to `budget_size` with Pillow's bicubic filter, rescaled (normalised only with `do_normalize`), cut into
    patches of `patch_size` and padded to the budget of `max_soft_tokens * pooling_kernel_size**2` patches."""

    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3
    resample: int = 3
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    image_std: tuple[float, ...] = (1.0, 1.0, 1.0)

    @classmethod
    def from_preprocessor_config(cls, d: dict, config: dict | None = None) -> "BudgetSpec":
        """From a `preprocessor_config.json` dict and config.json's (`vision_config`: the patch size and pooling
        the processor's must equal). A step switched off, or a budget transformers refuses, is one line."""
        where = "preprocessor_config.json"
        off = [k for k in ("do_resize", "do_rescale", "do_convert_rgb") if d.get(k) is False]
        if off:
            raise UserError(f"{where}: {off[0]}=false is not supported — minitrain resizes, rescales and converts to "
                            "RGB as the checkpoint was trained; remove it")
        vision = (config or {}).get("vision_config") or {}
        spec = cls(patch_size=int(d.get("patch_size", vision.get("patch_size", cls.patch_size))),
                   max_soft_tokens=int(d.get("max_soft_tokens", cls.max_soft_tokens)),
                   pooling_kernel_size=int(d.get("pooling_kernel_size",
                                                 vision.get("pooling_kernel_size", cls.pooling_kernel_size))),
                   resample=int(d.get("resample", cls.resample)),
                   rescale_factor=float(d.get("rescale_factor", cls.rescale_factor)),
                   **({"image_mean": tuple(d.get("image_mean", cls.image_mean)),
                       "image_std": tuple(d.get("image_std", cls.image_std))} if d.get("do_normalize") else {}))
        if spec.max_soft_tokens not in GEMMA4_SOFT_TOKENS:
            raise UserError(f"{where}: max_soft_tokens={spec.max_soft_tokens} — Gemma 4's processor takes one of "
                            f"{GEMMA4_SOFT_TOKENS}")
        for key in ("patch_size", "pooling_kernel_size"):
            if key in vision and vision[key] != getattr(spec, key):
                raise UserError(f"{where}: {key}={getattr(spec, key)} is not the tower's {vision[key]} "
                                "(config.json's vision_config) — restore the checkpoint's file")
        return spec

    @property
    def budget(self) -> int:
        """The patches every image is padded to."""
        return self.max_soft_tokens * self.pooling_kernel_size ** 2

    def budget_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) -> the size the image is resized to (transformers' `get_aspect_ratio_preserving_size`);
        ValueError where that refuses."""
        side = self.pooling_kernel_size * self.patch_size
        target = self.budget * self.patch_size ** 2
        factor = math.sqrt(target / (height * width))
        h, w = math.floor(factor * height / side) * side, math.floor(factor * width / side) * side
        if h == 0 and w == 0:
            raise ValueError(f"it would be resized to 0 x 0 pixels (sides are multiples of {side})")
        longest = self.budget // self.pooling_kernel_size ** 2 * side
        if h == 0:
            h, w = side, min(math.floor(width / height) * side, longest)
        elif w == 0:
            h, w = min(math.floor(height / width) * side, longest), side
        if h * w > target:
            raise ValueError(f"resized to {h} x {w} it would exceed {self.budget} patches")
        return h, w

    def count(self, height: int, width: int) -> int:
        """The soft tokens of an image of (height, width) pixels."""
        H, W = self.budget_size(height, width)
        return (H // self.patch_size) * (W // self.patch_size) // self.pooling_kernel_size ** 2

    def read(self, image) -> tuple[np.ndarray, np.ndarray]:
        """A Pillow image -> (patches (budget, p p C) float32, zero rows after the real ones; positions (budget, 2)
        int64, each patch's (x, y), -1 after)."""
        p = self.patch_size
        H, W = self.budget_size(image.height, image.width)
        x = normalised(image, (H, W), self.resample, self.rescale_factor, self.image_mean, self.image_std)
        C, h, w = x.shape[0], H // p, W // p
        patches = np.zeros((self.budget, p * p * C), np.float32)
        patches[:h * w] = x.reshape(C, h, p, w, p).transpose(1, 3, 2, 4, 0).reshape(h * w, -1)
        positions = np.full((self.budget, 2), -1, np.int64)
        positions[:h * w] = np.stack(np.meshgrid(np.arange(w), np.arange(h), indexing="xy"), -1).reshape(-1, 2)
        return patches, positions

    @staticmethod
    def batch(pixels: list[np.ndarray], positions: list) -> dict:
        """A batch's images, in order: `pixel_values` (images, budget, p p C), `image_position_ids` (images,
        budget, 2)."""
        import torch

        return {"pixel_values": torch.from_numpy(np.stack(pixels)),
                "image_position_ids": torch.from_numpy(np.stack(positions))}


# image_processor_type (without transformers' "Fast" / "Pil" suffixes) -> its spec
PROCESSORS = {"Qwen2VLImageProcessor": ImageSpec, "Gemma3ImageProcessor": SquareSpec,
              "Gemma4ImageProcessor": BudgetSpec}
DEFAULT_PROCESSOR = {"gemma3": "Gemma3ImageProcessor", "gemma4": "Gemma4ImageProcessor"}  # by config.json's model_type


def processor_spec(preprocessor: dict | None, config: dict) -> "ImageSpec | SquareSpec | BudgetSpec":
    """The image processing of a checkpoint: its `preprocessor_config.json` dict's `image_processor_type`
    (without one, or without the file: by config.json's model_type; Qwen2-VL's by default)."""
    d = preprocessor or {}
    kind = str(d.get("image_processor_type") or "")
    for suffix in ("Fast", "Pil"):
        kind = kind.removesuffix(suffix)
    if not kind:
        kind = DEFAULT_PROCESSOR.get(config.get("model_type"), "Qwen2VLImageProcessor")
    if kind not in PROCESSORS:
        raise UserError(f"preprocessor_config.json: image_processor_type {d.get('image_processor_type')!r} is not "
                        f"supported — minitrain reads images as {', '.join(PROCESSORS)}")
    spec = PROCESSORS[kind]
    return spec.from_preprocessor_config(d, config.get("vision_config") if spec is ImageSpec else config)


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


def normalised(image, size: tuple[int, int], resample: int, scale: float, mean, std) -> np.ndarray:
    """The processors' shared steps: a Pillow image as RGB (`to_rgb`), resized to `size` (height, width) with
    Pillow's `resample` filter, times `scale` in float64, then (x - mean) / std in float32 -> (C, H, W)."""
    H, W = size
    x = np.asarray(to_rgb(image).resize((W, H), resample=resample)).transpose(2, 0, 1)  # (C, H, W) uint8
    x = (x.astype(np.float64) * scale).astype(np.float32)
    return (x - np.array(mean, np.float32)[:, None, None]) / np.array(std, np.float32)[:, None, None]


def process(image, spec: ImageSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """A Pillow image -> (pixel values (patches, C t p p) float32, grid (1, h, w))."""
    Image = pillow()
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    H, W = smart_resize(image.height, image.width, p * m, spec.min_pixels, spec.max_pixels)
    x = normalised(image, (H, W), Image.BICUBIC, 1 / 255, spec.image_mean, spec.image_std)
    C, h, w = x.shape[0], H // p, W // p
    x = x.reshape(C, h // m, m, p, w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (h/m, w/m, m, m, C, p, p)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], tp, p, p))  # the frame repeated
    return np.ascontiguousarray(x.reshape(h * w, C * tp * p * p)), (1, h, w)


@contextmanager
def opened(path: str | Path, where: str = ""):
    """The image file `path` opened by Pillow (its header read, no pixel decoded yet); a missing or unreadable
    file, or one whose pixels fail inside the block, is one UserError naming it (and `where`, its data row)."""
    Image = pillow()
    at = f"{where}: " if where else ""
    try:
        with Image.open(path) as image:
            yield image
    except FileNotFoundError:
        raise UserError(f"{at}image {path} does not exist — fix the path (relative paths are read from the data "
                        "file's folder)") from None
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise UserError(f"{at}image {path} cannot be read ({e}) — replace or remove it") from None


def load_image(path: str | Path, spec: ImageSpec | SquareSpec | BudgetSpec, where: str = "") -> tuple[np.ndarray, Any]:
    """`spec.read` of the image file `path` (Qwen: `process`, its pixels and grid); a missing or unreadable
    file is one UserError naming it (and `where`, the data row it came from)."""
    with opened(path, where) as image:
        image.load()
        return spec.read(image)


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
    """How a vision-language checkpoint reads images in chat rows: `placeholder`, the text written in the chat
    for one image (Qwen2.5-VL: `<|vision_start|><|image_pad|><|vision_end|>`; Gemma 3: `<start_of_image>`, as
    its chat template writes), `token_id` (the one token that stands for the image's features, repeated once
    per feature), `spec` (the image processing). Gemma 3 (`boi` set): the placeholder is the `boi` token, which
    the processor replaces with `frame` + boi + soft tokens + `eoi` + `frame` (`expand`). Gemma 4 (`wrap` set):
    the placeholder is the soft token, repeated and written between `wrap`'s two ids."""

    placeholder: str
    token_id: int
    spec: ImageSpec | SquareSpec | BudgetSpec
    boi: int | None = None
    eoi: int | None = None
    frame: str = "\n\n"
    wrap: tuple[int, int] | None = None
    videos: Any = None  # how it reads videos (`minitrain.data.videos.VideoRows`), None: it reads none

    @classmethod
    def from_checkpoint(cls, config: dict, preprocessor: dict | None, decode) -> "ImageRows | None":
        """From a checkpoint's config.json and preprocessor_config.json dicts (None: a text-only checkpoint,
        no `image_token_id` / `image_token_index`); `decode(id)` is the tokenizer's text of a token id."""
        if config.get("model_type") == "gemma3":
            boi, eoi = int(config.get("boi_token_index", 255_999)), int(config.get("eoi_token_index", 256_000))
            return cls(decode(boi), int(config.get("image_token_index", 262_144)),
                       processor_spec(preprocessor, config), boi=boi, eoi=eoi)
        if config.get("model_type") == "gemma4":
            if not isinstance(config.get("vision_config"), dict):
                return None  # a folder without the vision tower: text rows only
            image = int(config.get("image_token_id", 258_880))
            wrap = (int(config.get("boi_token_id", 255_999)), int(config.get("eoi_token_id", 258_882)))
            return cls(decode(image), image, processor_spec(preprocessor, config), wrap=wrap)
        image = config.get("image_token_id")
        if image is None:
            return None
        start, end = config.get("vision_start_token_id"), config.get("vision_end_token_id")
        text = "".join(decode(i) for i in (start, image, end) if i is not None)
        return cls(text, int(image), processor_spec(preprocessor, config))

    def size(self, path: Path, where: str) -> tuple[int, int]:
        """(height, width) of the image file `path` from its header alone (no pixel is decoded)."""
        with opened(path, where) as image:
            w, h = image.size
        return h, w

    def tokens(self, path: Path, where: str) -> int:
        """The tokens that stand for the image file `path` (from its header)."""
        try:
            return self.spec.count(*self.size(path, where))
        except ValueError as e:
            raise UserError(f"{where}: image {path}: {e} — crop or pad it") from None

    def grid(self, path: Path, where: str) -> tuple[int, int, int]:
        """Qwen: the patch grid of the image file `path` from its header."""
        try:
            return self.spec.grid_of(*self.size(path, where))
        except ValueError as e:
            raise UserError(f"{where}: image {path}: {e} — crop or pad it") from None

    def expand(self, ids: list[int], labels: list[int], counts: list[int], tok, where: str
               ) -> tuple[list[int], list[int]]:
        """A chat's ids and labels with each image's placeholder expanded as the checkpoint's processor does
        it (`counts[i]` tokens for image i; -100 on every image token: an image is input, never a target).
        Qwen: the placeholder token repeated. Gemma 3: `boi` becomes boi + soft tokens + eoi, and `frame` joins
        the text on each side, which is tokenized again (the special tokens split the text, so each stretch
        between two of them is tokenized alone, as in the processor's whole text); `tok` the tokenizer."""
        if self.boi is None:
            expand_placeholders(ids, self.token_id, counts, where)  # the count of images
            before, after = ([self.wrap[0]], [self.wrap[1]]) if self.wrap else ([], [])
            out_ids, out_labels, n = [], [], iter(counts)
            for t, label in zip(ids, labels):
                run = [*before, *[t] * next(n), *after] if t == self.token_id else [t]
                out_ids += run
                out_labels += [IGNORE_INDEX] * len(run) if t == self.token_id else [label]
            return out_ids, out_labels
        expand_placeholders(ids, self.boi, counts, where)  # the count of images
        special = {tok.token_to_id(s) for s in tok.special_strings()} | {self.boi, self.eoi, self.token_id}
        items: list[list] = []  # [ids, labels, prefix, suffix] of text stretches; [id, label] of special tokens
        n = iter(counts)
        for t, label in zip(ids, labels):
            if t == self.boi:
                if not items or len(items[-1]) == 2:
                    items.append([[], [], "", ""])
                items[-1][3] += self.frame
                items.append([[self.boi] + [self.token_id] * next(n) + [self.eoi], None])
                items.append([[], [], self.frame, ""])
            elif t in special:
                items.append([[t], [label]])
            elif items and len(items[-1]) == 4:
                items[-1][0].append(t)
                items[-1][1].append(label)
            else:
                items.append([[t], [label], "", ""])
        out_ids, out_labels = [], []
        for item in items:
            if len(item) == 2:
                out_ids += item[0]
                out_labels += [IGNORE_INDEX] * len(item[0]) if item[1] is None else item[1]
                continue
            text_ids, text_labels, prefix, suffix = item
            if prefix or suffix:
                if any(label != IGNORE_INDEX for label in text_labels):
                    raise UserError(f"{where}: an image inside an assistant's answer — put images in the user's turns")
                text_ids = tok.encode(prefix + tok.decode(text_ids, skip_special=False) + suffix, continuation=True)
                text_labels = [IGNORE_INDEX] * len(text_ids)
            out_ids += text_ids
            out_labels += text_labels
        return out_ids, out_labels


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
                elif kind == "video":
                    raise UserError(f"{where}: messages[{i}] has a video, which is not read here: this recipe takes no "
                                    "videos yet (SFT does, on Qwen2.5-VL and Qwen3-VL) — drop the video or use SFT")
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


def collate_images(examples, collate, spec: ImageSpec | SquareSpec | BudgetSpec, copies: int = 1, group: int = 1,
                   videos: Any = None) -> dict:
    """`collate(examples)` plus, when the examples carry images, `spec.batch` of them (Qwen: `pixel_values`
    (patches, C t p p) float32 and `image_grid_thw` (images, 3); Gemma 3: `pixel_values` (images, C, H, W);
    Gemma 4: `pixel_values` (images, budget, p p C) and `image_position_ids` (images, budget, 2)):
    each image decoded now, for this batch only, once, in order. `copies`: the examples' images that many
    times over (a preference batch's rows are [chosen; rejected], each pair's images in both: 2). `group` > 1:
    also `group_pixel_values` (and `group_image_grid_thw`), each example's images `group` times in a row, for
    the rows of GRPO's groups (prompt i's G completions are rows i G .. i G + G - 1). Packed rows (the batch's
    `sequence_ids`: the packer may reorder the examples): the images in the order the examples lie in the rows.
    Videos (SFT's rows, `videos`: how the checkpoint reads them, `VideoRows`): `pixel_values_videos`,
    `video_grid_thw` and `second_per_grid_ts`, each decoded now, in order."""
    batch = collate(examples)
    if "sequence_ids" in batch:
        examples = [examples[i] for i in packed_order(batch["sequence_ids"])]
    decoded = [[load_image(path, spec, ex.get("where", "")) for path in ex.get("images", ())] for ex in examples]
    clips = [videos.read(entry, ex.get("where", "")) for ex in examples for entry in ex.get("videos", ())]
    if clips:
        batch.update(videos.spec.batch(*zip(*clips)))
    images = [image for _ in range(copies) for mine in decoded for image in mine]
    if images:
        batch.update(spec.batch(*zip(*images)))
        if group > 1:
            grouped = spec.batch(*zip(*[image for mine in decoded for _ in range(group) for image in mine]))
            batch.update({f"group_{k}": v for k, v in grouped.items()})
    return batch


def packed_order(sequence_ids) -> list[int]:
    """(B, T) each token's example (-1: padding) -> the examples in the order they lie in the rows, row by row."""
    seen: dict[int, None] = {}
    for i in sequence_ids.flatten().tolist():
        if i >= 0:
            seen.setdefault(i)
    return list(seen)
