"""The images a request brings, whichever route it came by: each route turns its own image parts
into `{"type": "image_url", "url": ...}` or `{"type": "image_base64", "data": ..., "media_type": ...}`
content parts (the page: `{"type": "image_file", "path": ...}`, a file Gradio's upload route wrote,
its folder checked by ui/ before), and `take_images` (at the edge, cheap: counts, URL rules, sizes) turns them into
`ImageRef`s and the messages into the processor's shape (`{"type": "image"}` where each was);
`load_images` (a worker thread, in `prepare`) decodes them, every image's pixel count read from
its header before any decoding. Each limit is a 400 that names it and what was given.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from engine.request import InvalidRequest

MAX_IMAGE_BYTES = 10 * 2**20  # one image's encoded bytes
MAX_IMAGE_PIXELS = 4096 * 4096  # one image's width x height, read from its header before decoding
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # what Pillow is asked to open (a GIF: its first frame)
FETCH_TIMEOUT_S = 10.0  # an allowed http(s) image's download
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)", re.S)


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one request may bring (`--limit-images`, `--allowed-media-domains`)."""

    max_images: int = 4
    allowed_domains: tuple[str, ...] = ()  # hosts whose http(s) images are fetched; none by default
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS

    @classmethod
    def from_settings(cls, settings) -> ImageLimits:
        """The limits of a server's settings (frontend/settings.py; the defaults where one is missing)."""
        return cls(int(getattr(settings, "limit_images", 4)), tuple(getattr(settings, "allowed_media_domains", ())),
                   int(getattr(settings, "max_image_bytes", MAX_IMAGE_BYTES)))


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One image as the request gave it: its encoded bytes, or an allowed URL to fetch."""

    data: bytes | None
    url: str | None
    param: str  # the request field a refusal names
    limits: ImageLimits
    path: str | None = None  # a page upload's file (read in the worker thread)


def _too_big(size: int, limits: ImageLimits, param: str) -> InvalidRequest:
    return InvalidRequest(f"An image may have at most {limits.max_bytes} bytes (--max-image-bytes). "
                          f"Given: {size} bytes in `{param}`.", param)


def _decoded(text: str, limits: ImageLimits, param: str) -> bytes:
    if len(text) * 3 // 4 > limits.max_bytes + 3:  # checked before decoding
        raise _too_big(len(text) * 3 // 4, limits, param)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"`{param}` is not valid base64 image data.", param) from None
    if len(data) > limits.max_bytes:
        raise _too_big(len(data), limits, param)
    return data


def images_health(vision, limits: ImageLimits) -> dict | None:
    """What /health says of images: None for a text model, else the model's encoder and the limits."""
    if vision is None:
        return None
    return {**vision.describe(), "max_images": limits.max_images, "max_bytes": limits.max_bytes,
            "max_pixels": limits.max_pixels, "formats": list(FORMATS),
            "allowed_media_domains": list(limits.allowed_domains)}


def image_ref(part: dict, limits: ImageLimits, param: str) -> ImageRef:
    """A route's image part -> an `ImageRef` (400: a URL scheme or host not allowed, bad base64, too many bytes)."""
    if part["type"] == "image_base64":
        return ImageRef(_decoded(part["data"], limits, param), None, param, limits)
    if part["type"] == "image_file":
        try:
            size = os.stat(part["path"]).st_size
        except OSError:
            raise InvalidRequest(f"The uploaded image in `{param}` is gone (uploads are kept an hour): "
                                 "attach it again.", param) from None
        if size > limits.max_bytes:
            raise _too_big(size, limits, param)
        return ImageRef(None, None, param, limits, path=part["path"])
    url = part["url"].strip()
    data_url = _DATA_URL.fullmatch(url) if url[:5].lower() == "data:" else None
    if data_url is not None:
        return ImageRef(_decoded(data_url["data"], limits, param), None, param, limits)
    scheme, host = urlsplit(url).scheme.lower(), (urlsplit(url).hostname or "").lower()
    if scheme in ("http", "https"):
        if host and any(host == d or host.endswith("." + d) for d in limits.allowed_domains):
            return ImageRef(None, url, param, limits)
        allowed = ", ".join(limits.allowed_domains) or "none (the server fetches no URL)"
        raise InvalidRequest(f"Image URLs are fetched only from the domains named by --allowed-media-domains: "
                             f"{allowed}. Given: {host or url[:100]!r} in `{param}`; send the image inline as a "
                             f"data:image/png;base64,... URL instead.", param)
    raise InvalidRequest(f"An image URL must be a data: URL with base64 data (data:image/png;base64,...) or an "
                         f"allowed http(s) URL. Given: {url[:40]!r}... in `{param}`.", param)


