"""The metrics port: plaintext, no token, so it listens on loopback unless --metrics-host says
otherwise (deploy/ sets 0.0.0.0: Prometheus scrapes the pod's IP), whatever --host is; and what it
shows names the model, never the checkpoint's path on the server's disk."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encoder_service.config_flags import build_config
from encoder_service.metrics import model_label
from encoder_service.models import make_checkpoint

pytestmark = pytest.mark.timeout(180)

# Linux routes all of 127.0.0.0/8 to loopback: a socket bound to 0.0.0.0 answers on 127.0.0.2, one
# bound to 127.0.0.1 does not. 127.0.0.2 stands for "any address but 127.0.0.1".
OTHER_ADDRESS = "127.0.0.2"


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def grpc_serves(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_metrics_host_defaults_to_loopback_whatever_host_is():
    assert build_config(None, {}).metrics_host == "127.0.0.1"
    assert build_config(None, {"ENCODER_SERVICE_HOST": "0.0.0.0"}).metrics_host == "127.0.0.1"
    assert build_config(None, {"ENCODER_SERVICE_METRICS_HOST": "0.0.0.0"}).metrics_host == "0.0.0.0"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint("tiny-qwen2.5-vl", tmp_path_factory.mktemp("secret-mount") / "my-vision-tower", seed=1)


def test_a_server_on_every_address_keeps_its_metrics_on_loopback_and_shows_no_model_path(
        start_encoder_server, checkpoint):
    server = start_encoder_server("--host", "0.0.0.0", "--model", str(checkpoint))
    try:
        grpc_port = int(server.target.rsplit(":", 1)[1])
        metrics_port = port_of(server.metrics_url)
        assert grpc_serves(f"{OTHER_ADDRESS}:{grpc_port}")  # --host 0.0.0.0: the control
        assert reachable("127.0.0.1", metrics_port)
        assert not reachable(OTHER_ADDRESS, metrics_port), "the metrics port answers beyond loopback"
        text = server.metrics_text()
        assert str(checkpoint.parent) not in text and "secret-mount" not in text
        assert 'model="my-vision-tower"' in text
        assert 'encoder_service_images_total{model="my-vision-tower",source="encoded"}' in text
    finally:
        server.stop()


def test_metrics_host_opens_the_metrics_port_to_other_addresses(start_encoder_server):
    server = start_encoder_server("--metrics-host", "0.0.0.0")
    try:
        metrics_port = port_of(server.metrics_url)
        body = urllib.request.urlopen(f"http://{OTHER_ADDRESS}:{metrics_port}/metrics", timeout=5).read()
        assert b"encoder_service_model_info" in body
    finally:
        server.stop()


@pytest.mark.parametrize("model_id,label", [
    ("tiny-qwen2.5-vl@seed0", "tiny-qwen2.5-vl@seed0"),
    ("/models/Qwen2.5-VL-7B-Instruct", "Qwen2.5-VL-7B-Instruct"),
    ("/models/Qwen2.5-VL-7B-Instruct/", "Qwen2.5-VL-7B-Instruct"),
    ("relative/dir/ckpt", "ckpt"),
    ("/root/.cache/huggingface/hub/models--Qwen--Qwen2.5-VL-7B-Instruct/snapshots/" + "a" * 40,
     "Qwen/Qwen2.5-VL-7B-Instruct"),
])
def test_the_model_label_is_a_name_not_a_path(model_id, label):
    assert model_label(model_id) == label
