"""What a real image file does to a drawn scene, as a training augmentation: lossy JPEG (4:2:0 and 4:4:4 chroma)
or WebP, resizing up or down (the image processor brings it back to the model's size), slight blur and noise,
brightness and contrast jitter.

`corrupt(image, rng)` draws a fresh corruption from `rng` (a random.Random); the same rng state gives the same
image, byte for byte, so a training run that seeds it resumes bit-identically. FILE_CONDITIONS are the fixed
conditions recipes/eval_captioner_conditions.py scores a captioner under, one by one.
"""

from __future__ import annotations

import io
import math
import random
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter

# applied in this order (noise at the drawn size, where the model sees it), then saved; at most one of jpeg, webp
CORRUPTIONS = ("jitter", "blur", "noise", "resize", "jpeg", "webp")
CLEAN_SHARE = 0.3  # images left as drawn, so the model keeps seeing the spec's exact pixels
CHANCES = {"jitter": 0.4, "blur": 0.25, "noise": 0.3, "resize": 0.5}  # of each, for an image that is corrupted
SAVED_AS = (("jpeg", 0.6), ("webp", 0.2), (None, 0.2))  # the format a corrupted image goes through last

JPEG_QUALITY = (30, 95)
JPEG_SUBSAMPLING = ((2, 2 / 3), (0, 1 / 3))  # Pillow's 2 = 4:2:0 (its default), 0 = 4:4:4; with their shares
WEBP_QUALITY = (30, 95)
RESIZE_SIDE = (32, 1024)  # pixels, drawn log-uniformly: thumbnails to photos
RESIZE_FILTERS = (Image.Resampling.NEAREST, Image.Resampling.BILINEAR, Image.Resampling.BICUBIC,
                  Image.Resampling.LANCZOS)
TWICE_RESIZED = 0.3  # of resized images, resized once more (a thumbnail shown large, say)
BLUR_RADIUS = (0.3, 1.0)  # Gaussian, pixels of the 64 px image
NOISE_SIGMA = (2.0, 8.0)  # additive Gaussian, in 0-255 levels
JITTER_FACTOR = (0.8, 1.2)  # brightness and contrast, each drawn on its own


def corrupt(image: Image.Image, rng: random.Random, kinds: Sequence[str] | None = None) -> Image.Image:
    """An RGB image corrupted as a real file might be. kinds: apply exactly these (names from CORRUPTIONS, in
    CORRUPTIONS' order) instead of drawing which; their strengths are still drawn from rng."""
    if kinds is None:
        kinds = draw_kinds(rng)
    unknown = set(kinds) - set(CORRUPTIONS)
    if unknown:
        raise ValueError(f"unknown corruption {sorted(unknown)[0]!r}: choose from {', '.join(CORRUPTIONS)}")
    image = image.convert("RGB")
    for kind in CORRUPTIONS:
        if kind in kinds:
            image = _APPLY[kind](image, rng)
    return image


def draw_kinds(rng: random.Random) -> tuple[str, ...]:
    """Which corruptions an image gets: none for CLEAN_SHARE of images, else each by its chance."""
    if rng.random() < CLEAN_SHARE:
        return ()
    kinds = [kind for kind, chance in CHANCES.items() if rng.random() < chance]
    saved_as = _weighted(rng, SAVED_AS)
    return tuple(kinds + ([saved_as] if saved_as else []))


def _weighted(rng: random.Random, choices):
    names, weights = zip(*choices)
    return rng.choices(names, weights)[0]


def _jitter(image: Image.Image, rng: random.Random) -> Image.Image:
    image = ImageEnhance.Brightness(image).enhance(rng.uniform(*JITTER_FACTOR))
    return ImageEnhance.Contrast(image).enhance(rng.uniform(*JITTER_FACTOR))


def _blur(image: Image.Image, rng: random.Random) -> Image.Image:
    return image.filter(ImageFilter.GaussianBlur(rng.uniform(*BLUR_RADIUS)))


def _resize(image: Image.Image, rng: random.Random) -> Image.Image:
    for _ in range(2 if rng.random() < TWICE_RESIZED else 1):
        side = round(math.exp(rng.uniform(*map(math.log, RESIZE_SIDE))))
        image = image.resize((side, side), rng.choice(RESIZE_FILTERS))
    return image


def _noise(image: Image.Image, rng: random.Random) -> Image.Image:
    sigma = rng.uniform(*NOISE_SIGMA)
    noise = np.random.default_rng(rng.getrandbits(64)).normal(0.0, sigma, (image.height, image.width, 3))
    return Image.fromarray(np.clip(np.asarray(image, dtype=np.float32) + noise, 0, 255).round().astype(np.uint8))


def _jpeg(image: Image.Image, rng: random.Random) -> Image.Image:
    return reencoded(image, "JPEG", quality=rng.randint(*JPEG_QUALITY), subsampling=_weighted(rng, JPEG_SUBSAMPLING))


def _webp(image: Image.Image, rng: random.Random) -> Image.Image:
    return reencoded(image, "WEBP", quality=rng.randint(*WEBP_QUALITY), lossless=False)


def reencoded(image: Image.Image, format: str, **options) -> Image.Image:
    """The image as it reads back from a file Pillow writes in `format` with these save options."""
    buffer = io.BytesIO()
    image.save(buffer, format, **options)
    buffer.seek(0)
    with Image.open(buffer) as saved:
        return saved.convert("RGB")


_APPLY = {"jitter": _jitter, "blur": _blur, "resize": _resize, "noise": _noise, "jpeg": _jpeg, "webp": _webp}


def _resized(image: Image.Image, *sides: int) -> Image.Image:
    for side in sides:
        image = image.resize((side, side), Image.Resampling.BICUBIC)  # Pillow's default filter
    return image


# fixed conditions a drawn scene is scored under (recipes/eval_captioner_conditions.py): name -> the image as the
# captioner receives it; the resized ones are then brought back to the model's size by its image processor
FILE_CONDITIONS = {
    "PNG": lambda image: image,  # lossless: the drawn pixels
    "JPEG q75 4:2:0": lambda image: reencoded(image, "JPEG", quality=75, subsampling=2),  # Pillow's defaults
    "JPEG q90 4:2:0": lambda image: reencoded(image, "JPEG", quality=90, subsampling=2),
    "JPEG q75 4:4:4": lambda image: reencoded(image, "JPEG", quality=75, subsampling=0),
    "WebP q80": lambda image: reencoded(image, "WEBP", quality=80),
    "resized 64->224": lambda image: _resized(image, 224),
    "resized 64->32->224": lambda image: _resized(image, 32, 224),  # half the pixels lost, then upscaled
    "resized 64->256->64": lambda image: _resized(image, 256, 64),
}
