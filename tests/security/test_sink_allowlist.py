"""--allowed-sinks: IP patterns match only IP literals, host patterns label by label, nothing slips
through a glob that crosses dots or a resolver that reads numbers as addresses."""

from __future__ import annotations

import numpy as np
import pytest

from encoder_service.config_flags import parse_serve_args
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


# --- what the strict parser refuses (each once slipped through) ---------------------------------------


@pytest.mark.parametrize("target", [
    "evil\n.svc:9000",  # a trailing newline satisfied a label regex ending in $
    "prefill-0.svc\n:9000", "prefill-0.svc:9000\n",
    "0x7f000001:9000", "127.0.0.0x1:9000", "0x7f.1:9000", "0X7F.0.0.1:9000", "0x7f.0.0.0x1:9000",
    "0177.1:9000", "127.0.0.01:9000",  # hex, octal and mixed forms: inet_aton reads each as 127.0.0.1
    "a.b.0x1:9000", "x.0x:9000",  # no top-level domain looks like a number, hex included
])
def test_host_names_that_are_addresses_in_disguise_or_carry_a_newline_are_refused(target):
    with pytest.raises(InvalidInput, match=r"sink\.target"):
        parse_target(target)
    assert allowed_or_refused(target, ("*.svc:9000", "*:9000")) is None


@pytest.mark.parametrize("port", ["²", "٩٠٠٠", "9000\n", "09000", "+9000", " 9000", "9_000", "65536", "0"])
def test_a_port_must_be_ascii_decimal_digits_in_range(port):
    with pytest.raises(InvalidInput, match=r"sink\.target .*port 1\.\.65535"):
        parse_target(f"prefill-0.svc:{port}")


def test_names_that_only_look_numeric_inside_stay_host_names():
    for target in ("0x7f000001.svc:9000", "prefill-0x1.svc:9000", "1.svc:9000", "a1b2.c3d4.example:1"):
        assert parse_target(target).labels, target


@pytest.mark.parametrize("bad", ["*.0x1:9000", "prefill-*.svc\n:9000", "prefill-*.s vc:9000", "x:9000\n1",
                                 "*:²", "x.svc:９０００"])
def test_patterns_are_held_to_the_same_rules_at_start_up(bad):
    with pytest.raises(ValueError, match="allowed-sinks pattern"):
        SinkAllowlist([bad])


def allowed_or_refused(target: str, patterns) -> str | None:
    try:
        return SinkAllowlist(patterns).match(parse_target(target))
    except InvalidInput:
        return None


def test_the_url_fetcher_refuses_hosts_in_disguise_before_resolving_them():
    import asyncio

    from encoder_service.api.sglang.url_fetch import UrlFetcher

    fetcher = UrlFetcher(("*:*",), 1 << 20)
    for url in ("http://0x7f000001/x.png", "http://127.0.0.0x1:8080/x.png", "http://0177.1/x.png"):
        with pytest.raises(InvalidInput, match="URL host"):
            asyncio.run(fetcher.fetch(url, "mm_items[0]"))


# --- against a real server: refused as INVALID_ARGUMENT, named, before anything is dialled --------------


@pytest.fixture(scope="module")
def strict_server(start_encoder_server):
    server = start_encoder_server("--allowed-sinks", "*.svc:9000,*:9001", "--sink-timeout-s", "1")
    yield server
    server.stop()


@pytest.mark.parametrize("target", ["evil\n.svc:9000", "0x7f000001:9001", "127.0.0.0x1:9001", "0177.1:9001",
                                    "prefill-0.svc:²", "prefill-0.svc:９０００"])
def test_the_server_refuses_such_targets_with_invalid_argument_naming_them(strict_server, target):
    import grpc
    from encoder_client import EncoderClient, EncoderClientError

    patches = np.random.default_rng(0).standard_normal((64, 1176), dtype=np.float32)
    with EncoderClient(strict_server.target, retries=0) as client, pytest.raises(EncoderClientError) as exc:
        client.encode_to_sink([(patches, (1, 8, 8))], target, sink_request_id="r")
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT, exc.value.details
    assert repr(target) in exc.value.details
    assert "Traceback" not in strict_server.log_text()
