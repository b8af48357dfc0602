"""EncoderServiceECConnector (encoder_client.integrations.vllm) inside vLLM 0.33.0, on the CPU.

vLLM's own pieces throughout: ``ECConnectorFactory`` builds the connector from a real
``VllmConfig`` / ``ECTransferConfig`` (the README's config), requests are vLLM's ``Request`` with
``MultiModalFeatureSpec`` items, the worker side runs through vLLM's model-runner mixin
(``ECConnectorModelRunnerMixin``: bind metadata, ``start_load_caches``, worker metadata back) with
the worker connector vLLM itself creates (``ensure_ec_transfer_initialized``). The encoder is a real
server process (tiny Qwen2.5-VL preset). scripts/ci_tools.sh installs vLLM's wheel without its CUDA
dependencies. These tests check what a real engine run cannot show: bfloat16 bytes, the staged files'
life (held for a worker, swept, none left at shutdown), shared memory, dns routing, the row-count
check, the settings; tests/integrations/vllm/test_vllm_engine.py runs the connector inside a real vLLM engine.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import time
from pathlib import Path

import numpy as np
import pytest

# vLLM 0.33.0 without its CUDA dependencies: scripts/ci_tools.sh installs it (a missing vLLM is an
# import error here, never a silent skip).
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch
from client_servers import png
from encoder_client import EncoderClient, HashRef, Video
from encoder_client.integrations.stager import ConnectorSettings
from vllm.config import ECTransferConfig, VllmConfig
from vllm.distributed.ec_transfer import ec_transfer_state
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ECConnectorOutput
from vllm.v1.request import Request
from vllm.v1.worker.ec_connector_model_runner_mixin import ECConnectorModelRunnerMixin

VLLM_PAGE = Path(__file__).resolve().parents[3] / "docs" / "vllm.md"
TESTED_VLLM = "0.33.0"


def readme_config() -> dict:
    """The --ec-transfer-config JSON of the README's "Using it with vLLM" section."""
    section = VLLM_PAGE.read_text()
    (raw,) = re.findall(r"--ec-transfer-config \\\n\s*'(\{.*?\})'", section, flags=re.S)
    return json.loads(raw)


def vllm_config(target: str, **extra) -> VllmConfig:
    """The README's config, pointed at the test's encoder, with ``extra`` settings on top."""
    config = readme_config()
    config["ec_connector_extra_config"] = {**config["ec_connector_extra_config"], "encoder": target, **extra}
    return VllmConfig(ec_transfer_config=ECTransferConfig(**config))


def request(request_id: str, items: list[tuple[str, int]], prompt_len: int = 64, modality: str = "image") -> Request:
    """A vLLM Request whose ``modality`` items are (identifier = uuid, placeholder tokens)."""
    features, offset = [], 2
    for identifier, rows in items:
        features.append(MultiModalFeatureSpec(data=None, modality=modality, identifier=identifier,
                                              mm_position=PlaceholderRange(offset=offset, length=rows)))
        offset += rows + 1
    return Request(request_id, [7] * max(prompt_len, offset + 1), SamplingParams(max_tokens=2), None,
                   mm_features=features)


def wait_until_available(connector, req: Request, timeout_s: float = 30.0) -> int:
    """Call ensure_cache_available as the scheduler does each step until it says True; the polls."""
    deadline, polls = time.monotonic() + timeout_s, 0
    while not connector.ensure_cache_available(req, req.num_computed_tokens):
        polls += 1
        assert time.monotonic() < deadline, "items never became available"
        assert not connector.take_unavailable_requests(), connector.stager.reasons
        time.sleep(0.02)
    return polls


def wait_until_failed(connector, req: Request, timeout_s: float = 30.0) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        assert not connector.ensure_cache_available(req, req.num_computed_tokens)
        failed = connector.take_unavailable_requests()
        if failed:
            return failed
        assert time.monotonic() < deadline, "the request never failed"
        time.sleep(0.02)


