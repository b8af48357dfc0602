"""TLS and mutual TLS on the gRPC port, certificate rotation without a restart, the plaintext
health-only port: real server processes, real certificates made with openssl in the test."""

from __future__ import annotations

import re
import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import client_servers
import grpc
import pytest
from certs import make_ca
from encoder_client import EncoderClient, EncoderClientError, tls_credentials
from repo_paths import REPO_ROOT

from encoder_service.api.security.settings import build_security
from encoder_service.api.security.tls import TLSFileError
from encoder_service.config_flags import parse_serve_args


def png(seed: int) -> bytes:
    return client_servers.png(seed, (56, 56), solid=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """CA "a" (the server's and its clients'), CA "b" (unrelated: the wrong client, the rotation)."""
    root = tmp_path_factory.mktemp("pki")
    a, b = make_ca(root / "a", "a"), make_ca(root / "b", "b")
    return {"a": a, "b": b, "a_server": a.issue("server", server=True), "a_client": a.issue("client"),
            "b_server": b.issue("server", server=True), "b_client": b.issue("client")}


def encode_one(target: str, seed: int = 0, **kwargs) -> tuple[int, ...]:
    with EncoderClient(target, timeout_s=10, retries=0, **kwargs) as client:
        return client.encode([png(seed)])[0].embedding.shape


def refused(target: str, **kwargs) -> EncoderClientError:
    with pytest.raises(EncoderClientError) as info, EncoderClient(target, timeout_s=5, retries=0, **kwargs) as c:
        c.model_info()
    return info.value


# TLS ends in the process that owns the port: this one, or each relay of --grpc-processes.
@pytest.fixture(scope="module", params=[(), ("--grpc-processes", "1")], ids=["in-process", "grpc-processes"])
def port_owner(request) -> tuple[str, ...]:
    return request.param


@pytest.fixture(scope="module")
def tls_server(start_encoder_server, pki, port_owner):
    return start_encoder_server("--tls-cert", str(pki["a_server"].cert), "--tls-key", str(pki["a_server"].key),
                                "--health-port", "0", *port_owner)


@pytest.fixture(scope="module")
def mtls_server(start_encoder_server, pki, port_owner):
    server = pki["a_server"]
    return start_encoder_server("--tls-cert", str(server.cert), "--tls-key", str(server.key),
                                "--tls-client-ca", str(pki["a"].cert), *port_owner,
                                credentials=tls_credentials(ca=pki["a"].cert, cert=pki["a_client"].cert,
                                                            key=pki["a_client"].key))


def test_a_tls_client_trusting_the_servers_ca_is_served(tls_server, pki):
    assert encode_one(tls_server.target, credentials=tls_credentials(ca=pki["a"].cert))[1] == 48
    assert "TLS on" in tls_server.log_text() and "mTLS off" in tls_server.log_text()


def test_a_plaintext_client_is_refused_by_the_tls_port(tls_server):
    assert refused(tls_server.target).code == grpc.StatusCode.UNAVAILABLE


def test_a_client_trusting_another_ca_refuses_the_server(tls_server, pki):
    assert refused(tls_server.target, credentials=tls_credentials(ca=pki["b"].cert)).code == grpc.StatusCode.UNAVAILABLE


def test_the_health_port_answers_plaintext_while_the_main_port_is_tls(tls_server):
    with EncoderClient(tls_server.health_target, timeout_s=5, retries=0) as client:
        assert client.health() == "SERVING"
        assert client.health("encoder.v1.VisionEncoder") == "SERVING"
        with pytest.raises(EncoderClientError) as info:
            client.model_info()  # health only: the service itself is not reachable in plaintext
        assert info.value.code == grpc.StatusCode.UNIMPLEMENTED


def test_mtls_serves_a_client_whose_certificate_the_ca_signed(mtls_server, pki):
    creds = tls_credentials(ca=pki["a"].cert, cert=pki["a_client"].cert, key=pki["a_client"].key)
    assert encode_one(mtls_server.target, seed=1, credentials=creds)[1] == 48
    assert "mTLS on" in mtls_server.log_text()


def test_mtls_refuses_a_client_without_a_certificate(mtls_server, pki):
    err = refused(mtls_server.target, credentials=tls_credentials(ca=pki["a"].cert))
    assert err.code == grpc.StatusCode.UNAVAILABLE


def test_mtls_refuses_a_client_certificate_from_another_ca(mtls_server, pki):
    creds = tls_credentials(ca=pki["a"].cert, cert=pki["b_client"].cert, key=pki["b_client"].key)
    assert refused(mtls_server.target, credentials=creds).code == grpc.StatusCode.UNAVAILABLE


def presented_certificate(target: str) -> bytes:
    """The DER certificate the server presents to a new connection (stdlib ssl, ALPN h2 like gRPC)."""
    host, _, port = target.rpartition(":")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=5) as sock, context.wrap_socket(sock) as tls:
        return tls.getpeercert(binary_form=True)


