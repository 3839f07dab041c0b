"""Image intake, shared by every route that takes images: `data:` URLs and http(s) URLs in, each
one fetched, checked and decoded off the event loop, out as `ImageData` (a decoded RGB image and the
SHA-256 of its bytes) for the engine.

Every refusal is a ValidationError (422 in the dialect's shape) naming the image by its index in
the request and the reason:
- more than `--max-images` images in one request;
- more than `--max-image-bytes` bytes (a `data:` URL's are counted before decoding its base64; a
  fetch stops reading at the limit);
- a header declaring more than `--max-image-pixels` pixels: read from the header, before any pixel
  is decoded (a small PNG declaring 20,000 x 20,000 never allocates them);
- bytes that are not an image of a supported format (PNG, JPEG, GIF, WebP, BMP), sniffed from the
  bytes themselves: declared content types (headers, `data:` media types) are not trusted;
- an http(s) URL whose host resolves to a loopback, private, link-local, shared, reserved or
  multicast address (cloud metadata services among them), at the first request and at every
  redirect, unless `--allow-private-image-urls`; redirects at most `MAX_REDIRECTS`; a fetch past
  `--image-fetch-timeout` seconds (each read waits at most that long, and none starts after it).

A fetch runs in a thread of the intake's own pool (never the threads that tokenize) and every
request's images are fetched concurrently, so a slow image host holds only its own request, which
gets its answer within about twice the fetch timeout whatever the fetch still does. The address check resolves the host before urllib connects
(which resolves it again): a DNS answer that changes in between is not caught.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import ipaddress
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from opentgi.engine.errors import ValidationError
from opentgi.engine.request import ImageData

FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
MAX_REDIRECTS = 3
FETCH_THREADS = 32
GIVE_UP_MARGIN_S = 5.0  # a request's answer comes within 2 x the fetch timeout + this
_CHUNK = 1 << 16


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20_000_000
    max_images: int = 16
    max_pixels: int = 40_000_000
    timeout_s: float = 10.0
    allow_private: bool = False

    @classmethod
    def of(cls, settings) -> ImageLimits:
        return cls(max_bytes=settings.max_image_bytes, max_images=settings.max_images,
                   max_pixels=settings.max_image_pixels, timeout_s=settings.image_fetch_timeout,
                   allow_private=settings.allow_private_image_urls)


class ImageRefused(ValidationError):
    def __init__(self, index: int, reason: str):
        super().__init__(f"image {index}: {reason}")


def check_count(count: int, limits: ImageLimits) -> None:
    if count > limits.max_images:
        raise ValidationError(f"too many images: {count} in this request, at most {limits.max_images} "
                              f"(--max-images)")


_fetchers: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    """Image fetches' own threads: slow image hosts never hold the threads that tokenize."""
    global _fetchers
    if _fetchers is None:
        _fetchers = ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="image-fetch")
    return _fetchers


async def load_images(urls: list[str], limits: ImageLimits) -> list[ImageData]:
    """The request's images, in order (each a `data:` or http(s) URL)."""
    check_count(len(urls), limits)
    loop = asyncio.get_running_loop()
    # past this a request gets its answer whatever a stuck fetch (a resolver that hangs) still does
    give_up_s = 2 * limits.timeout_s + GIVE_UP_MARGIN_S

    async def one(index: int, url: str) -> ImageData:
        try:
            return await asyncio.wait_for(loop.run_in_executor(_pool(), load_image, index, url, limits), give_up_s)
        except asyncio.TimeoutError:
            raise ImageRefused(index, f"reading the image took longer than {give_up_s:g} s") from None

    return list(await asyncio.gather(*(one(i, url) for i, url in enumerate(urls))))


def load_image(index: int, url: str, limits: ImageLimits) -> ImageData:
    if not isinstance(url, str) or not url:
        raise ImageRefused(index, "the image URL is empty")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url_bytes(index, url, limits)
    elif scheme in ("http", "https"):
        data = _fetch(index, url, limits)
    else:
        raise ImageRefused(index, f"unsupported URL scheme {scheme or url[:16]!r}: use a data: or http(s) URL")
    return ImageData(image=decode_image(index, data, limits), sha256=hashlib.sha256(data).hexdigest())


