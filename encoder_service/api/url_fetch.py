"""Fetching an http(s) image URL for the SGLang front end, only from ``--allow-url-fetch`` hosts.

A URL names a server for this process to connect to: left open, any caller could make the encoder
reach internal services (SSRF). So, before any connection:

- the URL's host (and port) must match an ``--allow-url-fetch`` pattern, matched as strictly as
  ``--allowed-sinks`` (encoder_service/sink_allowlist.py: label by label, octet by octet);
- the host is resolved once, and every address it resolves to must be global: a private,
  loopback, link-local, multicast or reserved address is refused unless an IP pattern of
  ``--allow-url-fetch`` names it (a host-name pattern or ``*`` never admits one, so a public name
  pointed at 127.0.0.1 gets nothing);
- the connection goes to that resolved address (the Host header and TLS name stay the URL's), so a
  second DNS answer cannot switch it to another address (DNS rebinding);
- redirects are not followed, the body is bounded by ``--max-message-bytes`` (checked against
  Content-Length first, then while reading) and the whole fetch by ``FETCH_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import http.client
import ipaddress
import socket
import ssl
import time
from urllib.parse import urlsplit

from ..errors import InvalidInput, PermissionDenied, ResourceExhausted, Unavailable
from ..sink_allowlist import SinkAllowlist, parse_target

FETCH_TIMEOUT_S = 10.0
_READ_BYTES = 1 << 20


class UrlFetcher:
    def __init__(self, patterns: tuple[str, ...], max_bytes: int, timeout_s: float = FETCH_TIMEOUT_S) -> None:
        self.allowlist = SinkAllowlist(patterns, "allow-url-fetch")
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    def __bool__(self) -> bool:
        return bool(self.allowlist)

    async def fetch(self, url: str, what: str) -> bytes:
        """The body of ``url`` (``what`` names it in errors: ``mm_items[2]``)."""
        shown = repr(url[:120])
        if not self.allowlist:
            raise PermissionDenied(f"{what}: {shown} is an http(s) URL and this encoder fetches none "
                                   "(--allow-url-fetch is empty); send the image as a data URL")
        parts = urlsplit(url)
        try:
            host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise InvalidInput(f"{what}: {shown} has an invalid port") from None
        if parts.scheme not in ("http", "https") or not host or parts.username or parts.password:
            raise InvalidInput(f"{what}: {shown} is not an http(s) URL with a host (and no user:password)")
        literal = f"[{host}]" if ":" in host else host
        target = parse_target(f"{literal}:{port}", f"{what} URL host")
        if self.allowlist.match(target) is None:
            raise PermissionDenied(f"{what}: host {literal}:{port} of {shown} is not in --allow-url-fetch")
        address = await self._resolve(host, port, what)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self._get, parts.scheme, host, address, port, path, what, shown)

    async def _resolve(self, host: str, port: int, what: str) -> str:
        try:
            infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM), self.timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            raise Unavailable(f"{what}: cannot resolve {host!r}: {exc}") from None
        addresses = []
        for info in infos:
            ip = ipaddress.ip_address(info[4][0].split("%")[0])
            mapped = getattr(ip, "ipv4_mapped", None)
            ip = mapped or ip
            if not ip.is_global and self.allowlist.match_address(ip, str(port)) is None:
                raise PermissionDenied(
                    f"{what}: {host!r} resolves to {ip}, a private, loopback, link-local or reserved "
                    "address; list that address in --allow-url-fetch to allow it")
            addresses.append(str(ip))
        if not addresses:
            raise Unavailable(f"{what}: {host!r} resolves to no address")
        return addresses[0]

    def _get(self, scheme: str, host: str, address: str, port: int, path: str, what: str, shown: str) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        conn = (_PinnedHTTPS if scheme == "https" else _PinnedHTTP)(host, address, port, self.timeout_s)
        try:
            conn.request("GET", path, headers={"User-Agent": "encoder-service", "Accept": "image/*"})
            response = conn.getresponse()
            if response.status != 200:
                raise Unavailable(f"{what}: GET {shown} answered {response.status} {response.reason} "
                                  "(redirects are not followed)")
            length = response.getheader("Content-Length")
            if length and length.isdigit() and int(length) > self.max_bytes:
                raise ResourceExhausted(f"{what}: {shown} is {length} bytes; at most {self.max_bytes} "
                                        "(--max-message-bytes)")
            body = bytearray()
            while chunk := response.read(_READ_BYTES):
                body += chunk
                if len(body) > self.max_bytes:
                    raise ResourceExhausted(f"{what}: {shown} is over {self.max_bytes} bytes (--max-message-bytes)")
                if time.monotonic() > deadline:
                    raise Unavailable(f"{what}: fetching {shown} took over {self.timeout_s:g} s")
            return bytes(body)
        except (OSError, http.client.HTTPException) as exc:
            raise Unavailable(f"{what}: fetching {shown} failed: {exc}") from None
        finally:
            conn.close()


class _PinnedHTTP(http.client.HTTPConnection):
    """Connects to the address resolved and checked before; the Host header stays the URL's."""

    def __init__(self, host: str, address: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """As _PinnedHTTP, over TLS: the certificate is checked against the URL's host name."""

    def __init__(self, host: str, address: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._address = address

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)
