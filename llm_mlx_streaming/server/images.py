"""A request's images, read before its messages become llm's: inline ones decoded, an
http(s) URL fetched only where the operator's `image_urls` setting allows it, each
checked against `max_image_bytes` and the types the processors take. The decoding and
the fetching run in worker threads, so no image holds up the event loop; what cannot
be taken is a 400 with one line, in the route's own error shape.
"""

from __future__ import annotations

import asyncio
import http.client
import time
import urllib.request

from ..errors import one_line
from ..options.settings import load_settings
from ..prompt.images import Image, ImageError, checked_image, is_data_url, read_data_url
from .errors import ApiError

FETCH_SECONDS = 10.0  # the whole fetch of one image URL, redirects and body included
_CHUNK = 1 << 16
_SHOWN_URL = 120  # characters of a URL an error repeats


async def read_images(policy, model_id: str, messages) -> None:
    """Read every image of `messages` (conversation.ChatMessage) not read yet, for `model_id`
    (`policy`: the server's policy.RequestPolicy, which knows the models that take images)."""
    parts = [part for message in messages for part in message.images() if part.read is None]
    if not parts:
        return
    if not policy.takes_images(model_id):
        raise ApiError(400, f"{model_id} takes no images: it is a text-only model", param="messages")
    settings = load_settings()
    for part in parts:
        try:
            part.read = await _image(part.url, settings)
        except ImageError as e:
            raise ApiError(400, str(e), param="messages") from None


async def _image(url: str, settings) -> Image:
    limit = settings.max_image_bytes
    if is_data_url(url):
        return await asyncio.to_thread(_inline, url, limit)
    if not url.lower().startswith(("http://", "https://")):
        raise ImageError("an image URL is neither a data URL nor an http(s) URL")
    if settings.image_urls != "on":
        raise ImageError(f"the image URL {_shown(url)} is not fetched: this server's image_urls setting is off "
                         "(send the image inline as a data URL, or `llm mlxs config image_urls on`)")
    declared, data = await asyncio.to_thread(_fetch, url, limit)
    return checked_image(data, declared, limit)


def _inline(url: str, limit: int) -> Image:
    declared, data = read_data_url(url)
    return checked_image(data, declared, limit)


def _fetch(url: str, limit: int) -> tuple[str, bytes]:
    """(its Content-Type when that is an image type, else ""; its bytes), at most `limit`
    bytes in FETCH_SECONDS."""
    deadline = time.monotonic() + FETCH_SECONDS
    request = urllib.request.Request(url, headers={"User-Agent": "llm-mlx-streaming"})
    try:
        with urllib.request.urlopen(request, timeout=FETCH_SECONDS) as response:
            length = response.headers.get("Content-Length", "")
            if length.isdigit() and int(length) > limit:
                raise ImageError(f"the image at {_shown(url)} is {length} bytes, more than max_image_bytes ({limit})")
            body = bytearray()
            while chunk := response.read(_CHUNK):
                body += chunk
                if len(body) > limit:
                    raise ImageError(f"the image at {_shown(url)} is larger than max_image_bytes ({limit})")
                if time.monotonic() > deadline:
                    raise ImageError(f"the image at {_shown(url)} took longer than {FETCH_SECONDS:g} s to fetch")
            kind = response.headers.get_content_type()
    except (OSError, http.client.HTTPException) as e:
        raise ImageError(f"the image at {_shown(url)} could not be fetched: {one_line(e)}") from None
    return (kind if kind.startswith("image/") else ""), bytes(body)


def _shown(url: str) -> str:
    return url if len(url) <= _SHOWN_URL else url[:_SHOWN_URL] + "..."
