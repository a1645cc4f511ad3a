"""Images of chat requests (orchestrator.api.media): data URLs, file:// under the allowed directory, http(s) from
allowed public hosts, every limit applied before anything is fetched or decoded, each refusal a 400 naming the part.
The http(s) tests fetch from a real aiohttp server on loopback, counting what it was asked."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web
from PIL import Image

from orchestrator.api.media import MediaPolicy, read_images
from orchestrator.api.openai_protocol import ApiError, ImagePart

WHERE = "messages[0].content[1]"


def encoded(width: int = 6, height: int = 4, kind: str = "PNG") -> bytes:
    out = io.BytesIO()
    pixels = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(out, kind)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def read(urls: list[str], policy: MediaPolicy) -> list[bytes]:
    return asyncio.run(
        read_images([ImagePart(url, f"messages[0].content[{i + 1}]") for i, url in enumerate(urls)], policy)
    )


def refusal(urls: list[str], policy: MediaPolicy) -> str:
    with pytest.raises(ApiError) as caught:
        read(urls, policy)
    assert caught.value.status == 400 and caught.value.param is not None
    assert caught.value.message.startswith(f"{caught.value.param}: ")
    return caught.value.message


POLICY = MediaPolicy(limit=2)


def test_data_urls_of_each_format_are_read() -> None:
    images = [encoded(kind="PNG"), encoded(kind="JPEG")]
    assert read([data_url(images[0]), data_url(images[1], "image/jpeg")], POLICY) == images
    webp = encoded(kind="WEBP")
    assert read([data_url(webp, "image/webp")], POLICY) == [webp]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("data:image/png;base64,iVBOR!!", "the data URL's data is not base64"),
        ("data:image/png,iVBORw0KGgo=", "a data URL must be data:<media type>;base64,<base64 data>"),
        ("data:image/gif;base64,R0lGODlh", "a data URL of media type 'image/gif'"),
        (data_url(b"not an image at all"), "19 bytes that are not a PNG, JPEG or WebP image"),
        ("ftp://example.com/a.png", "a URL of scheme 'ftp'"),
        ("file:///etc/passwd", "file:// URLs are not served (start the server with --allowed-local-media-path DIR)"),
        ("https://example.com/a.png", "host 'example.com' is not an allowed media domain (none: start the server"),
    ],
)
def test_what_is_not_an_image_url_is_refused_naming_the_part(url: str, says: str) -> None:
    message = refusal([data_url(encoded()), url], POLICY)
    assert message.startswith(f"messages[0].content[2]: {says}"), message


def test_limits_come_before_reading() -> None:
    # A third image is refused at its part before the first two are read (they are not even data URLs).
    assert refusal(["https://a/1", "https://a/2", "x"], POLICY).startswith(
        "messages[0].content[3]: 3 images in the request; at most 2 per prompt (--limit-mm-per-prompt)"
    )
    assert refusal(["x"], MediaPolicy()).startswith("messages[0].content[1]: 1 images in the request; this server")
    big = data_url(encoded(40, 40))
    assert "bytes of image, more than the 100 served" in refusal([big], replace(POLICY, max_bytes=100))
    assert "an image of 40x40 pixels, more than the 1000 served" in refusal([big], replace(POLICY, max_pixels=1000))


def test_file_urls_are_read_only_under_the_allowed_directory(tmp_path: Path) -> None:
    allowed, outside = tmp_path / "media", tmp_path / "secret"
    allowed.mkdir(), outside.mkdir()
    (allowed / "cat.png").write_bytes(encoded())
    (outside / "key.png").write_bytes(encoded())
    (allowed / "escape.png").symlink_to(outside / "key.png")
    policy = replace(POLICY, local_path=allowed)
    assert read([f"file://{allowed}/cat.png"], policy) == [encoded()]
    for url in (f"file://{outside}/key.png", f"file://{allowed}/../secret/key.png", f"file://{allowed}/escape.png"):
        assert f"is not under --allowed-local-media-path {allowed}" in refusal([url], policy)
    assert "cannot be read (No such file or directory)" in refusal([f"file://{allowed}/none.png"], policy)
    assert "holds more than the 10 bytes" in refusal([f"file://{allowed}/cat.png"], replace(policy, max_bytes=10))
    assert "a file:// URL of host 'other'" in refusal([f"file://other{allowed}/cat.png"], policy)


@asynccontextmanager
async def image_server(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/{name}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://localhost:{port}"
    finally:
        await runner.cleanup()


def fetch(urls: Callable[[str], list[str]], policy: MediaPolicy) -> tuple[list[bytes] | str, list[str]]:
    """Reads the URLs `urls(base)` names from a server at `base`: what came (or the refusal) and what it was asked."""
    asked: list[str] = []
    image = encoded()

    async def handler(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        asked.append(name)
        if name == "slow.png":
            await asyncio.sleep(5)
        if name.startswith("to-"):
            raise web.HTTPFound(name.removeprefix("to-").replace("|", "/"))
        if name == "big.png":
            return web.Response(body=image * 100)
        return web.Response(body=image, content_type="image/png")

    async def run() -> list[bytes] | str:
        async with image_server(handler) as base:
            parts = [ImagePart(url, WHERE) for url in urls(base)]
            try:
                return await read_images(parts, policy)
            except ApiError as error:
                return error.message

    return asyncio.run(run()), asked


def test_http_urls_are_fetched_from_allowed_hosts_within_the_limits() -> None:
    allowed = replace(POLICY, allowed_domains=frozenset({"localhost"}), public_only=False, timeout_s=1.0)
    assert fetch(lambda base: [f"{base}/a.png"], allowed) == ([encoded()], ["a.png"])
    # A redirect is followed when it names an allowed host; one to another host is refused unfetched.
    came, asked = fetch(lambda base: [f"{base}/to-a.png"], allowed)
    assert (came, asked) == ([encoded()], ["to-a.png", "a.png"])
    came, asked = fetch(lambda base: [f"{base}/to-http:||127.0.0.1:9|a.png"], allowed)
    assert came == f"{WHERE}: host '127.0.0.1' is not an allowed media domain (localhost)" and len(asked) == 1
    came, _ = fetch(lambda base: [f"{base}/big.png"], replace(allowed, max_bytes=1000))
    assert isinstance(came, str) and came.endswith("more than the 1000 served")
    came, _ = fetch(lambda base: [f"{base}/slow.png"], allowed)
    assert isinstance(came, str) and came.endswith("failed: not within 1 s")


def test_a_host_resolving_to_a_private_address_is_refused_unfetched() -> None:
    public_only = replace(POLICY, allowed_domains=frozenset({"localhost"}))
    came, asked = fetch(lambda base: [f"{base}/a.png"], public_only)
    assert isinstance(came, str) and asked == []
    assert "resolves to 127.0.0.1, not a public address; images are fetched from public addresses only" in came
