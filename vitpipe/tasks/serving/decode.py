"""Request payload -> image, in a model worker: every failure is a ``RequestError`` (status, one line),
never an exception out of the batch, so a bad image fails only its own request.

The image is read as ``scripts/predict.py`` reads files (``vitpipe.data.images.open_image``): any PIL
mode is converted (RGBA drops alpha, palette expands, 16-bit gray is scaled to 8 bits), so such
images are answered, like predict answers them. Refused: 400 malformed base64, 413 an image over
PIL's decompression-bomb limit (``PIL.Image.MAX_IMAGE_PIXELS``, also between 1x and 2x of it, where
PIL only warns), 422 a missing ``image`` field, zero bytes, bytes PIL cannot identify or decode (a
truncated JPEG), 32-bit and float pixels.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from vitpipe.data.images import open_image

DATA_URL = re.compile(r"^data:[\w/+.-]*;base64,")


@dataclass(frozen=True)
class RequestError:
    """A refused request: its HTTP status and one line naming the problem."""

    status: int
    message: str


class Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.error = RequestError(status, message)


def image_bytes(payload) -> bytes:
    """The file bytes of a parsed body: a JSON object's ``image`` (base64, a ``data:`` URL prefix allowed)
    or a multipart form's file field ``image``. Raises Refused."""
    if not hasattr(payload, "get"):
        raise Refused(422, f"the body is a {type(payload).__name__}, not an object with an 'image' field")
    value = payload.get("image")
    if value is None:
        keys = ", ".join(map(repr, list(payload.keys())[:5])) or "none"
        raise Refused(422, f"the field 'image' is missing (fields sent: {keys}); send the file's bytes in 'image'")
    if hasattr(value, "file"):  # a multipart upload (starlette UploadFile)
        value.file.seek(0)
        return value.file.read()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if not isinstance(value, str):
        raise Refused(422, f"the field 'image' is a JSON {type(value).__name__}; send a base64 string")
    text = DATA_URL.sub("", value.strip(), count=1)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise Refused(400, f"the field 'image' is not valid base64 ({e})") from None


def read_image(data: bytes, mode: str) -> Image.Image:
    """The decoded image (``open_image``'s rules) of ``data``. Raises Refused."""
    if not data:
        raise Refused(422, "the image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)  # PIL's 1x-2x band: refused too
            return open_image(io.BytesIO(data), mode)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise Refused(413, f"the image is too large to decode: {str(e).splitlines()[0]}") from None
    except UnidentifiedImageError:
        raise Refused(422, f"the {len(data)} bytes sent are not an image file PIL can read") from None
    except Exception as e:  # noqa: BLE001 - PIL raises many types for broken files (OSError, SyntaxError, ...)
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise Refused(422, f"the image cannot be decoded ({why})") from None
