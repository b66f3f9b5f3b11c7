"""PNG bytes of a grayscale array, the same bytes for the same array every time."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def encode_png(pixels: np.ndarray) -> bytes:
    """uint8 -> 8-bit grayscale, uint16 -> 16-bit grayscale; no metadata, fixed compression."""
    if pixels.dtype not in (np.uint8, np.uint16) or pixels.ndim != 2:
        raise TypeError(f"no grayscale PNG for {pixels.dtype} pixels of shape {pixels.shape}")
    # Pillow picks mode L for uint8 and I;16 for uint16 from the array itself.
    image = Image.fromarray(np.ascontiguousarray(pixels))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=6)
    return buffer.getvalue()
