"""--allowed-sinks: IP patterns match only IP literals, host patterns label by label, nothing slips
through a glob that crosses dots or a resolver that reads numbers as addresses."""

from __future__ import annotations

import pytest

from encoder_service.config import parse_serve_args
from encoder_service.errors import InvalidInput
from encoder_service.sink_allowlist import SinkAllowlist, parse_target

README_PATTERNS = ("prefill-*.svc:9000", "10.0.0.*:9000")


def allowed(target: str, patterns=README_PATTERNS) -> str | None:
    return SinkAllowlist(patterns).match(parse_target(target))


@pytest.mark.parametrize("target", ["prefill-0.svc:9000", "prefill-abc.svc:9000", "PREFILL-1.SVC:9000",
                                    "10.0.0.1:9000", "10.0.0.254:9000"])
def test_targets_the_patterns_mean_are_allowed(target):
    assert allowed(target) in README_PATTERNS


@pytest.mark.parametrize("target", [
    "10.0.0.1.attacker.example:9000",  # an IP pattern never matches a host name
    "prefill-x.evil.example.svc:9000",  # * stays inside one label
    "prefill-.svc:9000",  # no label may end with a hyphen: not a host name at all (refused below)
    "10.0.0.1:9001", "10.0.1.1:9000", "prefill-0.svc.evil:9000", "x.prefill-0.svc:9000",
])
def test_bypasses_are_not_allowed(target):
    try:
        match = allowed(target)
    except InvalidInput:  # refused as malformed: not allowed either
        match = None
    assert match is None


@pytest.mark.parametrize("target", ["2130706433:9000", "127.1:9000", "0x7f.0.0.1:9000", "010.0.0.1:9000",
                                    "10.0.0.1.:9000", "host:0", "host:99999", "host", ":9000", "a b:1",
                                    "dns:///x:9000", "x:9000/path", "[zz::1]:9000", "unix:/tmp/s"])
def test_targets_a_resolver_would_read_differently_are_refused(target):
    with pytest.raises(InvalidInput, match=r"sink\.target"):
        parse_target(target)


def test_ipv6_patterns_compare_addresses_and_star_host_matches_everything():
    assert allowed("[fd00:0:0::1]:9000", ("[fd00::1]:9000",)) == "[fd00::1]:9000"
    assert allowed("[fd00::2]:9000", ("[fd00::1]:9000",)) is None
    assert allowed("[fd00::1]:9000", ("10.0.0.*:9000",)) is None
    for target in ("10.1.2.3:7", "a.b.c:7", "[::1]:7"):
        assert allowed(target, ("*:7",)) == "*:7"
        assert allowed(target, ("*:8",)) is None


def test_bad_patterns_fail_at_start_up_with_the_pattern_named():
    for bad in ("10.0.*:9000", "prefill-*.svc", "http://x:9000", "[fd00::*]:9000", "x:abc"):
        with pytest.raises(ValueError, match="allowed-sinks pattern"):
            parse_serve_args(["--allowed-sinks", bad])
