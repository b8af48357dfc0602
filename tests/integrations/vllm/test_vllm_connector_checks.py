"""EncoderServiceECConnector's start-up check of the encoder's preprocessing, its reasons and its logs,
against real encoder processes (tiny Qwen2.5-VL preset) started with each ``--preprocess`` mode.

- Preprocessing: vLLM preprocesses with transformers' image processor, torchvision-backed where
  torchvision is installed (else PIL, or as ``--mm-processor-kwargs`` says); an encoder whose
  ``ModelInfo.preprocess`` / ``decode`` cannot equal it gives embeddings ~1e-3 apart, so the
  connector refuses to start (or, with ``preprocess_check: "warn"``, says so and goes on).
- A NOT_FOUND names both of its possible causes: vLLM's key of an image sent with
  ``mm_processor_kwargs`` is a 64-hex-digit hash of the uuid and the kwargs (vLLM 0.33's own
  ``MultiModalHasher.hash_kwargs`` below), indistinguishable from a content hash the encoder lacks.
- Records go through vLLM's ``vllm`` logger (its handler and format), start-up INFO included.
"""

from __future__ import annotations

import logging
import os
import time
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import transformers.utils
from client_servers import png
from encoder_client import EncoderClient
from encoder_client.integrations import vllm as connector_module
from encoder_client.integrations.stager import ConnectorSettings
from vllm.config import ECTransferConfig, VllmConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.multimodal.hasher import MultiModalHasher
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request


def config(target: str, **extra) -> VllmConfig:
    return VllmConfig(ec_transfer_config=ECTransferConfig(
        ec_connector="EncoderServiceECConnector", ec_connector_module_path="encoder_client.integrations.vllm",
        ec_role="ec_consumer", ec_connector_extra_config={"encoder": target, "timeout_s": 30, **extra}))


def request(request_id: str, identifier: str, rows: int) -> Request:
    feature = MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                    mm_position=PlaceholderRange(offset=2, length=rows))
    return Request(request_id, [7] * (rows + 8), SamplingParams(max_tokens=2), None, mm_features=[feature])


def wait_until_failed(connector, req: Request, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not connector.take_unavailable_requests():
        assert not connector.ensure_cache_available(req, 0)
        assert time.monotonic() < deadline, "the request never failed"
        time.sleep(0.02)
    return connector.stager.reasons[req.request_id]


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int) -> list[str]:
        # The connector's own records only: vLLM itself may warn on the same logger tree (e.g. its CPU
        # platform's "Reset SSM cache type" when the first config of a worker process is built).
        return [r.getMessage() for r in self.records
                if r.levelno == level and r.name.startswith("vllm.ec_connector.encoder_service")]


@pytest.fixture
def vllm_records():
    """What reaches vLLM's own ``vllm`` logger (where vLLM's handler and format are)."""
    handler, root = Records(), logging.getLogger("vllm")
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield handler
    root.removeHandler(handler)
    root.setLevel(old_level)


@pytest.fixture(scope="module")
def encoders(start_encoder_server):
    """One real encoder per preprocess mode."""
    servers = {mode: start_encoder_server("--preprocess", mode) for mode in ("pil", "torch")}
    yield {mode: server.target for mode, server in servers.items()}
    for server in servers.values():
        server.stop()


@pytest.fixture
def engine_backend(monkeypatch):
    """Pretend vLLM's environment has torchvision (transformers then picks its torchvision backend) or not."""
    def set_backend(backend: str) -> None:
        monkeypatch.setattr(transformers.utils, "is_torchvision_available", lambda: backend == "torchvision")
    return set_backend


@pytest.fixture
def make():
    made = []

    def create(target: str, **extra):
        connector = ECConnectorFactory.create_connector(config(target, **extra), ECConnectorRole.SCHEDULER)
        made.append(connector)
        return connector

    yield create
    for connector in made:
        connector.shutdown()


def test_the_engines_preprocessing_follows_transformers_backend_resolution(engine_backend):
    def mode(kwargs):
        return connector_module.engine_preprocess(SimpleNamespace(model_config=SimpleNamespace(
            mm_processor_kwargs=kwargs)))
    engine_backend("torchvision")
    assert mode(None) == "torch" and mode({"use_fast": False}) == "pil" and mode({"backend": "pil"}) == "pil"
    engine_backend("pil")
    assert mode({}) == "pil" and mode({"use_fast": True}) == "torch" and mode({"backend": "torchvision"}) == "torch"


