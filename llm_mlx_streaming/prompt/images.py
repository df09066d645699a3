"""Images in a conversation: llm's attachment parts, data URLs, and the media type of an
image's bytes. Every door ends in the same `AttachmentPart(Attachment(type, content))`,
so the engine reads one shape; the type is read off the bytes, since a client's label
(or Ollama's none) may be wrong.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Optional

IMAGE_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")  # what the processors decode
_DATA_URL = re.compile(r"^data:([^;,]*)((?:;[^;,]*)*),(.*)$", re.DOTALL)


class ImageError(ValueError):
    """An image that cannot be taken: one line saying why (a 400 on the server)."""


@dataclass(frozen=True)
class Image:
    data: bytes
    media_type: str  # one of IMAGE_TYPES


def sniffed_type(data: bytes) -> Optional[str]:
    """The IMAGE_TYPES entry `data` is, by its first bytes; None for anything else."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    return None


def checked_image(data: bytes, declared: str, limit: int) -> Image:
    """`data` as an image: at most `limit` bytes, of a supported type, whatever
    `declared` (its label, "" for none) claims."""
    declared = declared.strip().lower()
    if declared and not declared.startswith("image/"):
        raise ImageError(f"an image's media type is {declared!r}, not an image type")
    if declared and declared not in IMAGE_TYPES:
        raise ImageError(f"{declared} images are not supported (supported: {', '.join(IMAGE_TYPES)})")
    if len(data) > limit:
        raise ImageError(f"an image of {len(data)} bytes is larger than max_image_bytes ({limit})")
    found = sniffed_type(data)
    if found is None:
        raise ImageError(f"an image's bytes are not a PNG, JPEG, WebP or GIF image (supported: {', '.join(IMAGE_TYPES)})")
    return Image(data, found)


def base64_bytes(text: str) -> bytes:
    """Base64 text as bytes; an ImageError when it is not base64."""
    try:
        return base64.b64decode(re.sub(r"\s+", "", text), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("an image's data is not base64") from None


def read_data_url(url: str) -> tuple[str, bytes]:
    """(its declared media type, "" for none; its bytes) of a base64 data URL."""
    match = _DATA_URL.match(url)
    if match is None:
        raise ImageError("an image URL is neither a data URL nor an http(s) URL")
    if "base64" not in (p.strip().lower() for p in match.group(2).split(";")):
        raise ImageError("an image's data URL is not base64 (data:image/png;base64,...)")
    return match.group(1), base64_bytes(match.group(3))


def data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def is_data_url(url: str) -> bool:
    return url[:5].lower() == "data:"


def attachment_part(image: Image):
    """The image as llm's part of a user message."""
    from llm import Attachment
    from llm.parts import AttachmentPart

    return AttachmentPart(attachment=Attachment(type=image.media_type, content=image.data))


def attachment_data_url(attachment) -> str:
    """llm's attachment as a data URL (a prompt sent to `llm mlxs serve`)."""
    return data_url(attachment.content_bytes(), attachment.resolve_type())