def der(path: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(path.read_text())


def test_rotated_certificate_files_reach_new_connections_without_a_restart(start_encoder_server, pki, tmp_path):
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(pki["a_server"].cert, cert)
    shutil.copy(pki["a_server"].key, key)
    server = start_encoder_server("--tls-cert", str(cert), "--tls-key", str(key), "--health-port", "0")
    old_ca, new_ca = tls_credentials(ca=pki["a"].cert), tls_credentials(ca=pki["b"].cert)
    assert presented_certificate(server.target) == der(pki["a_server"].cert)
    with EncoderClient(server.target, timeout_s=10, retries=0, credentials=old_ca) as before:
        assert before.model_info().hidden_size == 48

        # cert-manager's rotation: new files in place, here a pair from another CA altogether.
        shutil.copy(pki["b_server"].cert, cert)
        shutil.copy(pki["b_server"].key, key)
        deadline = time.monotonic() + 5
        while presented_certificate(server.target) != der(pki["b_server"].cert):
            assert time.monotonic() < deadline, server.log_text()
            time.sleep(0.1)
        assert encode_one(server.target, seed=2, credentials=new_ca)[1] == 48
        assert refused(server.target, credentials=old_ca).code == grpc.StatusCode.UNAVAILABLE
        assert before.model_info().hidden_size == 48  # a connection made before keeps working
    assert server.proc.poll() is None and "TLS certificates reloaded" in server.log_text()


def test_a_half_rotated_pair_is_refused_and_the_old_certificate_stays(start_encoder_server, pki, tmp_path):
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(pki["a_server"].cert, cert)
    shutil.copy(pki["a_server"].key, key)
    server = start_encoder_server("--tls-cert", str(cert), "--tls-key", str(key), "--health-port", "0")
    shutil.copy(pki["b_server"].cert, cert)  # the new certificate has landed, its key not yet
    assert presented_certificate(server.target) == der(pki["a_server"].cert)
    assert encode_one(server.target, seed=3, credentials=tls_credentials(ca=pki["a"].cert))[1] == 48
    assert "cannot be used yet" in server.log_text()
    shutil.copy(pki["b_server"].key, key)
    assert presented_certificate(server.target) == der(pki["b_server"].cert)


def start_failure(*flags: str) -> str:
    """The log of a server that must refuse to start (exit code 1) with these flags."""
    result = subprocess.run([sys.executable, "-m", "encoder_service", "serve", "--host", "127.0.0.1", "--port", "0",
                             *flags], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0, result.stderr
    return result.stderr


def test_a_missing_certificate_file_stops_the_start_naming_the_file(pki, tmp_path):
    missing = tmp_path / "missing.crt"
    log = start_failure("--tls-cert", str(missing), "--tls-key", str(pki["a_server"].key))
    assert f"cannot start: tls-cert {missing}: cannot read it" in log


def test_unusable_certificate_files_are_named(pki, tmp_path):
    server = pki["a_server"]
    not_pem = tmp_path / "garbage.key"
    not_pem.write_text("hello")
    with pytest.raises(TLSFileError, match=f"tls-key {not_pem}: not a PEM file"):
        build_security(parse_serve_args(["--tls-cert", str(server.cert), "--tls-key", str(not_pem)],
                                        environ={}).security)
    mismatched = parse_serve_args(["--tls-cert", str(server.cert), "--tls-key", str(pki["b_server"].key)], environ={})
    with pytest.raises(TLSFileError, match=f"certificate {server.cert} with key {pki['b_server'].key}: not a usable"):
        build_security(mismatched.security)
    bad_ca = parse_serve_args(["--tls-cert", str(server.cert), "--tls-key", str(server.key),
                               "--tls-client-ca", str(server.key)], environ={})
    with pytest.raises(TLSFileError, match=f"tls-client-ca {server.key}: not a PEM CA certificate bundle"):
        build_security(bad_ca.security)
    with pytest.raises(TLSFileError, match=f"sink-tls-ca {not_pem}: not a PEM file"):
        build_security(parse_serve_args(["--sink-tls-ca", str(not_pem)], environ={}).security)


@pytest.mark.parametrize("flags, message", [
    (["--tls-cert", "c.pem"], "tls-cert and tls-key go together"),
    (["--tls-client-ca", "ca.pem"], "tls-client-ca (mutual TLS) needs tls-cert and tls-key"),
    (["--sink-tls-key", "k.pem"], "sink-tls-cert and sink-tls-key go together"),
    (["--health-port", "7000", "--port", "7000"], "health-port 7000 is the gRPC port"),
    (["--health-port", "-2"], "health-port must be in 0..65535"),
])
def test_inconsistent_security_flags_are_named(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_serve_args(flags, environ={})
