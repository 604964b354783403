"""Vision for real: a tiny LLaVA built locally from a config (no hub) served by hf_server,
sent real PNGs; image limits; URL fetching off by default and never to private addresses."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import io
import struct
import sys
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from solar_host.servers.hf_images import ImageLoader, ImagePolicy
from solar_host.servers.hf_protocol import APIError, decode_data_uri, vision_messages
from tests.fixtures.hf_models import tiny_vision_model  # noqa: F401 (fixture)
from tests.test_hf_server import assert_error, launch, post, stop, wait_ready

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux only")

MAX_BYTES = 4096


def png(w: int = 40, h: int = 30, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


def noise_png(w: int, h: int) -> bytes:
    import numpy as np
    from PIL import Image

    px = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, format="PNG")
    return buf.getvalue()


def header_only_png(w: int, h: int) -> bytes:
    """A PNG whose header claims w x h pixels, with almost no data (a decompression bomb's
    shape: refused from its header, before any pixel is decoded)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(b"\0" * 100))
        + chunk(b"IEND", b"")
    )


def data_uri(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def chat(*urls: str, text: str = "what is this?", **extra) -> dict:
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": parts}], "temperature": 0, **extra}


@pytest.fixture(scope="module")
def vlm(tiny_vision_model: Path, tmp_path_factory):  # noqa: F811
    logs = tmp_path_factory.mktemp("vlm-logs")
    servers = {
        "vlm": launch(
            "huggingface_vision",
            tiny_vision_model,
            logs / "vlm.log",
            alias="tiny-vlm",
            max_images=2,
            max_image_bytes=MAX_BYTES,
        ),
        "fetching": launch(
            "huggingface_vision",
            tiny_vision_model,
            logs / "fetching.log",
            alias="tiny-vlm-urls",
            allow_image_urls=True,
        ),
    }
    try:
        wait_ready(list(servers.values()))
        yield servers
    finally:
        stop(list(servers.values()))


def test_real_png_gets_a_completion_with_image_tokens_counted(vlm, tiny_vision_model) -> None:  # noqa: F811
    from PIL import Image
    from transformers import AutoProcessor

    s = vlm["vlm"]
    raw = png()
    r = post(s, "/v1/chat/completions", chat(data_uri(raw), max_tokens=6))
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["model"] == "tiny-vlm" and j["choices"][0]["message"]["content"]
    assert j["choices"][0]["finish_reason"] == "length"
    # Usage as the processor counts it: the <image> placeholder becomes 16 image tokens.
    proc = AutoProcessor.from_pretrained(tiny_vision_model)
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "what is this?"}, {"type": "image"}]}
    ]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True)
    ids = proc(text=[text], images=[Image.open(io.BytesIO(raw)).convert("RGB")])["input_ids"][0]
    image_id = proc.tokenizer.convert_tokens_to_ids("<image>")
    assert list(ids).count(image_id) == 16
    u = j["usage"]
    assert u["prompt_tokens"] == len(ids) and u["completion_tokens"] == 6
    assert u["total_tokens"] == len(ids) + 6

    # Two images count twice; a different image changes nothing in the counts.
    r2 = post(
        s,
        "/v1/chat/completions",
        chat(data_uri(raw), data_uri(png(color=(0, 0, 255))), max_tokens=3),
    )
    assert r2.status_code == 200, r2.text
    assert r2.json()["usage"]["prompt_tokens"] == len(ids) + 16

    # Streamed: the same text, token by token.
    events = []
    body = chat(data_uri(raw), max_tokens=6, stream=True)
    with httpx.stream(
        "POST",
        s.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": "Bearer host-key-123"},
        timeout=60,
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(line)
    import json

    text_out = "".join(
        json.loads(e[6:])["choices"][0]["delta"].get("content") or "" for e in events
    )
    assert text_out == j["choices"][0]["message"]["content"]


def test_image_limits_are_4xx(vlm) -> None:
    s = vlm["vlm"]
    ok = data_uri(png())
    err = assert_error(post(s, "/v1/chat/completions", chat(ok, ok, ok)), 400, "at most 2")
    assert err["code"] == "too_many_images"
    big = noise_png(64, 64)
    assert len(big) > MAX_BYTES
    err = assert_error(post(s, "/v1/chat/completions", chat(data_uri(big))), 413, "limit")
    assert err["code"] == "image_too_large"
    bomb = header_only_png(10_000, 10_000)
    err = assert_error(post(s, "/v1/chat/completions", chat(data_uri(bomb))), 413, "pixels")
    assert err["code"] == "image_too_large"
    # Within the limit one by one, past it together: refused before either is decoded.
    half = data_uri(header_only_png(5_000, 5_000))
    err = assert_error(post(s, "/v1/chat/completions", chat(half, half)), 413, "in all")
    assert err["code"] == "image_too_large"
    assert_error(
        post(s, "/v1/chat/completions", chat(data_uri(b"not an image at all"))), 400, "decoded"
    )
    # Fetching is off unless the operator turns it on.
    err = assert_error(
        post(s, "/v1/chat/completions", chat("https://example.com/cat.png")), 400, "data: URIs"
    )
    assert err["code"] == "unsupported_image_url"
    # Still serving.
    assert post(s, "/v1/chat/completions", chat(ok, max_tokens=2)).status_code == 200


def test_fetching_never_reaches_private_addresses(vlm) -> None:
    s = vlm["fetching"]
    for url in (
        "http://127.0.0.1:9/cat.png",
        "http://localhost:9/cat.png",
        "http://[::1]:9/cat.png",
        "http://169.254.169.254/latest/meta-data",
        "http://10.1.2.3/x.png",
        "http://[::ffff:127.0.0.1]:9/x.png",
    ):
        err = assert_error(post(s, "/v1/chat/completions", chat(url)), 400, "non-public")
        assert err["code"] == "image_url_refused", url
    # data: URIs still work there.
    assert post(s, "/v1/chat/completions", chat(data_uri(png()), max_tokens=2)).status_code == 200


@contextlib.asynccontextmanager
async def image_server(handler: Any) -> AsyncIterator[int]:
    """A real local HTTP server for image fetches (the internet is not reachable here), reached
    as http://images.test:PORT: the name resolves to loopback, and the loaders built with
    `loopback_loader` accept loopback for these tests only. Yields the port."""
    from aiohttp import web

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    loop = asyncio.get_running_loop()
    real = loop.getaddrinfo

    async def resolve(host: str, port: int, **kw: Any) -> Any:
        return await real("127.0.0.1" if host == "images.test" else host, port, **kw)

    loop.getaddrinfo = resolve  # type: ignore[method-assign]
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        del loop.getaddrinfo
        await runner.cleanup()


def loopback_loader(**policy: Any) -> ImageLoader:
    return ImageLoader(
        ImagePolicy(
            allow_urls=True, max_bytes=MAX_BYTES, address_ok=lambda a: a.is_loopback, **policy
        )
    )


async def test_fetch_follows_checked_redirects_and_caps_the_size() -> None:
    from aiohttp import web

    image = png()
    hits: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        hits.append(request.path)
        if request.path == "/redirect":
            raise web.HTTPFound("/cat.png")
        if request.path == "/big":
            return web.Response(body=b"x" * (MAX_BYTES + 1))
        if request.path == "/cat.png":
            assert request.headers["Host"].startswith("images.test")
            return web.Response(body=image, content_type="image/png")
        return web.Response(status=404)

    async with image_server(handler) as port:
        loader = loopback_loader()
        got = await loader.load([f"http://images.test:{port}/redirect"])
        assert got == [image] and hits == ["/redirect", "/cat.png"]
        with pytest.raises(APIError) as ei:
            await loader.load([f"http://images.test:{port}/big"])
        assert ei.value.status == 413
        with pytest.raises(APIError) as ei:
            await loader.load([f"http://images.test:{port}/missing"])
        assert ei.value.status == 400 and "404" in ei.value.message
        # The default policy refuses the same server before connecting.
        before = len(hits)
        with pytest.raises(APIError) as ei:
            await ImageLoader(ImagePolicy(allow_urls=True)).load(
                [f"http://127.0.0.1:{port}/cat.png"]
            )
        assert ei.value.code == "image_url_refused" and len(hits) == before


async def test_a_slow_image_server_cannot_hold_the_request() -> None:
    """httpx's timeout bounds each read; a server that sends a byte now and then, well within
    it, would hold the request for as long as it liked. The request's fetches end at one
    deadline, with a 400 naming the field, and the server sees the connection closed."""
    from aiohttp import web

    closed = asyncio.Event()

    async def drip(request: web.Request) -> web.StreamResponse:
        r = web.StreamResponse(headers={"Content-Type": "image/png"})
        await r.prepare(request)
        try:
            for _ in range(600):  # 60 s at most, far past the deadline
                await r.write(b"x")
                await asyncio.sleep(0.1)
        except (ConnectionError, asyncio.CancelledError):
            closed.set()
            raise
        return r

    async with image_server(drip) as port:
        loader = loopback_loader(fetch_timeout_s=0.5)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(APIError) as ei:
            await loader.load([f"http://images.test:{port}/slow.png"])
        took = loop.time() - started
        assert ei.value.status == 400 and ei.value.code == "image_url_timeout"
        assert ei.value.param == "messages" and "0.5 s" in ei.value.message
        assert took < 10, took  # ended by the deadline, not by the 60 s drip
        await asyncio.wait_for(closed.wait(), 10)


async def test_images_of_a_request_are_fetched_side_by_side_in_order() -> None:
    """Every image URL of a request is fetched at once (each server waits until all requests
    are in: fetched one after another they never would be), and the images keep their places
    among data: URIs; one failing fetch fails the request and ends the others."""
    from aiohttp import web

    images = {f"/{n}.png": png(color=(n * 40, 0, 0)) for n in range(3)}
    arrived: set[str] = set()
    all_in = asyncio.Event()
    stopped: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        arrived.add(request.path)
        if len(arrived) == 3:
            all_in.set()
        await asyncio.wait_for(all_in.wait(), 10)
        if request.path == "/bad.png":
            return web.Response(status=500)
        if request.path == "/hang.png":  # a body that never ends, until the client leaves
            r = web.StreamResponse(headers={"Content-Type": "image/png"})
            await r.prepare(request)
            try:
                for _ in range(300):
                    await r.write(b"x")
                    await asyncio.sleep(0.1)
            except (ConnectionError, asyncio.CancelledError):
                stopped.append(request.path)
                raise
            return r
        return web.Response(body=images[request.path], content_type="image/png")

    inline = png(color=(0, 0, 250))
    async with image_server(handler) as port:
        url = f"http://images.test:{port}"
        got = await loopback_loader().load(
            [f"{url}/0.png", data_uri(inline), f"{url}/1.png", f"{url}/2.png"]
        )
        assert got == [images["/0.png"], inline, images["/1.png"], images["/2.png"]]

        arrived.clear()
        all_in.clear()
        with pytest.raises(APIError) as ei:
            await loopback_loader().load([f"{url}/hang.png", f"{url}/bad.png", f"{url}/0.png"])
        assert ei.value.status == 400 and "500" in ei.value.message
        # The hanging fetch was ended with the request, not left to run.
        for _ in range(100):
            if "/hang.png" in stopped:
                break
            await asyncio.sleep(0.05)
        assert "/hang.png" in stopped


def test_vision_parsing_counts_images_and_decodes_data_uris() -> None:
    raw = b"\x89PNG fake"
    uri = data_uri(raw)
    msgs, urls = vision_messages(chat(uri))
    assert urls == [uri] and decode_data_uri(uri) == raw
    assert msgs[0]["content"] == [{"type": "text", "text": "what is this?"}, {"type": "image"}]
    with pytest.raises(APIError) as ei:
        vision_messages(chat(uri, uri, uri), max_images=2)
    assert ei.value.code == "too_many_images"
    with pytest.raises(APIError) as ei:
        decode_data_uri(data_uri(b"x" * 5000), max_bytes=4096)
    assert ei.value.status == 413


def peak_rss_mb(pid: int) -> float:
    """The highest resident memory the process has had (VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_thin_images_are_refused_before_the_processor_scales_them_up(vlm) -> None:
    """The processor scales an image's shortest edge to its target and the long edge with it:
    a 10x4,000,000 PNG (300 KB, within the pixel limit) took 19 s and 5.7 GB in the tiny
    model's processor. Past 200:1 an image is refused from its header, with a 400 naming the
    field; at 200:1 it is served."""
    s = vlm["vlm"]
    err = assert_error(post(s, "/v1/chat/completions", chat(data_uri(png(4, 4000)))), 400, "200")
    assert err["code"] == "image_aspect_ratio" and err["param"] == "messages"
    assert "4x4000" in err["message"]
    r = post(s, "/v1/chat/completions", chat(data_uri(png(2000, 10)), max_tokens=2))
    assert r.status_code == 200, r.text

    big = vlm["fetching"]  # the default 10 MB image limit lets the 300 KB PNG in
    thin = data_uri(png(10, 4_000_000))
    started = time.monotonic()
    err = assert_error(post(big, "/v1/chat/completions", chat(thin), timeout=120), 400, "200")
    took = time.monotonic() - started
    assert err["code"] == "image_aspect_ratio" and err["param"] == "messages"
    assert took < 5, took
    assert peak_rss_mb(big.proc.pid) < 2000


def test_memory_error_while_preparing_images_is_a_413(tiny_vision_model, monkeypatch) -> None:  # noqa: F811
    """Running out of memory on a request's images is the request's doing: a 413 naming the
    field, not a 500."""
    from transformers import AutoProcessor

    from solar_host.servers import hf_runtime

    engine = hf_runtime.VisionEngine.__new__(hf_runtime.VisionEngine)  # no model needed
    engine.processor = AutoProcessor.from_pretrained(tiny_vision_model)
    engine.device = "cpu"
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"}]}]
    assert "pixel_values" in engine.vision_inputs(msgs, [png()])

    def out_of_memory(*args: Any, **kw: Any) -> Any:
        raise MemoryError

    # Decoding the image.
    monkeypatch.setattr(hf_runtime, "to_rgb", out_of_memory)
    with pytest.raises(APIError) as ei:
        engine.vision_inputs(msgs, [png()])
    assert ei.value.status == 413 and ei.value.param == "messages"
    assert "too large" in ei.value.message
    monkeypatch.undo()

    # The processor's resize (a 2x20,000,000 PNG was a 500 MemoryError there).
    class Processor:  # the real template, then no memory for the pixels
        apply_chat_template = staticmethod(engine.processor.apply_chat_template)
        __call__ = staticmethod(out_of_memory)

    engine.processor = Processor()
    with pytest.raises(APIError) as ei:
        engine.vision_inputs(msgs, [png()])
    assert ei.value.status == 413 and ei.value.code == "image_too_large"
    assert ei.value.param == "messages" and "too large" in ei.value.message


def double_gzip_of_zeros(n: int) -> bytes:
    """`n` zero bytes gzipped twice: a body of a few KB that inflates to `n` bytes."""
    inner = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = b"\0" * (1 << 20)
    once = b"".join(inner.compress(block) for _ in range(n >> 20)) + inner.flush()
    return gzip.compress(once, 9)


async def test_an_encoded_image_body_is_refused_not_inflated() -> None:
    """httpx decodes any Content-Encoding, stacked ones too, before the size limit sees a
    chunk: 1.8 KB of 'gzip, gzip' became 1 GiB in memory. The loader asks for identity, and a
    body sent encoded anyway is refused (400 naming the field), its bytes never inflated."""
    import tracemalloc

    from aiohttp import web

    bomb = double_gzip_of_zeros(64 << 20)
    image = png()
    asked: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        asked.append(request.headers.get("Accept-Encoding", ""))
        if request.path == "/plain.png":
            return web.Response(
                body=image, headers={"Content-Type": "image/png", "Content-Encoding": "identity"}
            )
        return web.Response(
            body=bomb, headers={"Content-Type": "image/png", "Content-Encoding": "gzip, gzip"}
        )

    async with image_server(handler) as port:
        loader = loopback_loader()
        assert await loader.load([f"http://images.test:{port}/plain.png"]) == [image]
        tracemalloc.start()
        try:
            with pytest.raises(APIError) as ei:
                await loader.load([f"http://images.test:{port}/bomb.png"])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert ei.value.status == 400 and ei.value.param == "messages"
    assert ei.value.code == "image_url_encoded" and "gzip, gzip" in ei.value.message
    assert peak < 16 << 20, peak  # nothing near the 64 MB it would inflate to
    assert asked == ["identity", "identity"]


def test_sampling_options_shape_vision_text_as_they_do_causal_text(vlm, tiny_vision_model) -> None:  # noqa: F811
    """Vision models decode through `generate`, where logit_bias, the penalties, top_k and
    min_p were accepted and ignored; they now shape its text as the batched scheduler's."""
    from transformers import AutoProcessor

    s = vlm["vlm"]
    tok = AutoProcessor.from_pretrained(tiny_vision_model).tokenizer
    image = data_uri(png())

    def text(**options: object) -> str:
        r = post(s, "/v1/chat/completions", chat(image, max_tokens=4, **options))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    forced = 7
    assert text(logit_bias={str(forced): 100}) == tok.decode([forced] * 4)
    greedy = text()
    assert text(temperature=1.5, top_k=1, seed=3) == greedy
    assert text(temperature=1.5, min_p=1.0, seed=3) == greedy
    banned = {str(t): -100 for t in tok.encode(greedy, add_special_tokens=False)}
    assert text(logit_bias=banned) != greedy  # its tokens banned, the text changes
    bad = post(s, "/v1/chat/completions", chat(image, logit_bias={"99999999": 5}))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias", bad.text
