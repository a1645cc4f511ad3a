"""A chat request's images: OpenAI's `image_url` parts read under the server's media policy, every limit first.

An image comes as a `data:` URL (base64, PNG, JPEG or WebP), an http(s) URL whose host --allowed-media-domains names,
or a `file://` URL under --allowed-local-media-path; anything else is refused with 400 naming the part. Limits are
applied before anything is fetched or decoded: the count (the target's --limit-mm-per-prompt), a data URL's length,
the bytes a fetch may read, and then the pixels the image's header declares (Pillow reads the header only).

An http(s) fetch connects only to public addresses: the host's addresses are resolved by a resolver that refuses
private, loopback, link-local and reserved ones (so a name resolving to one twice cannot slip through), redirects
are followed by hand, each checked as the first URL, and the whole fetch has a timeout and reads at most the byte
limit.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from orchestrator.api.openai_protocol import ImagePart, bad_field

FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}  # Pillow's names, the media types
MAX_REDIRECTS = 3


@dataclass(frozen=True)
class MediaPolicy:
    """What the server fetches, and how much."""

    limit: int = 0  # images one prompt may hold: the target's --limit-mm-per-prompt (0: every image refused)
    allowed_domains: frozenset[str] = frozenset()  # hosts http(s) URLs may name (--allowed-media-domains)
    local_path: Path | None = None  # the directory file:// URLs may name (--allowed-local-media-path)
    max_bytes: int = 20 * 2**20  # one image's encoded bytes
    max_pixels: int = 50_000_000  # one image's width x height, as its header declares
    timeout_s: float = 10.0  # one http(s) fetch, redirects included
    public_only: bool = field(default=True, repr=False)  # refuse non-public addresses (tests of fetching: False)


NO_MEDIA = MediaPolicy()  # no image served


def check_count(parts: Sequence[ImagePart], policy: MediaPolicy) -> None:
    if len(parts) > policy.limit:
        served = "this server serves no images" if policy.limit == 0 else f"at most {policy.limit} per prompt"
        message = f"{len(parts)} images in the request; {served} (--limit-mm-per-prompt)"
        raise bad_field(parts[policy.limit].where, message)


async def read_images(parts: Sequence[ImagePart], policy: MediaPolicy) -> list[bytes]:
    """Every image's bytes, in order, each checked to be an image of a served format within the pixel limit."""
    check_count(parts, policy)
    images = []
    for part in parts:
        data = await _read(part, policy)
        await asyncio.to_thread(check_image, data, part.where, policy)
        images.append(data)
    return images


async def _read(part: ImagePart, policy: MediaPolicy) -> bytes:
    scheme = urlsplit(part.url).scheme.lower()
    if scheme == "data":
        return data_url_bytes(part.url, part.where, policy.max_bytes)
    if scheme == "file":
        return await asyncio.to_thread(local_file_bytes, part.url, part.where, policy)
    if scheme in ("http", "https"):
        return await fetched_bytes(part.url, part.where, policy)
    raise bad_field(part.where, f"a URL of scheme {scheme!r}; data:, http(s):// and file:// URLs are served")


def data_url_bytes(url: str, where: str, max_bytes: int) -> bytes:
    """A data URL's bytes: `data:image/png;base64,...` (or jpeg, webp), strictly base64."""
    header, comma, payload = url.partition(",")
    media_type, *parameters = header[len("data:") :].split(";")
    if not comma or parameters != ["base64"]:
        raise bad_field(where, "a data URL must be data:<media type>;base64,<base64 data>")
    if media_type.lower() not in FORMATS.values():
        raise bad_field(where, f"a data URL of media type {media_type!r}; served: {', '.join(FORMATS.values())}")
    if len(payload) // 4 * 3 > max_bytes:
        raise bad_field(where, f"about {len(payload) // 4 * 3} bytes of image, more than the {max_bytes} served")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as error:
        raise bad_field(where, f"the data URL's data is not base64 ({error})") from None