def worker_step(scheduler_connector, req: Request, encoder_cache: dict) -> ECConnectorOutput:
    """What vLLM does for one step once the request is scheduled: allocate its items (the connector
    plans their loads), build the step's metadata, run the worker side through the model runner's
    mixin, hand the worker's output back to the scheduler side."""
    for index, feature in enumerate(req.mm_features):
        assert scheduler_connector.has_cache_item(feature.identifier)
        scheduler_connector.update_state_after_alloc(req, index)
    scheduler_output = SchedulerOutput.make_empty()
    scheduler_output.ec_connector_metadata = scheduler_connector.build_connector_meta(scheduler_output)
    with ECConnectorModelRunnerMixin.maybe_get_ec_connector_output(scheduler_output, encoder_cache) as output:
        pass
    scheduler_connector.update_connector_output(output)
    return output


def own_shm_files() -> list[str]:
    """Staged files of this process anywhere in /dev/shm (every connector here stages there)."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"encsvc-ec-{os.getpid()}-"))


@pytest.fixture(scope="module")
def encoder(encoder_server):
    with EncoderClient(encoder_server.target, timeout_s=60) as client:
        yield encoder_server, client


@pytest.fixture
def connectors(encoder):
    """Make (scheduler connector, vllm_config) pairs; the worker connector is vLLM's own global one.
    Everything is shut down after the test, and no staged file may be left."""
    made = []

    def make(target: str | None = None, **extra):
        config = vllm_config(target or encoder[0].target, **extra)
        scheduler = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
        ec_transfer_state.ensure_ec_transfer_shutdown()
        ec_transfer_state.ensure_ec_transfer_initialized(config)  # the worker's, as a worker process does it
        made.append(scheduler)
        return scheduler

    yield make
    for connector in made:
        connector.shutdown()
    ec_transfer_state.ensure_ec_transfer_shutdown()
    assert own_shm_files() == []


_seeds = iter(range(5000, 6000))


def cached_image(client: EncoderClient, **kwargs):
    """A new image the encoder has encoded (so caches): its EncodedImage."""
    (result,) = client.encode([png(next(_seeds))], **kwargs)
    return result


def test_the_tested_vllm_version_is_installed():
    import vllm

    assert vllm.__version__ == TESTED_VLLM


def test_the_readme_config_is_the_one_the_tests_use():
    config = readme_config()
    assert config["ec_connector"] == "EncoderServiceECConnector"
    assert config["ec_connector_module_path"] == "encoder_client.integrations.vllm"
    assert config["ec_role"] == "ec_consumer"
    ConnectorSettings.from_extra_config(config["ec_connector_extra_config"])  # every key is a setting
    ec = vllm_config("localhost:1").ec_transfer_config
    assert ec.is_ec_consumer and not ec.is_ec_producer
    assert type(ECConnectorFactory.get_connector_class(ec)).__name__ == "ABCMeta"
    assert ECConnectorFactory.get_connector_class(ec).__name__ == "EncoderServiceECConnector"


def test_the_readme_encoder_command_parses():
    from encoder_service.config_flags import parse_serve_args

    section = VLLM_PAGE.read_text()
    block = re.findall(r"```bash\n(.*?)```", section, re.S)[0].replace("\\\n", " ")
    (command,) = [c for c in block.splitlines() if c.strip().startswith("encoder-service serve")]
    config = parse_serve_args(shlex.split(command.split("#")[0])[2:], environ={})
    assert config.device == "cuda" and config.dtype == "bfloat16"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_staged_tensors_equal_the_servers_embeddings(encoder, connectors, dtype):
    _server, client = encoder
    images = [cached_image(client), cached_image(client)]
    connector = connectors(dtype=dtype)
    req = request(f"req-{dtype}", [(r.content_hash, r.num_tokens) for r in images])

    # Not staged yet: vLLM would not skip its encoder for these items, and the request is deferred
    # (the fetch runs in the background: its result is seen at a later step at the earliest).
    assert not any(connector.has_cache_item(r.content_hash) for r in images)
    assert not connector.ensure_cache_available(req, 0)
    wait_until_available(connector, req)
    assert len(connector.stager.staged_files()) == 2

    encoder_cache: dict[str, torch.Tensor] = {}
    output = worker_step(connector, req, encoder_cache)
    assert sorted(output.ec_connector_worker_meta.loaded) == sorted(r.content_hash for r in images)
    for r in images:
        tensor = encoder_cache[r.content_hash]
        assert tensor.dtype == getattr(torch, dtype) and tensor.device.type == "cpu"
        assert tuple(tensor.shape) == (r.num_tokens, r.hidden_size)
        # the same bytes the client's encode returns for this hash, in this dtype
        (want,) = client.encode([HashRef(r.content_hash)], output_dtype=dtype, bf16_as="uint16")
        got = tensor.view(torch.uint16) if dtype == "bfloat16" else tensor
        assert got.numpy().tobytes() == want.embedding.tobytes()

    # Loaded and freed by vLLM (its tokens computed): the staged files go.
    for index in range(len(images)):
        connector.update_state_after_free(req, index)
    assert connector.stager.staged_files() == []
    assert connector.request_finished(req) == (False, None)

    stats = connector.get_ec_connector_stats()
    assert stats.data["items_fetched"] == 2 and stats.data["items_staged"] == 2
    assert stats.data["bytes_staged"] == sum(r.num_tokens * r.hidden_size for r in images) * (
        4 if dtype == "float32" else 2)
    # The worker connector counts its loads; whether vLLM reports them is its model runner's doing
    # (the V1 runner does not ask: tests/integrations/vllm/test_vllm_engine.py checks what a real engine logs).
    worker_stats = ec_transfer_state.get_ec_transfer().get_ec_connector_stats()
    assert worker_stats.data["items_loaded"] == 2


def test_a_co_located_encoder_hands_embeddings_over_in_shared_memory(start_encoder_server, connectors):
    server = start_encoder_server("--shared-memory", "on")
    try:
        with EncoderClient(server.target, timeout_s=60) as client:
            image = cached_image(client)
            connector = connectors(server.target, shared_memory=True)
            assert connector.stager._client._regions is not None  # a region is lent, the stream not used
            req = request("req-shm", [(image.content_hash, image.num_tokens)])
            wait_until_available(connector, req)
            encoder_cache: dict[str, torch.Tensor] = {}
            worker_step(connector, req, encoder_cache)
            assert encoder_cache[image.content_hash].numpy().tobytes() == image.embedding.tobytes()
            connector.update_state_after_free(req, 0)
    finally:
        server.stop()


def test_shared_memory_needs_one_plain_encoder_target():
    with pytest.raises(ValueError, match="exactly one encoder target"):
        ConnectorSettings.from_extra_config({"encoder": "dns:///encoders:50051", "shared_memory": True})


def test_an_item_is_held_while_a_worker_has_still_to_load_it(encoder, connectors):
    _server, client = encoder
    image = cached_image(client)
    connector = connectors()
    first = request("holder-a", [(image.content_hash, image.num_tokens)])
    wait_until_available(connector, first)
    connector.update_state_after_alloc(first, 0)
    meta = connector.build_connector_meta(SchedulerOutput.make_empty())
    assert [item.content_hash for item in meta.loads] == [image.content_hash]
    # The request goes away (aborted) before the worker ran the step: the file must stay for it.
    connector.request_finished(first)
    assert len(connector.stager.staged_files()) == 1
    worker = ec_transfer_state.get_ec_transfer()
    worker.bind_connector_metadata(meta)
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(cache)
    assert image.content_hash in cache
    connector.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=worker.build_connector_worker_meta()))
    assert connector.stager.staged_files() == []


def test_a_missing_item_is_deferred_then_loaded_once_staged(encoder, connectors):
    _server, client = encoder
    image = cached_image(client)
    connector = connectors()
    req = request("deferred", [(image.content_hash, image.num_tokens)])
    polls = wait_until_available(connector, req)
    assert polls >= 1  # at least one step deferred it: it was fetched in the background
    assert connector.has_cache_item(image.content_hash)
    cache: dict[str, torch.Tensor] = {}
    worker_step(connector, req, cache)
    assert cache[image.content_hash].shape == (image.num_tokens, image.hidden_size)
    # A second request for the same image while it is still staged: available at once, no refetch.
    again = request("deferred-again", [(image.content_hash, image.num_tokens)])
    assert connector.ensure_cache_available(again, 0)
    assert connector.get_ec_connector_stats().data["items_fetched"] == 1
    connector.request_finished(req)
    connector.request_finished(again)


def test_items_already_computed_or_of_other_modalities_are_not_fetched(encoder, connectors):
    connector = connectors()
    req = request("done-ones", [("f" * 64, 4)])
    assert connector.ensure_cache_available(req, 100)  # its placeholders are all computed already
    req.mm_features[0].modality = "audio"
    assert connector.ensure_cache_available(req, 0)  # not ours: vLLM's own encoder handles it
    assert connector.get_ec_connector_stats() is None


def test_an_item_the_server_does_not_have_fails_its_request_with_a_reason(encoder, connectors):
    _server, client = encoder
    image = cached_image(client)
    unknown = "0" * 64
    connector = connectors()
    req = request("no-such-image", [(image.content_hash, image.num_tokens), (unknown, 8)])
    assert wait_until_failed(connector, req) == {"no-such-image"}
    assert "NOT_FOUND" in connector.stager.reasons["no-such-image"]
    assert "does not cache this image" in connector.stager.reasons["no-such-image"]
    assert not connector.has_cache_item(unknown)
    assert connector.take_unavailable_requests() == set()  # reported once
    connector.request_finished(req)  # vLLM finishes it (FINISHED_ERROR)
    time.sleep(0.5)  # the other item's fetch lands after: nobody holds it, it is not kept
    assert not connector.has_cache_item(image.content_hash)
    assert connector.stager.staged_files() == []
    assert connector.get_ec_connector_stats().data["items_failed"] == 1


def test_a_uuid_that_is_not_a_content_hash_fails_at_once(encoder, connectors):
    connector = connectors()
    req = request("plain-uuid", [("my-image-1", 4)])
    assert not connector.ensure_cache_available(req, 0)
    assert connector.take_unavailable_requests() == {"plain-uuid"}
    assert "not an encoder-service content hash" in connector.stager.reasons["plain-uuid"]


def test_a_row_count_other_than_the_prompts_fails_the_request(encoder, connectors):
    _server, client = encoder
    image = cached_image(client)
    connector = connectors()
    req = request("wrong-rows", [(image.content_hash, image.num_tokens + 1)])
    assert wait_until_failed(connector, req) == {"wrong-rows"}
    assert f"has {image.num_tokens} rows but the prompt has {image.num_tokens + 1}" in \
        connector.stager.reasons["wrong-rows"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_encoder_that_is_down_fails_the_request_with_a_reason(connectors):
    connector = connectors(f"127.0.0.1:{_closed_port()}", timeout_s=3, retries=0)
    req = request("encoder-down", [("1" * 64, 4)])
    assert wait_until_failed(connector, req) == {"encoder-down"}
    assert "UNAVAILABLE" in connector.stager.reasons["encoder-down"] or \
        "DEADLINE_EXCEEDED" in connector.stager.reasons["encoder-down"]


def test_a_dns_target_routes_through_the_routing_client(encoder, connectors):
    server, client = encoder
    image = cached_image(client)
    port = server.target.rsplit(":", 1)[1]
    connector = connectors(f"dns:///localhost:{port}")
    assert type(connector.stager._client).__name__ == "RoutingEncoderClient"
    req = request("via-dns", [(image.content_hash, image.num_tokens)])
    wait_until_available(connector, req)
    cache: dict[str, torch.Tensor] = {}
    worker_step(connector, req, cache)
    np.testing.assert_array_equal(cache[image.content_hash].numpy(), image.embedding)
    connector.request_finished(req)


def test_shutdown_leaves_no_shared_memory(encoder, connectors):
    _server, client = encoder
    images = [cached_image(client) for _ in range(3)]
    connector = connectors()
    held = request("held", [(r.content_hash, r.num_tokens) for r in images[:2]])
    wait_until_available(connector, held)
    assert len(own_shm_files()) == 2
    # one more fetch in flight at shutdown: it must not leave a file behind either
    in_flight = request("in-flight", [(images[2].content_hash, images[2].num_tokens)])
    assert not connector.ensure_cache_available(in_flight, 0)
    connector.shutdown()
    assert own_shm_files() == []
    time.sleep(1.0)  # the in-flight fetch ends against a closed staging area
    assert own_shm_files() == []


def test_files_of_a_dead_process_are_swept(tmp_path):
    from encoder_client.integrations.staging import StagingArea, sweep_stale

    area = StagingArea(str(tmp_path))
    area.stage("a" * 64, np.zeros((2, 3), np.float32), "float32")
    (tmp_path / f"encsvc-ec-999999999-deadbeef-{'b' * 64}").write_bytes(b"x")  # no such pid
    assert sweep_stale(str(tmp_path)) == 1  # the dead pid's file; ours stays
    assert len(area.owned_files()) == 1
    area.close()
    assert list(tmp_path.iterdir()) == []


def test_the_connector_refuses_the_producer_role_and_unknown_settings():
    config = readme_config()
    with pytest.raises(ValueError, match="consumer only"):
        ECConnectorFactory.create_connector(
            VllmConfig(ec_transfer_config=ECTransferConfig(**{**config, "ec_role": "ec_both"})),
            ECConnectorRole.WORKER)
    with pytest.raises(ValueError, match="unknown ec_connector_extra_config keys"):
        ECConnectorFactory.create_connector(vllm_config("localhost:1", encoder_host="x"), ECConnectorRole.WORKER)


def test_the_staging_and_the_stager_import_neither_torch_nor_vllm():
    import subprocess
    import sys

    code = ("import sys, encoder_client, encoder_client.integrations, encoder_client.integrations.staging, "
            "encoder_client.integrations.stager; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'encoder_service')); "
            "print(','.join(bad)); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"imported: {proc.stdout.strip()} {proc.stderr}"


def test_a_video_item_is_served_by_its_uuid_when_the_connector_takes_video(encoder, connectors):
    # The uuid of a video item is the encoder's content hash of the clip sampled as vLLM samples it
    # (reference "vllm", the same fps / num_frames as vLLM's video settings): README, "Using it with vLLM".
    from encoder_service.benchmarks.reliability.video_inputs import make_clip

    _server, client = encoder
    (clip,) = client.encode([Video(make_clip("mp4", "libx264", frames=12, fps=10), fps=2, reference="vllm")])
    assert clip.frame_indices  # a clip: its frames are said
    image_only = connectors()
    req = request("video-item", [(clip.content_hash, clip.num_tokens)], modality="video")
    assert image_only.ensure_cache_available(req, 0)  # not its modality: left to vLLM, nothing fetched
    assert image_only.stager.staged_files() == []

    connector = connectors(modalities=["image", "video"])
    wait_until_available(connector, req)
    encoder_cache: dict[str, torch.Tensor] = {}
    output = worker_step(connector, req, encoder_cache)
    assert output.ec_connector_worker_meta.loaded == [clip.content_hash]
    tensor = encoder_cache[clip.content_hash]
    assert tuple(tensor.shape) == (clip.num_tokens, clip.hidden_size)
    (want,) = client.encode([HashRef(clip.content_hash)], output_dtype="float32")
    np.testing.assert_array_equal(tensor.float().numpy(), want.embedding)
    connector.update_state_after_free(req, 0)
