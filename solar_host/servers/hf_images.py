"""Image bytes for vision requests: data: URIs always, http(s) URLs only when allowed.

Fetching is off by default: a server that fetches what a request names can be steered at the
machines behind it (cloud metadata at 169.254.169.254, admin ports on loopback, the LAN). When
an operator turns it on (`allow_image_urls`), every address the host name resolves to must be
public (not private, loopback, link-local, multicast, reserved or unspecified, IPv4-mapped
forms included), and the connection goes to the address that was checked, not to a second
lookup of the name (which a rebinding DNS server could answer differently). Redirects are
followed by hand, each target checked the same way. Bodies are read up to the size limit and
no further, and a request's fetches (run side by side) end within one deadline however slowly a
server answers: httpx's own timeout bounds each read, not the body, so a server that sends a
byte every few seconds would otherwise hold the request for as long as it liked. Bodies are
asked for and taken as sent (no Content-Encoding): a few KB of stacked gzip inflate to GBs.

`to_rgb` turns a decoded image into what a vision processor expects: upright, 8-bit RGB.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urljoin, urlsplit

from solar_host.servers.hf_protocol import APIError, bad, decode_data_uri, image_too_large

if TYPE_CHECKING:
    from PIL.Image import Image

MAX_REDIRECTS = 3
# A request's image fetches, all of them (lookups, redirects, bodies), end within this.
FETCH_TIMEOUT_S = 10.0

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


# Deprecated IPv6 site-local addresses (RFC 3879), still routed inside some sites:
# is_global says True for them.
_SITE_LOCAL = ipaddress.ip_network("fec0::/10")


def address_is_public(addr: Address) -> bool:
    """True only for globally routable unicast addresses. An IPv6 address that carries an IPv4
    one (mapped, 6to4, Teredo) is judged by that: 2002:7f00:1:: is 127.0.0.1 over 6to4."""
    if isinstance(addr, ipaddress.IPv6Address):
        if addr in _SITE_LOCAL:
            return False
        inner = addr.ipv4_mapped or addr.sixtofour or (addr.teredo[1] if addr.teredo else None)
        if inner is not None:
            addr = inner
    return addr.is_global and not (
        addr.is_private
        or addr.is_loopback
        or addr.is_link_local
        or addr.is_multicast
        or addr.is_reserved
        or addr.is_unspecified
    )


@dataclass(frozen=True)
class ImagePolicy:
    allow_urls: bool = False
    max_images: int = 8
    max_bytes: int = 10 * 1024 * 1024
    fetch_timeout_s: float = FETCH_TIMEOUT_S
    # Which resolved addresses may be fetched; tests on a loopback-only machine widen it.
    address_ok: Callable[[Address], bool] = address_is_public


class ImageLoader:
    def __init__(self, policy: ImagePolicy):
        self.policy = policy
        # Built once: loading the CA bundle took ~15 ms of the server's loop per image URL.
        # Connections are never reused (one client per fetch): they are opened to an address
        # checked for this URL, with this URL's TLS name.
        self._tls: Any = None

    async def load(self, urls: list[str]) -> list[bytes]:
        if len(urls) > self.policy.max_images:
            raise bad(
                f"'messages' has {len(urls)} images; this server accepts at most "
                f"{self.policy.max_images} per request",
                "messages",
                code="too_many_images",
            )
        # data: URIs are checked first: a bad one is refused before anything is fetched.
        inline = {
            i: decode_data_uri(url, self.policy.max_bytes)
            for i, url in enumerate(urls)
            if not self._fetched(url)
        }
        got = iter(await self._fetch_all([u for i, u in enumerate(urls) if i not in inline]))
        return [inline[i] if i in inline else next(got) for i in range(len(urls))]

    def _fetched(self, url: str) -> bool:
        return self.policy.allow_urls and url[:8].lower().startswith(("http://", "https://"))

    async def _fetch_all(self, urls: list[str]) -> list[bytes]:
        """Fetch `urls` side by side, all within the policy's deadline; the first failure
        ends the others."""
        if not urls:
            return []
        limit = self.policy.fetch_timeout_s
        tasks = [asyncio.create_task(self.fetch(url)) for url in urls]
        try:
            async with asyncio.timeout(limit) as deadline:
                return await asyncio.gather(*tasks)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise APIError(
                400,
                f"Image URLs were not fetched within {limit:g} s",
                code="image_url_timeout",
                param="messages",
            ) from None
        finally:
            for task in tasks:
                task.cancel()

    async def _checked_address(self, host: str, port: int) -> str:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            )
        except OSError as err:
            raise bad(f"Image URL host {host!r} cannot be resolved: {err}", "messages") from None
        addrs = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
        refused = [a for a in addrs if not self.policy.address_ok(a)]
        if not addrs or refused:
            raise APIError(
                400,
                f"Image URL host {host!r} resolves to a non-public address "
                f"({refused[0] if refused else 'none'}); only public addresses are fetched",
                code="image_url_refused",
                param="messages",
            )
        return str(addrs[0])

    async def fetch(self, url: str) -> bytes:
        import httpx

        limit = self.policy.max_bytes
        if self._tls is None:
            self._tls = httpx.create_ssl_context()
        async with httpx.AsyncClient(
            follow_redirects=False,
            timeout=self.policy.fetch_timeout_s,
            trust_env=False,
            verify=self._tls,
        ) as client:
            for _ in range(MAX_REDIRECTS + 1):
                parts = urlsplit(url)
                if parts.scheme not in ("http", "https") or not parts.hostname:
                    raise bad(f"Image URL must be http(s) with a host: {url[:200]!r}", "messages")
                port = parts.port or (443 if parts.scheme == "https" else 80)
                ip = await self._checked_address(parts.hostname, port)
                netloc = f"[{ip}]" if ":" in ip else ip
                target = parts._replace(netloc=f"{netloc}:{port}").geturl()
                ext: dict[str, Any] = {}
                if parts.scheme == "https":  # TLS still checks the name, not the address
                    ext["sni_hostname"] = parts.hostname
                host_header = parts.hostname if parts.port is None else f"{parts.hostname}:{port}"
                try:
                    # identity: an image is compressed already, and a body is taken as sent
                    # (see `_refuse_encoded`).
                    headers = {"Host": host_header, "Accept-Encoding": "identity"}
                    async with client.stream("GET", target, headers=headers, extensions=ext) as r:
                        if r.status_code in (301, 302, 303, 307, 308) and "location" in r.headers:
                            url = urljoin(url, r.headers["location"])
                            continue
                        if r.status_code != 200:
                            raise bad(
                                f"Image URL answered HTTP {r.status_code}: {url[:200]}",
                                "messages",
                            )
                        _refuse_encoded(r.headers.get("content-encoding", ""), url)
                        declared = r.headers.get("content-length", "")
                        if declared.isdigit() and int(declared) > limit:
                            raise image_too_large(int(declared), limit)
                        data = bytearray()
                        # Raw: the bytes on the wire are the bytes counted against the limit.
                        async for chunk in r.aiter_raw():
                            data += chunk
                            if len(data) > limit:
                                raise image_too_large(len(data), limit)
                        if not data:
                            raise bad(f"Image URL returned no data: {url[:200]}", "messages")
                        return bytes(data)
                except httpx.HTTPError as err:
                    raise bad(
                        f"Image URL could not be fetched: {type(err).__name__}: {err}", "messages"
                    ) from None
            raise bad(f"Image URL redirected more than {MAX_REDIRECTS} times", "messages")


def _refuse_encoded(content_encoding: str, url: str) -> None:
    """Refuse a body sent with a Content-Encoding other than identity (we ask for identity).

    httpx would decode it, stacked codings too ('gzip, gzip'), and a chunk is checked against
    the size limit only once it is inflated: 1.8 KB of doubly gzipped zeros became 1 GiB, on
    the event loop, before the 10 MB limit refused it. Refusing is simpler and safer than a
    bounded decoder for every coding (gzip, deflate, br, zstd, stacked): images are compressed
    already, so servers seldom encode them, and those that do honour Accept-Encoding: identity.
    """
    codings = [c.strip().lower() for c in content_encoding.split(",")]
    if any(c not in ("", "identity") for c in codings):
        raise bad(
            f"Image URL answered with Content-Encoding {content_encoding[:100]!r}; only "
            f"unencoded images are fetched: {url[:200]}",
            "messages",
            code="image_url_encoded",
        )


def to_rgb(img: Image) -> Image:
    """`img` decoded, upright and as 8-bit RGB, which is what vision processors expect.

    Image.convert("RGB") alone gets three kinds of image wrong: it clips 16-bit samples (a
    mid-grey 16-bit PNG came out white), it ignores the EXIF orientation (a phone photo
    reached the model on its side), and it drops alpha (transparent pixels showed whatever
    colour they stored, often black): they are composited onto white, as a viewer shows them.
    Decoding errors are the caller's to report.
    """
    img.load()
    img = _upright(img)
    if img.mode in ("I", "I;16", "I;16L", "I;16B", "I;16N", "F"):
        img = _to_8bit(img)
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        return _on_white(img)
    return img.convert("RGB")


def _upright(img: Image) -> Image:
    """`img` turned as its EXIF orientation says; as stored if the EXIF cannot be read (a
    broken EXIF block should not fail an image that decodes)."""
    from PIL import ImageOps

    try:
        ImageOps.exif_transpose(img, in_place=True)
    except Exception:
        pass
    return img


def _to_8bit(img: Image) -> Image:
    """A one-channel image of 16-bit integers or floats as 8-bit grey (mode L), scaled from its
    range: 16 bits for the I;16 modes and for I when its values fit them (16-bit PNGs open as
    I;16, or as I in older Pillow), 0..1 for F when they fit it, else the image's own maximum."""
    import numpy as np
    from PIL import Image as PILImage

    a = np.asarray(img, dtype=np.float32)  # exact for 16-bit integers
    low, high = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
    if img.mode.startswith("I;16") or (img.mode == "I" and low >= 0 and high <= 65535):
        top = 65535.0
    elif img.mode == "F" and low >= 0 and high <= 1:
        top = 1.0
    else:
        top = max(high, 1.0)
    grey = np.clip(np.rint(a * (255.0 / top)), 0, 255).astype(np.uint8)
    return PILImage.fromarray(grey)  # 2-D uint8: mode L


def _on_white(img: Image) -> Image:
    """`img` with its transparency composited onto white, as RGB."""
    from PIL import Image as PILImage

    rgba = img.convert("RGBA")  # P and L/RGB with a transparent colour get their alpha here
    page = PILImage.new("RGBA", rgba.size, (255, 255, 255, 255))
    page.alpha_composite(rgba)
    return page.convert("RGB")
