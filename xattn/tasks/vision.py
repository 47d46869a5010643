"""Image files -> RGB images -> pixel values, through the model's own transformers image processor."""

from __future__ import annotations

import torch
from PIL import Image, ImageOps

from ..files import check_input

MAX_PIXELS = 100_000_000  # refuse decompression bombs (declared size), well above any real photo


class _Refused(ValueError):
    """xattn's own refusal of an image, passed on as is (Pillow's ValueErrors are wrapped with the file name)."""


def load_image(path: str) -> Image.Image:
    """Any Pillow-readable image (grayscale, RGBA, CMYK, 16-bit...) as 8-bit RGB, turned upright as its EXIF
    orientation says; ValueError naming the file. Only a regular file is opened (a FIFO would block); the declared
    size is checked from the header, before decoding."""
    check_input(path)
    try:
        with Image.open(path) as image:
            if image.width * image.height > MAX_PIXELS:
                raise _Refused(f"{path}: image declares {image.width}x{image.height} pixels, over the "
                               f"{MAX_PIXELS} limit (a decompression bomb?)")
            image.load()
            # phone photos store their rotation in EXIF (as transformers' load_image, apply it)
            return _to_rgb(ImageOps.exif_transpose(image))
    except _Refused:
        raise
    except Exception as error:  # Pillow raises many types for unreadable or truncated files
        raise ValueError(f"{path}: not a readable image ({type(error).__name__}: {error})") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16/32-bit grayscale: scale to 8 bits
        import numpy as np

        array = np.asarray(image, dtype=np.float64)
        # 0..max as 0..255; values below 0 (mode I is signed) stretch the range down to the minimum
        low, high = min(array.min(), 0.0), max(array.max(), 0.0)
        image = Image.fromarray(((array - low) / ((high - low) or 1.0) * 255).astype("uint8"), mode="L")
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def pixel_values(processor, images: list[Image.Image]) -> torch.Tensor:
    """[B, 3, H, W] float32 from the model's image processor."""
    return processor(images=images, return_tensors="pt")["pixel_values"]