def _data_url_bytes(index: int, url: str, limits: ImageLimits) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or ";base64" not in header.lower():
        raise ImageRefused(index, "a data: URL must be base64 (data:image/png;base64,...)")
    payload = payload.strip()
    if len(payload) * 3 // 4 > limits.max_bytes + 3:
        raise ImageRefused(index, f"the image is larger than {limits.max_bytes} bytes (--max-image-bytes)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused(index, "the data: URL is not valid base64") from None
    if len(data) > limits.max_bytes:
        raise ImageRefused(index, f"the image is larger than {limits.max_bytes} bytes (--max-image-bytes)")
    return data


def refused_address(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return (ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_reserved or ip.is_multicast
            or ip.is_unspecified or not ip.is_global)


def check_host(index: int, url: str, limits: ImageLimits) -> None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ImageRefused(index, f"unsupported image URL {url[:80]!r}")
    if limits.allow_private:
        return
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80),
                                   type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, ValueError):
        raise ImageRefused(index, f"cannot resolve the image host {parts.hostname!r}") from None
    for info in infos:
        if refused_address(info[4][0]):
            raise ImageRefused(index, f"the image host {parts.hostname!r} resolves to a loopback, private, "
                                      f"link-local or metadata address ({info[4][0]}): refused "
                                      f"(--allow-private-image-urls)")


class _Redirects(urllib.request.HTTPRedirectHandler):
    def __init__(self, index: int, limits: ImageLimits):
        self.index, self.limits, self.count = index, limits, 0

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self.count += 1
        if self.count > MAX_REDIRECTS:
            raise ImageRefused(self.index, f"more than {MAX_REDIRECTS} redirects")
        check_host(self.index, newurl, self.limits)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(index: int, url: str, limits: ImageLimits) -> bytes:
    check_host(index, url, limits)
    deadline = time.monotonic() + limits.timeout_s
    opener = urllib.request.build_opener(_Redirects(index, limits))
    request = urllib.request.Request(url, headers={"User-Agent": "opentgi-image-fetch", "Accept": "image/*"})
    try:
        with opener.open(request, timeout=limits.timeout_s) as response:
            chunks, size = [], 0
            while chunk := response.read1(_CHUNK):  # returns what one read gives: a slow drip cannot hold it
                size += len(chunk)
                if size > limits.max_bytes:
                    raise ImageRefused(index, f"the image is larger than {limits.max_bytes} bytes (--max-image-bytes)")
                if time.monotonic() > deadline:
                    raise TimeoutError
                chunks.append(chunk)
    except ImageRefused:
        raise
    except urllib.error.HTTPError as exc:
        raise ImageRefused(index, f"fetching the image failed: HTTP {exc.code}") from None
    except (TimeoutError, socket.timeout):
        raise ImageRefused(index, f"fetching the image took longer than {limits.timeout_s:g} s "
                                  f"(--image-fetch-timeout)") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, ImageRefused):
            raise reason from None
        raise ImageRefused(index, f"fetching the image failed: {reason}") from None
    return b"".join(chunks)


def decode_image(index: int, data: bytes, limits: ImageLimits):
    """The decoded RGB image; its format sniffed from the bytes and its pixel count read from the
    header before decoding."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise ImageRefused(index, f"the bytes are not an image of a supported format ({', '.join(FORMATS)})") from None
    except Image.DecompressionBombError as exc:  # Pillow's own ceiling, far past any sane limit
        raise ImageRefused(index, f"the image declares more pixels than {limits.max_pixels} "
                                  f"(--max-image-pixels): {exc}") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageRefused(index, f"the image cannot be read: {exc}") from None
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageRefused(index, f"the image is {width} x {height} pixels, more than {limits.max_pixels} "
                                  f"(--max-image-pixels)")
    if width < 1 or height < 1:
        raise ImageRefused(index, "the image has no pixels")
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError, MemoryError) as exc:
        raise ImageRefused(index, f"the image cannot be decoded: {exc}") from None


def chat_image_urls(messages: list[dict]) -> list[str]:
    """The URLs of the image parts of chat messages in OpenAI form (`{"type": "image_url",
    "image_url": {"url": ...}}`, or a bare string), in order."""
    urls: list[str] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image_url":
                ref = part.get("image_url")
                urls.append(ref.get("url", "") if isinstance(ref, dict) else ref if isinstance(ref, str) else "")
    return urls


_MARKDOWN_IMAGE = re.compile(r"!\[\]\(([^)]*)\)")  # TGI's own pattern


def markdown_images(inputs: str, marker: str) -> tuple[str, list[str]]:
    """TGI's `inputs` with images as markdown, `![](url)`: the text with each image replaced by the
    model's image marker, and the URLs in order."""
    urls: list[str] = []

    def take(match: re.Match) -> str:
        urls.append(match.group(1))
        return marker

    return _MARKDOWN_IMAGE.sub(take, inputs), urls
