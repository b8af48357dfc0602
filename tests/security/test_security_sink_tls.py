"""TLS toward EmbeddingSinks: an EmbeddingSinkReceiver mounted on a mutual-TLS grpc.aio server (as
README "Security" shows) receives the pushes of an encoder started with --sink-tls-*."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from certs import make_ca
from encoder_client import EncoderClient

from encoder_service.benchmarks.reliability.sinks import SinkServer, receiver


def tls_sink(pair, client_ca) -> SinkServer:
    """A receiver on a port that accepts only TLS with a client certificate signed by client_ca."""
    creds = grpc.ssl_server_credentials([(pair.key.read_bytes(), pair.cert.read_bytes())],
                                        root_certificates=client_ca.read_bytes(), require_client_auth=True)
    return SinkServer(receiver(), credentials=creds)


@pytest.fixture
def pki(tmp_path):
    sink_ca, encoder_ca = make_ca(tmp_path / "sink", "sink"), make_ca(tmp_path / "encoders", "encoders")
    return sink_ca, sink_ca.issue("server", server=True), encoder_ca, encoder_ca.issue("client")


def test_the_encoder_pushes_to_a_mutual_tls_sink(start_encoder_server, pki):
    sink_ca, sink_pair, encoder_ca, encoder_pair = pki
    sink = tls_sink(sink_pair, encoder_ca.cert)
    try:
        encoder = start_encoder_server("--allowed-sinks", "127.0.0.1:*", "--sink-tls-ca", str(sink_ca.cert),
                                       "--sink-tls-cert", str(encoder_pair.cert),
                                       "--sink-tls-key", str(encoder_pair.key))
        assert "TLS toward sinks on (mTLS" in encoder.log_text()
        grid = (1, 4, 4)
        patches = np.random.default_rng(0).standard_normal((16, 1176), dtype=np.float32)
        with EncoderClient(encoder.target, timeout_s=20) as client:
            (header,) = client.encode_to_sink([(patches, grid)], sink.target, sink_request_id="tls-1")
            (streamed,) = client.encode([(patches, grid)])
        (received,) = sink.call(sink.receiver.wait("tls-1", timeout_s=10))
        assert header.content_hash == streamed.content_hash
        np.testing.assert_array_equal(received.embedding, streamed.embedding)
    finally:
        sink.stop()
