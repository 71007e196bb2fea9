"""`image_url` parts -> RGB images. The server never fetches: a base64 `data:` URL, or a `file://` path inside
the directory `--allowed-local-media` names (resolved, symbolic links included, before the check)."""
from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
import warnings
from pathlib import Path

from refimpl.vision.image_io import DECODE_ERRORS
from tools.serve.protocol import APIError

MAX_IMAGE_BYTES = 20 * 2 ** 20
MAX_IMAGE_PIXELS = 4096 * 4096


def load_image_url(url: str, param: str, allowed_dir: Path | None, max_bytes: int = MAX_IMAGE_BYTES,
                   max_pixels: int = MAX_IMAGE_PIXELS):
    if url.startswith("data:"):
        data = _data_url(url, param, max_bytes)
    elif url.startswith("file://"):
        data = _local_file(url, param, allowed_dir, max_bytes)
    else:
        scheme = url.split(":", 1)[0][:16] if ":" in url else "no scheme"
        raise APIError(f"{param}: the server never fetches URLs ({scheme}); send the image as a base64 data: URL",
                       param=param)
    return _decode(data, param, max_pixels)


def _data_url(url: str, param: str, max_bytes: int) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or ";base64" not in head:
        raise APIError(f"{param}: expected data:image/...;base64,<data>", param=param)
    if len(payload) > max_bytes * 4 // 3 + 4:
        raise APIError(f"{param}: the image is over {max_bytes} bytes", param=param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(f"{param}: the data: URL is not valid base64", param=param) from None


def _local_file(url: str, param: str, allowed_dir: Path | None, max_bytes: int) -> bytes:
    if allowed_dir is None:
        raise APIError(f"{param}: file:// URLs are refused (the server was started without --allowed-local-media)",
                       param=param)
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise APIError(f"{param}: file:// URLs name local paths only", param=param)
    path = Path(urllib.parse.unquote(parsed.path))
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError):
        raise APIError(f"{param}: no such file under the allowed media directory", param=param) from None
    if not real.is_relative_to(allowed_dir) or not real.is_file():
        raise APIError(f"{param}: the path is outside the allowed media directory", param=param)
    if real.stat().st_size > max_bytes:
        raise APIError(f"{param}: the image is over {max_bytes} bytes", param=param)
    return real.read_bytes()


def _decode(data: bytes, param: str, max_pixels: int):
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.width * image.height > max_pixels:
                raise APIError(f"{param}: {image.width}x{image.height} pixels is over the limit of {max_pixels}",
                               param=param)
            image.load()
            return image.convert("RGB")
    except APIError:
        raise
    except UnidentifiedImageError:
        raise APIError(f"{param}: not an image (expected PNG, JPEG, WebP, GIF, ...)", param=param) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise APIError(f"{param}: too many pixels", param=param) from None
    except DECODE_ERRORS as e:
        raise APIError(f"{param}: damaged image data ({type(e).__name__})", param=param) from None