def local_file_bytes(url: str, where: str, policy: MediaPolicy) -> bytes:
    """A file:// URL's bytes, from under --allowed-local-media-path only (symbolic links resolved first)."""
    if policy.local_path is None:
        raise bad_field(where, "file:// URLs are not served (start the server with --allowed-local-media-path DIR)")
    split = urlsplit(url)
    if split.netloc not in ("", "localhost"):
        raise bad_field(where, f"a file:// URL of host {split.netloc!r}; only local files are served")
    path = Path(unquote(split.path)).resolve()
    root = policy.local_path.resolve()
    if not path.is_relative_to(root):
        raise bad_field(where, f"{path} is not under --allowed-local-media-path {root}")
    try:
        with path.open("rb") as file:
            data = file.read(policy.max_bytes + 1)
    except OSError as error:
        raise bad_field(where, f"{path} cannot be read ({error.strerror})") from None
    if len(data) > policy.max_bytes:
        raise bad_field(where, f"{path} holds more than the {policy.max_bytes} bytes of image served")
    return data


def check_image(data: bytes, where: str, policy: MediaPolicy) -> None:
    """Refuses bytes that are not a PNG, JPEG or WebP image, or whose header declares too many pixels."""
    from PIL import Image, UnidentifiedImageError  # the orchestrator needs Pillow only when images come

    try:
        with Image.open(io.BytesIO(data), formats=list(FORMATS)) as image:
            width, height = image.size
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise bad_field(where, f"{len(data)} bytes that are not a PNG, JPEG or WebP image ({error})") from None
    if width * height > policy.max_pixels:
        raise bad_field(where, f"an image of {width}x{height} pixels, more than the {policy.max_pixels} served")


async def fetched_bytes(url: str, where: str, policy: MediaPolicy) -> bytes:
    """An http(s) URL's bytes: its host (and every redirect's) allowed, public addresses only, within the timeout
    and the byte limit."""
    resolver = PublicResolver() if policy.public_only else None
    connector = aiohttp.TCPConnector(resolver=resolver, force_close=True)
    timeout = aiohttp.ClientTimeout(total=policy.timeout_s)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            for _ in range(MAX_REDIRECTS + 1):
                _check_host(url, where, policy)
                async with session.get(url, allow_redirects=False) as response:
                    if response.status in (301, 302, 303, 307, 308) and "Location" in response.headers:
                        url = urljoin(url, response.headers["Location"])
                        continue
                    if response.status != 200:
                        raise bad_field(where, f"fetching {url} answered HTTP {response.status}")
                    return await _body(response, url, where, policy.max_bytes)
            raise bad_field(where, f"more than {MAX_REDIRECTS} redirects from the image URL")
    except NonPublicAddress as error:
        raise bad_field(where, f"{error}; images are fetched from public addresses only") from None
    except (aiohttp.ClientError, TimeoutError) as error:
        reason = f"not within {policy.timeout_s:g} s" if isinstance(error, TimeoutError) else str(error)
        raise bad_field(where, f"fetching {url} failed: {reason}") from None


def _check_host(url: str, where: str, policy: MediaPolicy) -> None:
    split = urlsplit(url)
    if split.scheme not in ("http", "https"):
        raise bad_field(where, f"a redirect to {url}; only http(s) URLs are fetched")
    host = (split.hostname or "").lower()
    if host not in policy.allowed_domains:
        allowed = ", ".join(sorted(policy.allowed_domains)) or "none: start the server with --allowed-media-domains"
        raise bad_field(where, f"host {host!r} is not an allowed media domain ({allowed})")


async def _body(response: aiohttp.ClientResponse, url: str, where: str, max_bytes: int) -> bytes:
    declared = response.content_length
    if declared is not None and declared > max_bytes:
        raise bad_field(where, f"{url} holds {declared} bytes, more than the {max_bytes} served")
    data = bytearray()
    async for chunk in response.content.iter_chunked(64 * 1024):
        data += chunk
        if len(data) > max_bytes:
            raise bad_field(where, f"{url} holds more than the {max_bytes} bytes of image served")
    return bytes(data)


class NonPublicAddress(aiohttp.ClientError):
    pass


class PublicResolver(AbstractResolver):
    """The system's resolver, refusing a host any of whose addresses is not public."""

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, family=family)
        results: list[ResolveResult] = []
        for family_found, _, proto, _, address in infos:
            ip = ipaddress.ip_address(address[0])
            if not ip.is_global or ip.is_multicast:
                raise NonPublicAddress(f"host {host!r} resolves to {ip}, not a public address")
            results.append(_result(host, str(ip), port, family_found, proto))
        return results

    async def close(self) -> None:
        return None


def _result(host: str, address: str, port: int, family: int, proto: int) -> Any:
    return ResolveResult(
        hostname=host, host=address, port=port, family=family, proto=proto, flags=socket.AI_NUMERICHOST
    )
