"""Image URLs: data: URL decoding, and http(s) fetching against a local server (allowed and
refused hosts, redirects, size, pixel and time limits, private addresses)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import ipaddress
import random
import ssl
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from asyncserve.multimodal import http_fetch
from asyncserve.multimodal.http_fetch import address_refusal
from asyncserve.multimodal.media import (
    MediaError,
    MediaPolicy,
    decode_image,
    fetch_image,
    load_image,
)

BIG = 256 * 1024  # bodies of the oversize endpoints; the policies below cap at 64 KiB


def _encoded(fmt: str, mode: str = "RGB", size: tuple[int, int] = (8, 6)) -> bytes:
    color = (200, 10, 20, 0) if mode == "RGBA" else (200, 10, 20)
    out = io.BytesIO()
    Image.new(mode, size, color).save(out, fmt)
    return out.getvalue()


def _data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with a tiny body: a decompression bomb's
    header, refused before any pixel is decoded."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


PNG = _encoded("PNG")


def _noise_png(side: int = 30) -> bytes:
    """A PNG that does not compress: cutting it cuts pixel data."""
    pixels = random.Random(0).randbytes(side * side * 3)
    out = io.BytesIO()
    Image.frombytes("RGB", (side, side), pixels).save(out, "PNG")
    return out.getvalue()


class _Handler(BaseHTTPRequestHandler):
    hits: list[str]  # set per server: every path requested, in order

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", **headers: str) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.hits.append(self.path)
        port = self.server.server_address[1]
        # The client may stop reading (an oversize body): expected.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._route(port)

    def _route(self, port: int) -> None:
        path = self.path
        if path == "/image.png":
            self._send(200, PNG, Content_Type="image/png", Content_Length=str(len(PNG)))
        elif path == "/redirect":
            self._send(302, Location="/image.png", Content_Length="0")
        elif path.startswith("/chain/"):
            left = int(path.rsplit("/", 1)[1])
            target = "/image.png" if left == 0 else f"/chain/{left - 1}"
            self._send(302, Location=target, Content_Length="0")
        elif path == "/to-other-host":
            self._send(302, Location=f"http://127.0.0.1:{port}/image.png", Content_Length="0")
        elif path == "/big-declared":
            self._send(200, b"\0" * BIG, Content_Length=str(BIG))
        elif path == "/big-streamed":
            # HTTP/1.0 without Content-Length: the body ends when the connection closes.
            self.send_response(200)
            self.end_headers()
            for _ in range(BIG // 4096):
                self.wfile.write(b"\0" * 4096)
        elif path == "/slow":
            self.send_response(200)
            self.end_headers()
            for _ in range(40):  # a byte every 0.1 s: each read is quick, the whole is not
                self.wfile.write(PNG[:1])
                self.wfile.flush()
                time.sleep(0.1)
        elif path == "/bad.png":
            self._send(200, b"<html>not an image</html>", Content_Type="image/png")
        elif path == "/bomb.png":
            self._send(200, _png_header_only(100_000, 100_000), Content_Type="image/png")
        else:
            self._send(404, b"missing")


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[int, list[str]]]:
    hits: list[str] = []
    handler = type("Handler", (_Handler,), {"hits": hits})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield httpd.server_address[1], hits
    httpd.shutdown()
    httpd.server_close()


# `localhost` and `127.0.0.1` reach the same server under two host names: one allowed, one not.
LOCAL = MediaPolicy(
    allowed_domains=("localhost",), allow_private_addresses=True, max_bytes=64 * 1024
)


def _expect_refused(url: str, policy: MediaPolicy, match: str) -> None:
    with pytest.raises(MediaError, match=match):
        load_image(url, policy)


# --- data: URLs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt,media_type", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")]
)
def test_data_url_formats_decode_to_rgb(fmt: str, media_type: str) -> None:
    image = load_image(_data_url(_encoded(fmt), media_type), MediaPolicy())
    assert image.mode == "RGB" and image.size == (8, 6)
    red, green, blue = image.getpixel((0, 0))  # type: ignore[misc]
    assert red > 150 and green < 60 and blue < 60


def test_data_url_gif_first_frame_and_alpha_on_white() -> None:
    frames = [Image.new("RGB", (4, 4), color) for color in ((255, 0, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:])
    assert Image.open(io.BytesIO(out.getvalue())).n_frames == 2  # type: ignore[attr-defined]
    image = load_image(_data_url(out.getvalue(), "image/gif"), MediaPolicy())
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (255, 0, 0)
    clear = load_image(_data_url(_encoded("PNG", "RGBA"), "image/png"), MediaPolicy())
    assert clear.mode == "RGB" and clear.getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.parametrize(
    "url,match",
    [
        ("data:text/plain;base64,aGVsbG8=", "media type 'text/plain'"),
        ("data:image/bmp;base64,Qk0=", "media type 'image/bmp'"),
        ("data:image/png,rawbytes", "base64-encoded"),
        ("data:image/png;base64", "no ','"),
        ("data:image/png;base64,@@not base64@@", "base64 data does not decode"),
        (_data_url(b"hello, not an image", "image/png"), "not a PNG, JPEG, WebP or GIF image"),
        (_data_url(_noise_png()[:1500], "image/png"), r"\(PNG\) does not decode"),
        (_data_url(_encoded("JPEG")[:200], "image/jpeg"), "JPEG"),
        (_data_url(_encoded("PNG", size=(64, 64)), "image/png"), "over the limit of 1000 pixels"),
        (_data_url(b"\0" * 3000, "image/png"), "over the 2048 byte limit"),
    ],
)
def test_bad_data_urls_are_refused(url: str, match: str) -> None:
    _expect_refused(url, MediaPolicy(max_pixels=1000, max_bytes=2048), match)


@pytest.mark.parametrize("side", [5000, 100_000])
def test_decompression_bomb_refused_from_header(side: int) -> None:
    # 5000 x 5000 is over the policy's limit; 100000 x 100000 also over PIL's own.
    with pytest.raises(MediaError, match="over the limit of 16777216 pixels"):
        decode_image(_png_header_only(side, side), MediaPolicy())


@pytest.mark.parametrize(
    "url", ["file:///etc/passwd", "ftp://localhost/x.png", "gopher://x/", "/x.png"]
)
def test_other_schemes_refused(url: str) -> None:
    _expect_refused(url, LOCAL, "not accepted")


# --- hosts and addresses ----------------------------------------------------------------


def test_allowed_host_fetches(server: tuple[int, list[str]]) -> None:
    port, _ = server
    image = load_image(f"http://LOCALHOST:{port}/image.png", LOCAL)
    assert image.size == (8, 6) and image.mode == "RGB"


def test_host_not_allowed_is_never_contacted(server: tuple[int, list[str]]) -> None:
    port, hits = server
    before = len(hits)
    _expect_refused(f"http://127.0.0.1:{port}/image.png", LOCAL, "not in --allowed-media-domains")
    _expect_refused(f"http://localhost.evil:{port}/image.png", LOCAL, "not in")
    _expect_refused(f"http://localhost@127.0.0.1:{port}/x", LOCAL, "credentials")
    no_domains = MediaPolicy(allow_private_addresses=True)
    _expect_refused(f"http://localhost:{port}/image.png", no_domains, "need --allowed-media")
    assert len(hits) == before


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1", "localhost", "10.1.2.3", "169.254.169.254", "[::1]", "[::ffff:127.0.0.1]"],
)
def test_private_addresses_refused_before_connecting(
    server: tuple[int, list[str]], host: str
) -> None:
    port, hits = server
    policy = MediaPolicy(allowed_domains=(host.strip("[]"),), timeout_s=5)
    before, start = len(hits), time.monotonic()
    with pytest.raises(MediaError, match=r"address: refused"):
        load_image(f"http://{host}:{port}/image.png", policy)
    # An unroutable 10.x or 169.254.x address would take the whole timeout to fail.
    assert time.monotonic() - start < 1.0
    assert len(hits) == before


@pytest.mark.parametrize(
    "address",
    ["0.0.0.0", "100.64.0.1", "192.168.1.1", "224.0.0.1", "240.0.0.1", "fc00::1", "fe80::1",
     "ff02::1", "::", "2002:7f00:1::", "64:ff9b::a00:1", "::ffff:10.0.0.1"],
)  # fmt: skip
def test_non_public_addresses(address: str) -> None:
    assert address_refusal(ipaddress.ip_address(address)) is not None


@pytest.mark.parametrize("address", ["93.184.216.34", "2606:4700:4700::1111"])
def test_public_addresses(address: str) -> None:
    assert address_refusal(ipaddress.ip_address(address)) is None


# --- redirects, limits, errors ----------------------------------------------------------


def test_redirects_refused_by_default(server: tuple[int, list[str]]) -> None:
    port, hits = server
    _expect_refused(f"http://localhost:{port}/redirect", LOCAL, r"redirects \(HTTP 302\)")
    assert hits[-1] == "/redirect"


def test_redirects_followed_when_allowed_each_hop_checked(server: tuple[int, list[str]]) -> None:
    port, hits = server
    policy = MediaPolicy(
        allowed_domains=("localhost",), allow_private_addresses=True, allow_redirects=True
    )
    assert load_image(f"http://localhost:{port}/redirect", policy).size == (8, 6)
    assert load_image(f"http://localhost:{port}/chain/2", policy).size == (8, 6)
    _expect_refused(f"http://localhost:{port}/chain/5", policy, "more than 3 redirects")
    # A hop to a host that is not allowed is refused before it is fetched.
    before = len(hits)
    _expect_refused(f"http://localhost:{port}/to-other-host", policy, "'127.0.0.1' is not in")
    assert hits[before:] == ["/to-other-host"]


def test_oversize_bodies(server: tuple[int, list[str]]) -> None:
    port, _ = server
    _expect_refused(f"http://localhost:{port}/big-declared", LOCAL, f"is {BIG} bytes, over")
    _expect_refused(f"http://localhost:{port}/big-streamed", LOCAL, "over the 65536 byte limit")


def test_bad_responses(server: tuple[int, list[str]]) -> None:
    port, _ = server
    _expect_refused(f"http://localhost:{port}/missing.png", LOCAL, "HTTP 404")
    _expect_refused(f"http://localhost:{port}/bad.png", LOCAL, "not a PNG, JPEG, WebP or GIF")
    _expect_refused(f"http://localhost:{port}/bomb.png", LOCAL, "over the limit of")


async def test_fetch_times_out_without_blocking_the_loop(server: tuple[int, list[str]]) -> None:
    port, _ = server
    policy = MediaPolicy(
        allowed_domains=("localhost",), allow_private_addresses=True, timeout_s=0.5
    )
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.02)
            ticks += 1

    ticker = asyncio.create_task(tick())
    start = time.monotonic()
    with pytest.raises(MediaError, match=r"timed out after 0.5 s"):
        await fetch_image(f"http://localhost:{port}/slow", policy)
    elapsed = time.monotonic() - start
    ticker.cancel()
    assert 0.4 < elapsed < 2.0
    assert ticks >= 10  # the loop kept running while the fetch waited


async def test_fetch_image_in_a_loop(server: tuple[int, list[str]]) -> None:
    port, _ = server
    fetched = await fetch_image(f"http://localhost:{port}/image.png", LOCAL)
    decoded = await fetch_image(_data_url(PNG, "image/png"), LOCAL)
    assert fetched.tobytes() == decoded.tobytes()
    # The synchronous form also works from inside a running loop (it fetches in a thread).
    assert load_image(f"http://localhost:{port}/image.png", LOCAL).size == (8, 6)


# --- https: the certificate is checked against the URL's host name -----------------------


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, str, list[str]]]:
    """An https server on 127.0.0.1 with a self-signed certificate for `localhost`; records
    the SNI names clients send."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    directory = tmp_path_factory.mktemp("tls")
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    sni: list[str] = []
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_path, key_path)
    context.sni_callback = lambda _sock, server_name, _ctx: sni.append(server_name)  # type: ignore[assignment,misc,return-value]
    handler = type("Handler", (_Handler,), {"hits": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield httpd.server_address[1], str(cert_path), sni
    httpd.shutdown()
    httpd.server_close()


def test_https_checks_the_certificate_against_the_host_name(
    tls_server: tuple[int, str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    port, cert_path, sni = tls_server
    url = f"https://localhost:{port}/image.png"
    # The self-signed certificate is not trusted by default: refused.
    _expect_refused(url, LOCAL, "CERTIFICATE_VERIFY_FAILED")
    # Trusted, it matches the URL's name although the connection goes to 127.0.0.1.
    trusting = ssl.create_default_context(cafile=cert_path)
    monkeypatch.setattr(http_fetch, "_tls_context", lambda: trusting)
    assert load_image(url, LOCAL).size == (8, 6)
    assert sni and set(sni) == {"localhost"}
