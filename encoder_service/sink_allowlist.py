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

A host name whose last label is all digits is refused outright: no top-level domain is numeric, and
resolvers read ``2130706433`` or ``127.1`` as addresses, which would slip past the IP patterns.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import InvalidInput

_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")
_IPV4_GLOB = re.compile(r"^[0-9*?\[\]!-]+(?:\.[0-9*?\[\]!-]+){3}$")
_PORT_GLOB = re.compile(r"^[0-9*?\[\]!-]+$")


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
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInput(f"{what} {shown} must be host:port (no scheme, no path), port 1..65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            return SinkTarget(target, port, ip=ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            raise InvalidInput(f"{what} {shown}: {host} is not an IPv6 address") from None
    try:
        return SinkTarget(target, port, ip=ipaddress.IPv4Address(host))
    except ValueError:
        pass
    labels = tuple(host.lower().split("."))
    if not all(_LABEL.match(label) for label in labels):
        raise InvalidInput(f"{what} {shown}: {host[:200]!r} is neither an IP address nor a host name")
    if labels[-1].isdigit():
        raise InvalidInput(f"{what} {shown}: {host!r} is not a canonical IP address (write it as "
                           "a.b.c.d) and not a host name (its last label is numeric)")
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
    if not sep or not host or not _PORT_GLOB.match(port):
        raise ValueError(f"{option} pattern {text!r} must be host:port (globs allowed, no scheme or path)")
    if host == "*":
        return _Pattern(text, port, "any")
    if host.startswith("[") and host.endswith("]"):
        try:
            return _Pattern(text, port, "ipv6", ipv6=ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            raise ValueError(f"{option} pattern {text!r}: {host} is not an IPv6 address "
                             "(IPv6 patterns take no globs)") from None
    if _IPV4_GLOB.match(host):
        return _Pattern(text, port, "ipv4", parts=tuple(host.split(".")))
    labels = tuple(host.lower().split("."))
    if any(not label or "/" in label for label in labels):
        raise ValueError(f"{option} pattern {text!r}: empty label or a path in the host")
    if labels[-1].isdigit() or all(_PORT_GLOB.match(label) for label in labels):
        raise ValueError(f"{option} pattern {text!r}: an IP pattern needs four octets (a.b.c.*)")
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
