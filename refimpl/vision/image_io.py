"""Reading image files into RGB PIL images, as HF transformers does, with every failure one clear ImageError.

Two conversions exist in HF and both are kept:
    * a file path (`load_image`, what `llama32 --image` uses): EXIF orientation applied, then Pillow's plain
      `convert("RGB")` — transparent pixels keep their colour, alpha is dropped;
    * an in-memory image (`to_rgb`, what `MllamaImageProcessor` does to a PIL image it is handed): no EXIF,
      anything with an alpha band or a transparency key composited onto white.
16-bit greyscale (I;16) goes through Pillow's conversion, which clips values above 255 (HF does the same).
"""
from __future__ import annotations

import struct
import warnings
import zlib
from pathlib import Path

from refimpl.errors import ImageError

# what Pillow raises while decoding a damaged file (truncated data, bad chunk, bad Huffman table, ...)
DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error, zlib.error)


def open_image(path: str | Path, max_pixels: int | None = None):
    """The file's image, fully decoded. `max_pixels` defaults to Pillow's decompression-bomb limit
    (PIL.Image.MAX_IMAGE_PIXELS); past it, the file is refused before its pixels are decoded."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    limit = Image.MAX_IMAGE_PIXELS if max_pixels is None else max_pixels
    if not path.is_file():
        raise ImageError(f"{path}: {'not a file' if path.exists() else 'not found'} (expected an image file)")
    try:
        with warnings.catch_warnings():
            # Pillow only warns between 1x and 2x its limit; a warning would let a bomb through
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(path)
            if limit is not None and image.width * image.height > limit:
                raise ImageError(f"{path}: {image.width}x{image.height} pixels is over the limit of {limit} "
                                 f"(a decompression bomb?); expected a smaller image")
            image.load()
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"{path}: not an image Pillow can read (expected PNG, JPEG, WebP, GIF, ...)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"{path}: too many pixels ({e}); expected a smaller image") from None
    except DECODE_ERRORS as e:
        raise ImageError(f"{path}: damaged or truncated image data ({type(e).__name__}: {e})") from None
    return image


def load_image(path: str | Path, max_pixels: int | None = None):
    """An image file as HF's `load_image(path)` gives it: upright per its EXIF orientation, mode RGB."""
    from PIL import ImageOps

    image = open_image(path, max_pixels)
    try:
        image = ImageOps.exif_transpose(image)
    except DECODE_ERRORS as e:
        raise ImageError(f"{path}: unreadable EXIF orientation ({type(e).__name__}: {e})") from None
    return convert(image, "RGB", path)


def convert(image, mode: str, source):
    try:
        return image.convert(mode)
    except ValueError as e:  # e.g. 'La' (premultiplied alpha): Pillow has no conversion for it
        raise ImageError(f"{source}: image mode {image.mode} cannot be converted to {mode} ({e})") from None


def to_rgb(image, source: str = "image"):
    """HF's `convert_to_rgb` for a PIL image: transparency composited onto opaque white, then RGB."""
    from PIL import Image

    # an RGB PNG with a tRNS colour key counts as transparent too (the key survives convert("RGB"))
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = convert(image, "RGBA", source)
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return convert(image, "RGB", source)