def take_images(messages: list[dict], limits: ImageLimits, param: str = "messages",
                exact_paths: bool = False) -> tuple[list[dict], list[ImageRef]]:
    """Messages whose content may be a list of text and image parts -> (the messages for the chat
    template: text alone as a string, with images the list of `{"type": "text"}` and `{"type": "image"}`
    parts; the images, in order). 400 past `limits.max_images`. A refusal names the image as
    `param[m].content[p]` with `exact_paths` (the messages are the body's, one for one), else by its
    place among the request's images."""
    count = sum(1 for message in messages if isinstance(message.get("content"), list)
                for part in message["content"] if part["type"] != "text")
    if count > limits.max_images:
        raise InvalidRequest(f"A request may bring at most {limits.max_images} images (--limit-images). "
                             f"Given: {count}.", param)
    out: list[dict] = []
    refs: list[ImageRef] = []
    for m, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts: list[dict] = []
        for p, part in enumerate(content):
            if part["type"] == "text":
                parts.append({"type": "text", "text": part["text"]})
                continue
            name = f"{param}[{m}].content[{p}]" if exact_paths else f"{param} (image {len(refs) + 1})"
            refs.append(image_ref(part, limits, name))
            parts.append({"type": "image"})
        if any(part["type"] == "image" for part in parts):
            out.append({**message, "content": parts})
        else:
            out.append({**message, "content": "".join(part["text"] for part in parts)})
    return out, refs


def _fetch(ref: ImageRef) -> bytes:
    """An allowed URL's bytes, at most the limit (read in pieces: a longer body is refused, not read)."""
    import httpx

    try:
        with httpx.stream("GET", ref.url, timeout=FETCH_TIMEOUT_S, follow_redirects=False) as response:
            if response.status_code != 200:
                raise InvalidRequest(f"Fetching the image at {ref.url[:100]!r} in `{ref.param}` gave HTTP "
                                     f"{response.status_code}.", ref.param)
            data = bytearray()
            for piece in response.iter_bytes():
                data += piece
                if len(data) > ref.limits.max_bytes:
                    raise _too_big(len(data), ref.limits, ref.param)
            return bytes(data)
    except httpx.HTTPError as exc:
        raise InvalidRequest(f"The image at {ref.url[:100]!r} in `{ref.param}` could not be fetched: "
                             f"{type(exc).__name__}.", ref.param) from None


def _read(ref: ImageRef) -> bytes:
    """A page upload's bytes, at most the limit (the file may have grown since it was checked)."""
    try:
        with open(ref.path, "rb") as file:
            data = file.read(ref.limits.max_bytes + 1)
    except OSError:
        raise InvalidRequest(f"The uploaded image in `{ref.param}` is gone (uploads are kept an hour): "
                             "attach it again.", ref.param) from None
    if len(data) > ref.limits.max_bytes:
        raise _too_big(len(data), ref.limits, ref.param)
    return data


def _too_many_pixels(ref: ImageRef, given: str) -> InvalidRequest:
    return InvalidRequest(f"An image may have at most {ref.limits.max_pixels} pixels. Given: {given} in "
                          f"`{ref.param}`.", ref.param)


def load_image(ref: ImageRef):
    """Blocking: one image as an RGB PIL image. 400 for a format not allowed, more pixels than the
    limit (read from the header before decoding: a decompression bomb is never decoded) or a broken file."""
    from PIL import Image, UnidentifiedImageError

    data = ref.data if ref.data is not None else _read(ref) if ref.path is not None else _fetch(ref)
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
    except Image.DecompressionBombError as exc:  # past twice Pillow's own bound (beyond ours): its count
        given = re.search(r"\((\d+) pixels\)", str(exc))
        raise _too_many_pixels(ref, given[1] + " pixels" if given else "more than Pillow decodes") from None
    except (UnidentifiedImageError, OSError):
        raise InvalidRequest(f"The image in `{ref.param}` is not a {', '.join(FORMATS)} file "
                             f"(its first bytes: {data[:8]!r}).", ref.param) from None
    pixels = image.width * image.height
    if pixels > ref.limits.max_pixels:
        raise _too_many_pixels(ref, f"{image.width}x{image.height} = {pixels} pixels")
    try:
        image.seek(0)  # a GIF's (or animated WebP's) first frame
        return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequest(f"The image in `{ref.param}` could not be decoded: {exc}.", ref.param) from None


def load_images(refs: list[ImageRef]) -> list:
    """Blocking (a worker thread): every image decoded, in order."""
    return [load_image(ref) for ref in refs]
