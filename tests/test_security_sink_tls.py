"""TLS toward EmbeddingSinks: an EmbeddingSinkReceiver mounted on a mutual-TLS grpc.aio server (as
README "Security" shows) receives the pushes of an encoder started with --sink-tls-*."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest
from certs import make_ca
from encoder_client import EmbeddingSinkReceiver, EncoderClient


class TLSSink:
    """A receiver on its own event loop thread, on a port that accepts only TLS with a client
    certificate signed by client_ca."""

    def __init__(self, pair, client_ca) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        creds = grpc.ssl_server_credentials([(pair.key.read_bytes(), pair.cert.read_bytes())],
                                            root_certificates=client_ca.read_bytes(), require_client_auth=True)
        self.receiver, self.server, port = self.call(self._start(creds))
        self.target = f"127.0.0.1:{port}"

    async def _start(self, creds):
        receiver = EmbeddingSinkReceiver()
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        receiver.add_to_server(server)
        port = server.add_secure_port("127.0.0.1:0", creds)
        await server.start()
        return receiver, server, port

    def call(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.call(self.server.stop(0))
        self.call(self.receiver.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def pki(tmp_path):
    sink_ca, encoder_ca = make_ca(tmp_path / "sink", "sink"), make_ca(tmp_path / "encoders", "encoders")
    return sink_ca, sink_ca.issue("server", server=True), encoder_ca, encoder_ca.issue("client")


def test_the_encoder_pushes_to_a_mutual_tls_sink(start_encoder_server, pki):
    sink_ca, sink_pair, encoder_ca, encoder_pair = pki
    sink = TLSSink(sink_pair, encoder_ca.cert)
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
