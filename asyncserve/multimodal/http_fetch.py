"""Fetching an http(s) media URL under a MediaPolicy, without reaching internal services.

Every hop: the URL's host must be an allowed domain; the host is resolved once here and every
address it resolves to must be public, and the connection goes to one of those checked
addresses (the URL is rewritten to the address; Host and TLS SNI keep the name, so there is
no second lookup that DNS rebinding could answer differently). Redirects are refused unless
the policy allows them, and then each one is checked as a new URL. The body is read up to
max_bytes and the whole fetch is bounded by timeout_s.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import ssl
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import httpx

from asyncserve.multimodal.policy import MediaError, MediaPolicy, normalize_host

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def short_url(url: str, limit: int = 120) -> str:
    """A URL as error messages name it (data: payloads and long URLs cut)."""
    if url[:5].lower() == "data:":
        return url[: url.find(",") + 1] + "..." if "," in url[:100] else "data: URL"
    return url if len(url) <= limit else url[:limit] + "..."


def address_refusal(ip: IPAddress) -> str | None:
    """Why `ip` must not be connected to (a phrase), or None for a public address."""
    if isinstance(ip, ipaddress.IPv6Address):
        # IPv4 addresses carried inside IPv6 ones reach the IPv4 host.
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            reason = address_refusal(embedded)
            if reason is not None:
                return reason
    checks = (
        ("an unspecified", ip.is_unspecified),
        ("a loopback", ip.is_loopback),
        ("a link-local", ip.is_link_local),
        ("a multicast", ip.is_multicast),
        ("a private", ip.is_private),
        ("a reserved", ip.is_reserved),
        ("a non-public", not ip.is_global),
    )
    for name, hit in checks:
        if hit:
            return f"{name} address"
    return None


@dataclass(frozen=True)
class _Target:
    """One hop's URL, taken apart: where to connect and what to ask for."""

    url: str
    scheme: str
    host: str  # normalized (lower case, IDNA)
    port: int
    host_header: str
    path_query: str

    def url_for(self, ip: IPAddress) -> str:
        literal = f"[{ip}]" if ip.version == 6 else str(ip)
        return f"{self.scheme}://{literal}:{self.port}{self.path_query}"


def check_url(url: str, policy: MediaPolicy) -> _Target:
    """The URL's scheme, credentials and host checked against the policy (no network)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise MediaError(f"media URL {short_url(url)} is not valid: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise MediaError(
            f"media URL scheme {scheme + ':' if scheme else '(none)'} is not accepted "
            "(only data:, http: and https:)"
        )
    if parts.username is not None or parts.password is not None:
        raise MediaError(f"media URL {short_url(url)} has credentials; they are not accepted")
    if not parts.hostname:
        raise MediaError(f"media URL {short_url(url)} has no host")
    host = normalize_host(parts.hostname)
    if not policy.allowed_domains:
        raise MediaError(
            f"media URL host {host!r} is not allowed: http(s) media URLs need "
            "--allowed-media-domains to list their host"
        )
    if not policy.host_allowed(host):
        raise MediaError(f"media URL host {host!r} is not in --allowed-media-domains")
    default_port = _DEFAULT_PORTS[scheme]
    host_header = f"[{host}]" if ":" in host else host
    if port is not None and port != default_port:
        host_header += f":{port}"
    path_query = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Target(url, scheme, host, port or default_port, host_header, path_query)


async def _resolve(target: _Target, policy: MediaPolicy) -> list[IPAddress]:
    """The host's addresses, every one of them public (unless the policy allows private)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise MediaError(f"media URL host {target.host!r} does not resolve: {exc}") from None
    addresses: list[IPAddress] = []
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if ip not in addresses:
            addresses.append(ip)
    if not policy.allow_private_addresses:
        for ip in addresses:
            reason = address_refusal(ip)
            if reason is not None:
                raise MediaError(
                    f"media URL host {target.host!r} resolves to {ip}, {reason}: refused"
                )
    if not addresses:
        raise MediaError(f"media URL host {target.host!r} has no address")
    return addresses


@functools.cache
def _tls_context() -> ssl.SSLContext:
    # The certificate is checked against the URL's host name (the SNI set per request).
    import certifi

    return ssl.create_default_context(cafile=certifi.where())


async def _send(
    client: httpx.AsyncClient, target: _Target, addresses: list[IPAddress]
) -> httpx.Response:
    """The response (streaming, body unread) from the first checked address that connects."""
    headers = {"Host": target.host_header, "Accept": "image/*", "Accept-Encoding": "identity"}
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    last: Exception | None = None
    for ip in addresses:
        request = client.build_request(
            "GET", target.url_for(ip), headers=headers, extensions=extensions
        )
        try:
            return await client.send(request, stream=True)
        except httpx.ConnectError as exc:
            last = exc
    raise MediaError(f"cannot connect to media URL host {target.host!r}: {last}")


async def _read_body(response: httpx.Response, url: str, policy: MediaPolicy) -> bytes:
    length = response.headers.get("content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise MediaError(f"{short_url(url)}: bad Content-Length {length!r}") from None
        if declared > policy.max_bytes:
            raise MediaError(
                f"{short_url(url)} is {declared} bytes, over the {policy.max_bytes} byte limit"
            )
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise MediaError(f"{short_url(url)} came {encoding}-encoded; only plain bodies are read")
    chunks: list[bytes] = []
    total = 0
    async for chunk in response.aiter_raw():
        total += len(chunk)
        if total > policy.max_bytes:
            raise MediaError(f"{short_url(url)} is over the {policy.max_bytes} byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


async def _fetch(url: str, policy: MediaPolicy) -> bytes:
    async with httpx.AsyncClient(
        verify=_tls_context(), trust_env=False, follow_redirects=False, timeout=policy.timeout_s
    ) as client:
        for _ in range(policy.max_redirects + 1):
            target = check_url(url, policy)
            addresses = await _resolve(target, policy)
            response = await _send(client, target, addresses)
            try:
                status = response.status_code
                if status in _REDIRECT_STATUSES:
                    location = response.headers.get("location")
                    if not policy.allow_redirects:
                        raise MediaError(
                            f"{short_url(url)} redirects (HTTP {status}); redirects are "
                            "not followed"
                        )
                    if not location:
                        raise MediaError(f"{short_url(url)}: HTTP {status} without a Location")
                    url = urljoin(url, location)
                    continue
                if status != 200:
                    raise MediaError(f"fetching {short_url(url)} failed: HTTP {status}")
                return await _read_body(response, url, policy)
            finally:
                await response.aclose()
    raise MediaError(f"{short_url(url)}: more than {policy.max_redirects} redirects")


async def fetch_bytes(url: str, policy: MediaPolicy) -> bytes:
    """The body of an http(s) URL the policy allows; MediaError for anything refused or failed."""
    check_url(url, policy)  # refuse before any lookup or timer
    try:
        async with asyncio.timeout(policy.timeout_s):
            return await _fetch(url, policy)
    except (TimeoutError, httpx.TimeoutException):
        raise MediaError(
            f"fetching {short_url(url)} timed out after {policy.timeout_s:g} s"
        ) from None
    except httpx.HTTPError as exc:
        raise MediaError(f"fetching {short_url(url)} failed: {exc}") from None
