"""Bearer-token auth against a real server process (mutual TLS too, as deployed), the clients'
``token=``/``credentials=`` (sync, asyncio, routing) and the encoder-client CLI's security flags."""

from __future__ import annotations

import asyncio

import client_servers
import grpc
import pytest
from certs import make_ca
from encoder_client import AsyncEncoderClient, EncoderClient, EncoderClientError, RoutingEncoderClient, tls_credentials
from encoder_client.cli import main as client_main
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

TOKENS = "# encoder-service callers\n\nprefill-token-1\n  decode-token-2  \n"


def png(seed: int) -> bytes:
    return client_servers.png(seed, (56, 56), solid=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    ca = make_ca(tmp_path_factory.mktemp("pki"), "auth")
    return ca, ca.issue("server", server=True), ca.issue("client")


@pytest.fixture(scope="module")
def creds(pki):
    ca, _, client = pki
    return tls_credentials(ca=ca.cert, cert=client.cert, key=client.key)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens") / "tokens"
    path.write_text(TOKENS)
    return path


@pytest.fixture(scope="module")
def server(start_encoder_server, pki, token_file):
    ca, server_pair, _ = pki
    return start_encoder_server("--tls-cert", str(server_pair.cert), "--tls-key", str(server_pair.key),
                                "--tls-client-ca", str(ca.cert), "--auth-token-file", str(token_file),
                                "--health-port", "0")


def call_error(target: str, creds, **kwargs) -> EncoderClientError:
    with pytest.raises(EncoderClientError) as info, EncoderClient(target, credentials=creds, timeout_s=10,
                                                                  retries=0, **kwargs) as client:
        client.encode([png(0)])
    return info.value


def test_a_call_without_a_token_is_unauthenticated(server, creds):
    err = call_error(server.target, creds)
    assert err.code == grpc.StatusCode.UNAUTHENTICATED and "authorization: Bearer <token>" in err.details
    with EncoderClient(server.target, credentials=creds, timeout_s=10, retries=0) as client:
        for call in (client.model_info, lambda: client.lookup(["0" * 64])):
            with pytest.raises(EncoderClientError) as info:
                call()
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert server.metric("encoder_service_requests_total", 'code="UNAUTHENTICATED",method="Encode"') >= 1


def test_a_header_that_is_not_a_bearer_token_is_unauthenticated(server, creds):
    err = call_error(server.target, creds, metadata=[("authorization", "Basic cHJlZmlsbDp4")])
    assert err.code == grpc.StatusCode.UNAUTHENTICATED


def test_a_wrong_token_is_permission_denied_and_not_logged(server, creds):
    err = call_error(server.target, creds, token="prefill-token-")
    assert err.code == grpc.StatusCode.PERMISSION_DENIED and "not accepted" in err.details
    assert "prefill-token-" not in server.log_text()


def test_every_token_of_the_file_is_served(server, creds):
    for i, token in enumerate(("prefill-token-1", "decode-token-2")):
        with EncoderClient(server.target, credentials=creds, token=token, timeout_s=10, retries=0) as client:
            (result,) = client.encode([png(10 + i)])
            assert result.embedding.shape[1] == client.model_info().hidden_size
            assert client.lookup([result.content_hash]) == [True]


def test_health_and_reflection_stay_open_without_a_token(server, creds):
    with EncoderClient(server.target, credentials=creds, timeout_s=10, retries=0) as client:
        assert client.health() == "SERVING"
    with grpc.secure_channel(server.target, creds) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        (reply,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                             timeout=10)
        assert "encoder.v1.VisionEncoder" in {s.name for s in reply.list_services_response.service}
    with EncoderClient(server.health_target, timeout_s=10, retries=0) as client:
        assert client.health() == "SERVING"


def test_the_token_file_is_re_read_when_it_changes(server, creds, token_file):
    try:
        token_file.write_text(TOKENS + "new-token-3\n")
        with EncoderClient(server.target, credentials=creds, token="new-token-3", timeout_s=10, retries=0) as c:
            assert c.model_info().hidden_size > 0
        token_file.write_text("decode-token-2\n")  # revoked: prefill-token-1 and new-token-3
        assert call_error(server.target, creds, token="prefill-token-1").code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        token_file.write_text(TOKENS)
    assert "re-read" in server.log_text()


def test_the_asyncio_client_sends_its_token(server, creds):
    async def run():
        async with AsyncEncoderClient(server.target, credentials=creds, token="decode-token-2", timeout_s=10,
                                      retries=0) as client:
            return (await client.encode([png(20)]))[0].num_tokens, await client.health()

    assert asyncio.run(run()) == (4, "SERVING")


def test_the_routing_client_uses_credentials_and_token_for_health_lookup_and_encode(server, creds):
    with RoutingEncoderClient([server.target], credentials=creds, token="prefill-token-1", timeout_s=10) as routing:
        assert routing.healthy_targets() == [server.target]
        first = routing.encode([png(30), png(31)])  # hash-first: Lookup, then Encode of the misses
        again = routing.encode([png(30), png(31)])
        assert [r.cache_hit for r in again] == [True, True]
        assert [r.content_hash for r in again] == [r.content_hash for r in first]
    with RoutingEncoderClient([server.target], credentials=creds, timeout_s=10) as no_token:
        with pytest.raises(EncoderClientError) as info:
            no_token.encode([png(30)])
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_the_cli_encodes_over_mutual_tls_with_a_token_file(server, pki, token_file, tmp_path, capsys, monkeypatch):
    ca, _, client = pki
    image = tmp_path / "cat.png"
    image.write_bytes(png(40))
    tls = ["--tls-ca", str(ca.cert), "--tls-cert", str(client.cert), "--tls-key", str(client.key)]
    assert client_main(["encode", "--target", server.target, str(image), *tls, "--token-file", str(token_file)]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[0] == str(image) and row[1] == "4"

    assert client_main(["info", "--target", server.target, *tls]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err

    # The same from the environment, as a container would set it.
    for name, value in {"TLS_CA": ca.cert, "TLS_CERT": client.cert, "TLS_KEY": client.key,
                        "TOKEN_FILE": token_file}.items():
        monkeypatch.setenv(f"ENCODER_CLIENT_{name}", str(value))
    assert client_main(["info", "--target", server.target]) == 0
    assert "hidden_size: 48" in capsys.readouterr().out


def test_the_cli_names_an_unusable_security_file(server, tmp_path, capsys):
    missing = tmp_path / "nope.crt"
    assert client_main(["info", "--target", server.target, "--tls-ca", str(missing)]) == 1
    assert f"CA {missing}: cannot read it" in capsys.readouterr().err


def test_a_token_file_without_tokens_stops_the_start(tmp_path):
    from encoder_service.api.security.auth import TokenFile, TokenFileError

    empty = tmp_path / "tokens"
    empty.write_text("# nobody yet\n\n")
    with pytest.raises(TokenFileError, match=f"auth-token-file {empty}: holds no token"):
        TokenFile(str(empty))
    with pytest.raises(TokenFileError, match="cannot read it"):
        TokenFile(str(tmp_path / "missing"))
