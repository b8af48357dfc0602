"""The client's security helpers, without a server: credentials from files, token metadata, and
the routing client's TLS name for addresses it resolved itself."""

from __future__ import annotations

import grpc
import pytest
from encoder_client import RoutingEncoderClient, read_token_file, tls_credentials
from encoder_client.security import call_metadata


def test_token_becomes_a_bearer_authorization_entry_after_the_callers_metadata():
    assert call_metadata([("x-request-source", "prefill")], "s3cret") == (
        ("x-request-source", "prefill"), ("authorization", "Bearer s3cret"))
    assert call_metadata(None, None) is None


@pytest.mark.parametrize("metadata, token, message", [
    (None, "", "token must be non-empty"),
    (None, "two words", "hold no white space"),
    ([("Authorization", "Bearer x")], "y", "either token= or an authorization entry"),
])
def test_bad_tokens_are_refused_before_any_call(metadata, token, message):
    with pytest.raises(ValueError, match=message):
        call_metadata(metadata, token)


def test_credential_files_that_cannot_be_used_are_named(tmp_path):
    missing, garbage = tmp_path / "missing.crt", tmp_path / "garbage.crt"
    garbage.write_text("not a certificate")
    with pytest.raises(ValueError, match=f"CA {missing}: cannot read it"):
        tls_credentials(ca=missing)
    with pytest.raises(ValueError, match=f"certificate {garbage}: not PEM"):
        tls_credentials(cert=garbage, key=garbage)
    with pytest.raises(ValueError, match="cert and key go together"):
        tls_credentials(cert=garbage)
    assert isinstance(tls_credentials(), grpc.ChannelCredentials)  # the system's roots


def test_read_token_file_skips_comments_and_blank_lines(tmp_path):
    path = tmp_path / "token"
    path.write_text("# for the prefill servers\n\n  abc123  \nsecond\n")
    assert read_token_file(path) == "abc123"
    path.write_text("# none yet\n")
    with pytest.raises(ValueError, match="holds no token"):
        read_token_file(path)


def test_routing_checks_a_resolved_address_against_the_dns_name_it_came_from():
    creds = tls_credentials()
    with RoutingEncoderClient("dns:///localhost:50999", credentials=creds, token="t") as routing:
        (target, *_) = routing.targets
        kwargs = routing._target_kwargs(target)
        assert ("grpc.ssl_target_name_override", "localhost") in kwargs["channel_options"]
        assert kwargs["credentials"] is creds and kwargs["token"] == "t"
    with RoutingEncoderClient(["127.0.0.1:50999"], credentials=creds) as routing:
        assert "channel_options" not in routing._target_kwargs("127.0.0.1:50999")  # dialled as given
