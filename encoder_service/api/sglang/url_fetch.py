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
  Content-Length first, then while reading).

The whole fetch (resolving, waiting for a thread, connecting, TLS, headers, body) is bounded by
``FETCH_TIMEOUT_S`` of wall-clock time, however slowly the server sends: the caller gets
UNAVAILABLE at the bound, and the connection is shut down then, so the blocked read in the
fetching thread returns at once. Fetches run in a pool of their own (``FETCH_THREADS``), never in
the event loop's default executor; each read takes at most one ``recv`` under a socket timeout of
the time left.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import ipaddress
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from ...errors import InvalidInput, PermissionDenied, ResourceExhausted, Unavailable
from ...sink_allowlist import SinkAllowlist, parse_target

FETCH_TIMEOUT_S = 10.0
FETCH_THREADS = 8
_READ_BYTES = 1 << 16


class _Deadline:
    """One fetch's bound, shared by the event loop (which cuts it) and the fetching thread."""

    def __init__(self, timeout_s: float) -> None:
        self.at = time.monotonic() + timeout_s
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.cut = False

    def left(self) -> float:
        return self.at - time.monotonic()

    def over(self) -> bool:
        return self.cut or self.left() <= 0

    def attach(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
            cut = self.cut
        if cut:
            self._shutdown(sock)

    def bound_next_read(self) -> None:
        """The socket's timeout, the time left (the connection may have passed its socket on to the
        response: the one attached is the one read)."""
        with self._lock:
            sock = self._sock
        if sock is not None:
            sock.settimeout(max(0.001, self.left()))

    def cut_now(self) -> None:
        """Ends the fetch: a thread blocked reading the socket gets EOF or an error at once."""
        with self._lock:
            self.cut = True
            sock = self._sock
        if sock is not None:
            self._shutdown(sock)

    @staticmethod
    def _shutdown(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):  # the plain socket's, also for an SSLSocket (its own drops its SSL state)
            socket.socket.shutdown(sock, socket.SHUT_RDWR)


class UrlFetcher:
    def __init__(self, allowed: SinkAllowlist | tuple[str, ...], max_bytes: int, timeout_s: float = FETCH_TIMEOUT_S,
                 threads: int = FETCH_THREADS) -> None:
        """``allowed``: ``--allow-url-fetch`` as parsed at start-up (``ServiceConfig.url_fetch_allowlist``),
        or its patterns."""
        self.allowlist = allowed if isinstance(allowed, SinkAllowlist) else SinkAllowlist(allowed, "allow-url-fetch")
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="url-fetch")

    def __bool__(self) -> bool:
        return bool(self.allowlist)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

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
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        deadline = _Deadline(self.timeout_s)
        try:
            return await asyncio.wait_for(self._fetch(deadline, parts.scheme, host, port, path, what, shown),
                                          self.timeout_s)
        except asyncio.TimeoutError:
            raise Unavailable(f"{what}: fetching {shown} took over {self.timeout_s:g} s") from None
        finally:
            deadline.cut_now()  # a fetch still running past its bound stops now; a finished one has no socket

    async def _fetch(self, deadline: _Deadline, scheme: str, host: str, port: int, path: str, what: str,
                     shown: str) -> bytes:
        address = await self._resolve(host, port, what)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._get, deadline, scheme, host, address, port, path,
                                          what, shown)

    async def _resolve(self, host: str, port: int, what: str) -> str:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.run_in_executor(self._pool, socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)
        except OSError as exc:
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

    def _get(self, deadline: _Deadline, scheme: str, host: str, address: str, port: int, path: str, what: str,
             shown: str) -> bytes:
        late = Unavailable(f"{what}: fetching {shown} took over {self.timeout_s:g} s")
        if deadline.over():  # waited for a thread past the bound
            raise late
        conn = (_PinnedHTTPS if scheme == "https" else _PinnedHTTP)(host, address, port, deadline)
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
            while True:
                if deadline.over():
                    raise late
                deadline.bound_next_read()
                chunk = response.read1(_READ_BYTES)  # one recv at most
                if not chunk:
                    break
                body += chunk
                if len(body) > self.max_bytes:
                    raise ResourceExhausted(f"{what}: {shown} is over {self.max_bytes} bytes (--max-message-bytes)")
            return bytes(body)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if deadline.over():
                raise late from None
            raise Unavailable(f"{what}: fetching {shown} failed: {exc}") from None
        finally:
            conn.close()


class _PinnedHTTP(http.client.HTTPConnection):
    """Connects to the address resolved and checked before; the Host header stays the URL's. The
    socket is handed to the fetch's deadline as soon as it exists, so a cut reaches every step."""

    def __init__(self, host: str, address: str, port: int, deadline: _Deadline) -> None:
        super().__init__(host, port, timeout=max(0.001, deadline.left()))
        self._address = address
        self._deadline = deadline

    def _open(self) -> socket.socket:
        sock = socket.create_connection((self._address, self.port), max(0.001, self._deadline.left()))
        self._deadline.attach(sock)
        return sock

    def connect(self) -> None:
        self.sock = self._open()


class _PinnedHTTPS(_PinnedHTTP, http.client.HTTPSConnection):
    """As _PinnedHTTP, over TLS: the certificate is checked against the URL's host name."""

    def __init__(self, host: str, address: str, port: int, deadline: _Deadline) -> None:
        http.client.HTTPSConnection.__init__(self, host, port, timeout=max(0.001, deadline.left()),
                                             context=ssl.create_default_context())
        self._address = address
        self._deadline = deadline

    def connect(self) -> None:
        sock = self._context.wrap_socket(self._open(), server_hostname=self.host, do_handshake_on_connect=False)
        self._deadline.attach(sock)  # the wrapped socket owns the descriptor now
        sock.do_handshake()
        self.sock = sock