def test_an_encoder_that_cannot_equal_the_engines_preprocessing_is_refused_at_start_up(encoders, engine_backend,
                                                                                        make):
    engine_backend("torchvision")  # vLLM's processor: torchvision-backed; the encoder: PIL
    with pytest.raises(ValueError, match=r"--preprocess pil but vLLM's image processor is the torchvision one, "
                                         r"which --preprocess torch equals"):
        make(encoders["pil"])
    engine_backend("pil")
    with pytest.raises(ValueError, match=r"--preprocess torch but vLLM's image processor is the PIL one"):
        make(encoders["torch"])
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"encsvc-ec-{os.getpid()}-")]


@pytest.mark.parametrize("backend,mode", [("torchvision", "torch"), ("pil", "pil")])
def test_an_encoder_preprocessing_as_the_engine_does_is_accepted_and_serves(encoders, engine_backend, make,
                                                                           backend, mode):
    engine_backend(backend)
    connector = make(encoders[mode])
    with EncoderClient(encoders[mode], timeout_s=60) as client:
        (result,) = client.encode([png(4100 + len(mode))])
    req = request("ok", result.content_hash, result.num_tokens)
    deadline = time.monotonic() + 30
    while not connector.ensure_cache_available(req, 0):
        assert not connector.take_unavailable_requests(), connector.stager.reasons
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_preprocess_check_warn_says_so_through_vllms_logger_and_goes_on(encoders, engine_backend, make,
                                                                        vllm_records):
    engine_backend("torchvision")
    make(encoders["pil"], preprocess_check="warn")
    (warning,) = vllm_records.messages(logging.WARNING)
    assert "--preprocess pil" in warning and "--preprocess torch" in warning and "preprocess_check warn" in warning
    with pytest.raises(ValueError, match="preprocess_check must be one of"):
        ConnectorSettings.from_extra_config({"preprocess_check": "ignore"})


def test_an_encoder_unreachable_at_start_up_is_checked_before_the_first_fetch(engine_backend, make, vllm_records):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    engine_backend("torchvision")
    connector = make(dead, timeout_s=2, retries=0)
    assert any("cannot check the encoder's preprocessing yet" in m for m in vllm_records.messages(logging.WARNING))
    assert "UNAVAILABLE" in wait_until_failed(connector, request("r", "ab" * 32, 4))


def test_a_not_found_names_both_causes_mm_processor_kwargs_included(encoders, engine_backend, make):
    engine_backend("pil")
    connector = make(encoders["pil"])
    with EncoderClient(encoders["pil"], timeout_s=60) as client:
        (result,) = client.encode([png(4200)])
    # The key vLLM 0.33 gives this very image when the request carries mm_processor_kwargs: the
    # encoder caches the image, yet the key is 64 hex digits naming nothing it has (sha256: vLLM's
    # --mm-hash-algorithm option; its default blake3 is not installed here and gives 64 hex digits too).
    key = MultiModalHasher.hash_kwargs("sha256", model_id="qwen", image=result.content_hash,
                                       mm_processor_kwargs={"max_pixels": 200704})
    assert len(key) == 64 and key != result.content_hash
    reason = wait_until_failed(connector, request("kwargs", key, result.num_tokens))
    assert "NOT_FOUND" in reason and "does not cache this image" in reason
    assert "mm_processor_kwargs" in reason and "media_io_kwargs" in reason


def test_the_connectors_records_go_through_vllms_logger(encoders, engine_backend, make, vllm_records):
    engine_backend("pil")
    connector = make(encoders["pil"])
    (started,) = [m for m in vllm_records.messages(logging.INFO) if m.startswith("EncoderServiceECConnector:")]
    assert encoders["pil"] in started and "preprocessing pil" in started
    wait_until_failed(connector, request("bad-uuid", "not-a-content-hash", 4))
    (error,) = [r for r in vllm_records.records if r.levelno == logging.ERROR]
    assert error.name.startswith("vllm.") and "request bad-uuid cannot have its embeddings" in error.getMessage()
