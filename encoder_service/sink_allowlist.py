"""Which EmbeddingSink targets a request may name: ``--allowed-sinks`` patterns, matched strictly.

A plain glob over the whole ``host:port`` string is a bypass: ``10.0.0.*:9000`` would accept
``10.0.0.1.attacker.example:9000`` and ``prefill-*.svc:9000`` would accept
``prefill-x.evil.example.svc:9000``, since ``*`` crosses dots. So a pattern is taken apart first:

- an **IPv4 pattern** (four dot-separated globs of digits, e.g. ``10.0.0.*``) matches only a target
  whose host is an IPv4 literal, octet by octet;
- an **IPv6 pattern** (``[fd00::1]``) matches only that IPv6 literal, compared as addresses;
- a **host-name pattern** matches only a host name with the same number of labels, label by label
  (``*`` stays inside one label); ``*`` alone matches any host, names and addresses alike;
- the port is a glob over the target's port number (``*`` = any port).

A host name whose last label looks like a number (decimal digits, or ``0x`` and hex digits) is refused
outright: no top-level domain is numeric, and resolvers (``inet_aton``, getaddrinfo) read
``2130706433``, ``127.1``, ``0x7f000001``, ``0177.1`` or ``127.0.0.0x1`` as addresses, which would
slip past the IP patterns; whatever ``inet_aton`` accepts is refused too, whatever its form. Every
regex here must match the whole text (``fullmatch``: ``$`` would let a trailing newline through),
and a port is ASCII decimal digits without a leading zero, 1..65535.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import InvalidInput

# All matched with fullmatch, and ASCII only: str.isdigit() also takes "²" and "٩".
_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?", re.ASCII)
_LABEL_GLOB = re.compile(r"[a-z0-9_*?\[\]!-]{1,63}", re.ASCII)
_NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*", re.ASCII | re.IGNORECASE)  # what inet_aton reads as a number
_IPV4_GLOB = re.compile(r"[0-9*?\[\]!-]+(?:\.[0-9*?\[\]!-]+){3}", re.ASCII)
_PORT = re.compile(r"[1-9][0-9]{0,4}", re.ASCII)
_PORT_GLOB = re.compile(r"[0-9*?\[\]!-]+", re.ASCII)


def reads_as_address(host: str) -> bool:
    """Whether a resolver would read ``host`` as an IPv4 address: its last label looks like a
    number (decimal, octal or hex: ``127.1``, ``0x7f000001``, ``127.0.0.0x1``), or the C library's
    ``inet_aton`` (which getaddrinfo uses for numeric hosts) accepts it."""
    if _NUMERIC_LABEL.fullmatch(host.rpartition(".")[2]):
        return True
    try:
        socket.inet_aton(host)
    except (OSError, ValueError):  # ValueError: an embedded NUL
        return False
    return True


@dataclass(frozen=True)
class SinkTarget:
    """A parsed ``host:port``: exactly one of ``ip`` and ``labels`` is set."""

    text: str
    port: str
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = None
    labels: tuple[str, ...] = ()


def parse_target(target: str, what: str = "sink.target") -> SinkTarget:
    """``host:port`` (a host name, an IPv4 literal or ``[IPv6]``) or InvalidInput saying why not;
    ``what`` names the target in the message."""
    shown = repr(target[:200])
    host, sep, port = target.rpartition(":")
    if not sep or not host or not _PORT.fullmatch(port) or int(port) > 65535:
        raise InvalidInput(f"{what} {shown} must be host:port (no scheme, no path), port 1..65535 "
                           "in ASCII digits")
    if host.startswith("[") and host.endswith("]"):
        try:
            if "%" in host:  # a scope names an interface of this host: not a sink's address
                raise ValueError
            return SinkTarget(target, port, ip=ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            raise InvalidInput(f"{what} {shown}: {host!r} is not an IPv6 address") from None
    try:
        return SinkTarget(target, port, ip=ipaddress.IPv4Address(host))
    except ValueError:
        pass
    labels = tuple(host.lower().split("."))
    if not all(_LABEL.fullmatch(label) for label in labels):
        raise InvalidInput(f"{what} {shown}: {host[:200]!r} is neither an IP address nor a host name")
    if reads_as_address(host):
        raise InvalidInput(f"{what} {shown}: {host!r} is not a canonical IP address (write it as "
                           "a.b.c.d) and not a host name (resolvers read it as a number)")
    return SinkTarget(target, port, labels=labels)


@dataclass(frozen=True)
class _Pattern:
    text: str
    port: str
    kind: str  # "any", "ipv4", "ipv6", "name"
    parts: tuple[str, ...] = ()
    ipv6: ipaddress.IPv6Address | None = None

    def matches(self, t: SinkTarget) -> bool:
        if not fnmatch.fnmatchcase(t.port, self.port):
            return False
        if self.kind == "any":
            return True
        if self.kind == "ipv4":
            return isinstance(t.ip, ipaddress.IPv4Address) and all(
                fnmatch.fnmatchcase(octet, glob) for octet, glob in zip(str(t.ip).split("."), self.parts))
        if self.kind == "ipv6":
            return t.ip == self.ipv6
        return t.ip is None and len(t.labels) == len(self.parts) and all(
            fnmatch.fnmatchcase(label, glob) for label, glob in zip(t.labels, self.parts))


def _parse_pattern(text: str, option: str = "allowed-sinks") -> _Pattern:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not _PORT_GLOB.fullmatch(port):
        raise ValueError(f"{option} pattern {text!r} must be host:port (globs allowed, no scheme or path)")
    if host == "*":
        return _Pattern(text, port, "any")
    if host.startswith("[") and host.endswith("]"):
        try:
            return _Pattern(text, port, "ipv6", ipv6=ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            raise ValueError(f"{option} pattern {text!r}: {host} is not an IPv6 address "
                             "(IPv6 patterns take no globs)") from None
    if _IPV4_GLOB.fullmatch(host):
        return _Pattern(text, port, "ipv4", parts=tuple(host.split(".")))
    labels = tuple(host.lower().split("."))
    if not all(_LABEL_GLOB.fullmatch(label) for label in labels):
        raise ValueError(f"{option} pattern {text!r}: an empty label, a path or a character no host "
                         "name has (letters, digits, '-', '_' and the globs * ? [ ] ! only)")
    if reads_as_address(host) or all(_PORT_GLOB.fullmatch(label) for label in labels):
        raise ValueError(f"{option} pattern {text!r}: an IP pattern needs four octets (a.b.c.*), and "
                         "no host name ends in a numeric label")
    return _Pattern(text, port, "name", parts=labels)


class SinkAllowlist:
    """``match(target)``: the pattern that admits a target, or None. Patterns are checked at start-up."""

    def __init__(self, patterns: Iterable[str], option: str = "allowed-sinks") -> None:
        self._patterns = tuple(_parse_pattern(p, option) for p in patterns if p.strip())

    def __bool__(self) -> bool:
        return bool(self._patterns)

    def match(self, target: SinkTarget) -> str | None:
        for pattern in self._patterns:
            if pattern.matches(target):
                return pattern.text
        return None

    def match_address(self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: str) -> str | None:
        """The IP pattern that names this address (``*`` and host-name patterns do not count): an
        address the operator listed explicitly."""
        target = SinkTarget(str(ip), port, ip=ip)
        for pattern in self._patterns:
            if pattern.kind in ("ipv4", "ipv6") and pattern.matches(target):
                return pattern.text
        return None
