"""Images from URLs: data: URLs (base64 PNG, JPEG, WebP, GIF) and http(s) URLs of allowed
hosts (http_fetch.py), decoded to RGB PIL images under a MediaPolicy's limits.

`load_image` is for offline callers (LLM.chat); `fetch_image` for the server: the network
part is asynchronous and decoding runs in a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import io
from collections.abc import Coroutine
from typing import Any, TypeVar

from PIL import Image

from asyncserve.multimodal.http_fetch import fetch_bytes, short_url
from asyncserve.multimodal.policy import MediaError, MediaPolicy

__all__ = ["MediaError", "MediaPolicy", "decode_image", "fetch_image", "load_image"]

T = TypeVar("T")

# The media types a data: URL may declare, and the decoders PIL may use for any image: no
# other format's decoder ever sees untrusted bytes.
_DATA_URL_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")
_DECODERS = ("PNG", "JPEG", "WEBP", "GIF")
_FORMAT_NAMES = "PNG, JPEG, WebP or GIF"
# A decoded image's alpha is laid over this (as vLLM does), not dropped.
_BACKGROUND = (255, 255, 255)


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        out = Image.new("RGB", rgba.size, _BACKGROUND)
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    return image.convert("RGB")


def decode_image(data: bytes, policy: MediaPolicy, source: str = "image") -> Image.Image:
    """An RGB image from encoded bytes (the first frame of an animation). The pixel count is
    checked from the header, before the pixels are decoded."""
    if len(data) > policy.max_bytes:
        raise MediaError(f"{source} is {len(data)} bytes, over the {policy.max_bytes} byte limit")
    try:
        image = Image.open(io.BytesIO(data), formats=_DECODERS)
    except Image.DecompressionBombError as exc:
        raise MediaError(
            f"{source} is over the limit of {policy.max_pixels} pixels: {exc}"
        ) from None
    except Image.UnidentifiedImageError:
        raise MediaError(f"{source} is not a {_FORMAT_NAMES} image") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise MediaError(f"{source} is not a {_FORMAT_NAMES} image ({exc})") from None
    width, height = image.size
    if width * height > policy.max_pixels:
        raise MediaError(
            f"{source} is {width}x{height} pixels, over the limit of {policy.max_pixels} pixels"
        )
    try:
        image.load()
        return _to_rgb(image)
    except Image.DecompressionBombError as exc:
        raise MediaError(
            f"{source} is over the limit of {policy.max_pixels} pixels: {exc}"
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise MediaError(f"{source} ({image.format}) does not decode: {exc}") from None


def _data_url_bytes(url: str, policy: MediaPolicy) -> bytes:
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise MediaError("data: URL has no ',' before its data")
    params = [p.strip().lower() for p in header.split(";")]
    media_type = params[0]
    if media_type not in _DATA_URL_TYPES:
        raise MediaError(
            f"data: URL media type {media_type or '(none)'!r} is not accepted "
            "(image/png, image/jpeg, image/webp or image/gif)"
        )
    if "base64" not in params[1:]:
        raise MediaError("data: URL must be base64-encoded (data:<type>;base64,<data>)")
    payload = "".join(payload.split())
    if len(payload) // 4 * 3 > policy.max_bytes + 3:
        raise MediaError(
            f"data: URL image is about {len(payload) // 4 * 3} bytes, over the "
            f"{policy.max_bytes} byte limit"
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("data: URL's base64 data does not decode") from None


def _decode_data_url(url: str, policy: MediaPolicy) -> Image.Image:
    return decode_image(_data_url_bytes(url, policy), policy, "data: URL image")


def _scheme(url: str) -> str:
    if not isinstance(url, str):
        raise MediaError(f"media URL must be a string, got {type(url).__name__}")
    head, colon, _ = url.partition(":")
    return head.strip().lower() if colon else ""


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Runs a coroutine to the end from synchronous code, inside an event loop or not."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _refuse_scheme(url: str, scheme: str) -> MediaError:
    what = f"scheme {scheme}:" if scheme else "without a scheme"
    return MediaError(
        f"media URL {short_url(url)} {what} is not accepted (only data:, http: and https:)"
    )


def load_image(url: str, policy: MediaPolicy) -> Image.Image:
    """The image a data: or http(s) URL names, as RGB; MediaError if refused or bad."""
    scheme = _scheme(url)
    if scheme == "data":
        return _decode_data_url(url, policy)
    if scheme in ("http", "https"):
        return decode_image(_run(fetch_bytes(url, policy)), policy, short_url(url))
    raise _refuse_scheme(url, scheme)


async def fetch_image(url: str, policy: MediaPolicy) -> Image.Image:
    """load_image for an event loop: the fetch is asynchronous, decoding runs in a thread."""
    scheme = _scheme(url)
    if scheme == "data":
        return await asyncio.to_thread(_decode_data_url, url, policy)
    if scheme in ("http", "https"):
        data = await fetch_bytes(url, policy)
        return await asyncio.to_thread(decode_image, data, policy, short_url(url))
    raise _refuse_scheme(url, scheme)
