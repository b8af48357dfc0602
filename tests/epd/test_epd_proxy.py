"""``encoder-client proxy`` before vLLM: a real encoder process (tiny preset), the proxy, and a small
aiohttp server standing in for vLLM's OpenAI API (vLLM cannot run here) that records what it gets."""

from __future__ import annotations

import base64
import http.client
import io
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from client_servers import png
from encoder_client import EncoderClient, Video, content_hash
from encoder_client.cli import _security, build_parser
from encoder_client.integrations.proxy import EpdProxy, ProxySettings, settings_from_args
from encoder_client.testing import Failure, FakeVisionEncoder, serve_fake
from fake_vllm import NON_STREAMING_ANSWER, SSE_EVENTS, Served, chat, data_url, dead_port, forwarded_images, post
from PIL import Image

from encoder_service.benchmarks.reliability.video_inputs import frame_pattern, make_clip

VLLM_PAGE = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"


@pytest.fixture(scope="module")
def start_proxy(encoder_server, vllm):
    started: list[Served] = []

    def start(**overrides) -> int:
        settings = ProxySettings(**{"encoder": [encoder_server.target], "vllm": vllm.url, **overrides})
        served = Served(EpdProxy(settings).app())
        started.append(served)
        return served.port

    yield start
    for served in started:
        served.close()


@pytest.fixture(scope="module")
def proxy(start_proxy) -> int:
    return start_proxy()


def video_data_url(clip: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(clip).decode()


def chat_parts(*parts: dict, text: str = "what happens?") -> dict:
    return {"model": "qwen", "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path)
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


def forwarded_videos(request: dict) -> list[dict]:
    return [p for m in request["body"]["messages"] for p in m["content"] if p.get("type") == "video_url"]


def test_each_image_reaches_vllm_with_the_encoders_content_hash_as_its_uuid(proxy, vllm, encoder_server):
    images = [png(701), png(702), png(701)]  # the third repeats the first
    status, _, _ = post(proxy, chat(*map(data_url, images)))
    assert status == 200
    parts = forwarded_images(vllm.received[-1])
    with EncoderClient(encoder_server.target) as client:
        # The proxy had the encoder encode each image: cached before we encode anything ourselves.
        assert client.lookup([p["uuid"] for p in parts]) == [True, True, True]
        results = client.encode(images)
    assert [p["uuid"] for p in parts] == [r.content_hash for r in results]
    assert all(r.cache_hit for r in results)
    # vLLM 0.33.0 takes a uuid without pixels only as a hit of its own processor cache, so the
    # pixels stay: the very data URL the user sent, beside the uuid.
    assert [p["image_url"] for p in parts] == [{"url": data_url(i)} for i in images]
    assert vllm.received[-1]["body"]["messages"][0]["content"][-1] == {"type": "text", "text": "what is this?"}
    assert vllm.received[-1]["headers"]["Authorization"] == "Bearer sk-user"


def test_vllms_own_chat_parser_reads_the_uuid_beside_the_image(proxy, vllm):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.chat_utils.chat_message import parse_chat_message_content_mm_part

    assert post(proxy, chat(data_url(png(703))))[0] == 200
    sent = vllm.received[-1]["body"]
    request = ChatCompletionRequest.model_validate(sent)  # what vLLM's server validates the body with
    part = request.messages[0]["content"][0]
    assert part["uuid"] == forwarded_images(vllm.received[-1])[0]["uuid"]
    assert parse_chat_message_content_mm_part(part) == ("image_url", data_url(png(703)))


def test_a_non_streaming_answer_comes_back_byte_for_byte(proxy):
    status, body, headers = post(proxy, chat(data_url(png(704))))
    assert (status, body) == (200, NON_STREAMING_ANSWER)
    assert headers["X-Fake-Vllm"] == "yes"


def test_vllms_status_code_and_error_body_come_back_unchanged(proxy):
    status, body, _ = post(proxy, chat(data_url(png(705)), model="missing"))
    assert status == 404
    assert json.loads(body) == {"error": {"message": "model missing does not exist", "code": 404}}


def test_a_streamed_answer_comes_back_event_by_event(proxy, vllm):
    conn = http.client.HTTPConnection("127.0.0.1", proxy, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(chat(data_url(png(706)), stream=True)),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    for event in SSE_EVENTS:
        # The fake sends the next event only once we have read this one through the proxy.
        assert resp.readline().rstrip(b"\n") == event
        assert resp.readline() == b"\n"
        vllm.release_next_event.set()
    assert resp.read() == b""
    conn.close()
    assert forwarded_images(vllm.received[-1])[0]["uuid"]


def test_models_and_health_pass_through_unchanged(proxy, vllm):
    assert get(proxy, "/v1/models?x=1") == (200, b'{"object":"list","data":[{"id":"qwen"}]}')
    assert vllm.received[-1]["path"] == "/v1/models?x=1"
    assert get(proxy, "/health") == (200, b"")


BAD_REQUESTS = {
    "bad base64": (chat("data:image/png;base64,@@not-base64@@"), "messages[0].content[0]: bad base64"),
    "not base64 at all": (chat("data:image/png,rawtext"), "data URL is not base64"),
    "host not allowed": (chat("http://169.254.169.254/latest/meta-data.png"),
                         "image URL host '169.254.169.254' not allowed"),
    "file url": (chat("file:///etc/passwd"), "image URL scheme 'file' not supported"),
    "mm_processor_kwargs": (chat(data_url(png(707)), mm_processor_kwargs={"max_pixels": 1000}),
                            "mm_processor_kwargs not supported through the EPD proxy"),
    "media_io_kwargs": (chat(data_url(png(707)), media_io_kwargs={"image": {"mode": "RGB"}}),
                        "media_io_kwargs not supported through the EPD proxy"),
    "not an image": (chat("data:image/png;base64," + base64.b64encode(b"no image here").decode()),
                     "the encoder refused an image of this request"),
    "not json": (b"{nope", "request body is not JSON"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_a_bad_request_is_a_400_naming_the_problem_and_the_proxy_keeps_serving(proxy, vllm, name):
    body, message = BAD_REQUESTS[name]
    before = len(vllm.received)
    status, answer, _ = post(proxy, body)
    assert status == 400, answer
    assert message in json.loads(answer)["error"]["message"]
    assert len(vllm.received) == before  # nothing reached vLLM
    assert post(proxy, chat(data_url(png(708))))[0] == 200


def test_an_undecodable_image_is_named_by_its_place_in_the_request(proxy):
    _, answer, _ = post(proxy, chat(data_url(png(709)), "data:image/png;base64," + base64.b64encode(b"xx").decode()))
    assert "messages[0].content[1]" in json.loads(answer)["error"]["message"]


def test_an_image_over_the_size_limit_is_a_413(start_proxy, vllm):
    port = start_proxy(max_image_bytes=1000)
    before = len(vllm.received)
    status, answer, _ = post(port, chat(data_url(png(716, size=(200, 200)))))
    assert status == 413 and "larger than --max-image-bytes (1000 bytes)" in json.loads(answer)["error"]["message"]
    assert len(vllm.received) == before


def test_mm_kwargs_strip_forwards_the_request_without_them(start_proxy, vllm):
    port = start_proxy(mm_kwargs="strip")
    assert post(port, chat(data_url(png(710)), mm_processor_kwargs={"max_pixels": 1000}))[0] == 200
    assert "mm_processor_kwargs" not in vllm.received[-1]["body"]


def test_an_image_from_an_allowed_host_is_forwarded_as_the_bytes_encoded(start_proxy, vllm, encoder_server):
    vllm.images["cat.png"] = image = png(711)
    port = start_proxy(allowed_hosts=["127.0.0.*"])
    assert post(port, chat(f"{vllm.url}/img/cat.png"))[0] == 200
    (part,) = forwarded_images(vllm.received[-1])
    assert part["image_url"] == {"url": data_url(image)}  # vLLM never fetches the URL a second time
    with EncoderClient(encoder_server.target) as client:
        assert part["uuid"] == client.encode([image])[0].content_hash


# --- video_url parts --------------------------------------------------------------------------------


def vllm_clip_hash(client: EncoderClient, clip: bytes, fps: float = 2.0) -> str:
    """The uuid vLLM must get for a clip: its content hash sampled as vLLM samples it (fps 2 by default)."""
    return content_hash(Video(clip, reference="vllm", fps=fps), client.cache_namespace())


def test_a_clip_reaches_vllm_with_its_content_hash_sampled_as_vllm_samples_it(proxy, vllm, encoder_server):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.chat_utils.chat_message import parse_chat_message_content_mm_part

    clip = make_clip("mp4", "libx264", frames=12, fps=10)
    status, answer, _ = post(proxy, chat_parts(video_part(video_data_url(clip))))
    assert status == 200, answer
    (part,) = forwarded_videos(vllm.received[-1])
    with EncoderClient(encoder_server.target) as client:
        assert part["uuid"] == vllm_clip_hash(client, clip)
        assert client.lookup([part["uuid"]]) == [True]  # the proxy had the encoder encode and cache it
    # The clip stays beside its uuid (vLLM counts the prompt's placeholders from it), and vLLM's own
    # request model and chat parser read both.
    assert part == {"type": "video_url", "video_url": {"url": video_data_url(clip)}, "uuid": part["uuid"]}
    request = ChatCompletionRequest.model_validate(vllm.received[-1]["body"])
    assert parse_chat_message_content_mm_part(request.messages[0]["content"][0]) == ("video_url", video_data_url(clip))


def test_an_image_and_a_clip_of_one_request_are_both_rewritten(proxy, vllm, encoder_server):
    image, clip = png(720), make_clip("mp4", "libx264", frames=8, fps=4)
    status, answer, _ = post(proxy, chat_parts(image_part(data_url(image)), video_part(video_data_url(clip))))
    assert status == 200, answer
    content = vllm.received[-1]["body"]["messages"][0]["content"]
    assert [p["type"] for p in content] == ["image_url", "video_url", "text"]
    with EncoderClient(encoder_server.target) as client:
        (encoded,) = client.encode([image])
        assert content[0] == {"type": "image_url", "image_url": {"url": data_url(image)}, "uuid": encoded.content_hash}
        assert content[1] == {"type": "video_url", "video_url": {"url": video_data_url(clip)},
                              "uuid": vllm_clip_hash(client, clip)}
        assert client.lookup([content[1]["uuid"]]) == [True]


def test_a_broken_clip_is_a_400_naming_its_part_and_vllm_is_not_called(proxy, vllm):
    broken = make_clip("mp4", "libx264")[:300]  # the container cut off in its first box
    before = len(vllm.received)
    status, answer, _ = post(proxy, chat_parts(image_part(data_url(png(721))), video_part(video_data_url(broken))))
    message = json.loads(answer)["error"]["message"]
    assert status == 400, answer
    assert "the encoder refused an image or clip of this request" in message
    assert "images[1] = messages[0].content[1]" in message
    assert len(vllm.received) == before
    assert post(proxy, chat_parts(video_part("data:video/mp4;base64,@@")))[0] == 400  # bad base64, as for images


def jpeg(i: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(frame_pattern(i, 64, 48)).save(out, "JPEG", quality=95)
    return out.getvalue()


def frames_data_url(frames: list[bytes]) -> str:
    """vLLM's data URL of a clip's frames (vllm/multimodal/media/video.py, VideoMediaIO.load_base64)."""
    return "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)


def test_a_clip_given_as_vllms_jpeg_frames_reaches_vllm_with_their_content_hash(proxy, vllm, encoder_server):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.chat_utils.chat_message import parse_chat_message_content_mm_part

    frames = [jpeg(730 + i) for i in range(5)]
    url = frames_data_url(frames)
    status, answer, _ = post(proxy, chat_parts(video_part(url)))
    assert status == 200, answer
    (part,) = forwarded_videos(vllm.received[-1])
    assert part == {"type": "video_url", "video_url": {"url": url}, "uuid": part["uuid"]}
    with EncoderClient(encoder_server.target) as client:
        # vLLM takes such frames as they come: every one, no sampling (the encoder's vllm reference for frames)
        assert part["uuid"] == content_hash(Video(frames=frames, reference="vllm"), client.cache_namespace())
        assert client.lookup([part["uuid"]]) == [True]
        (encoded,) = client.encode([Video(frames=frames, reference="vllm")])
        assert list(encoded.frame_indices) == [0, 1, 2, 3, 4, 4]
    request = ChatCompletionRequest.model_validate(vllm.received[-1]["body"])
    assert parse_chat_message_content_mm_part(request.messages[0]["content"][0]) == ("video_url", url)


def test_image_data_urls_are_read_as_vllm_reads_them(proxy, vllm, encoder_server):
    image = png(760)
    b64 = base64.b64encode(image).decode()
    # Any case of the scheme, parameters before ;base64: vLLM takes both.
    for url in (f"DATA:image/png;base64,{b64}", f"data:image/png;name=x.png;base64,{b64}"):
        status, answer, _ = post(proxy, chat(url))
        assert status == 200, answer
        (part,) = forwarded_images(vllm.received[-1])
        assert part["image_url"] == {"url": url}
    # ;base64 that is not the last parameter: vLLM refuses it, so the proxy does before any work.
    before = len(vllm.received)
    status, answer, _ = post(proxy, chat(f"data:image/png;base64;x=y,{b64}"))
    assert status == 400 and "data URL is not base64" in json.loads(answer)["error"]["message"]
    assert len(vllm.received) == before


def test_a_jpeg_frames_url_is_read_as_vllm_reads_it(proxy, vllm, encoder_server):
    # vLLM keeps the first 32 frames (VideoMediaIO's num_frames) and never looks at the rest; it takes
    # parameters before ;base64 and an upper-case scheme or type.
    frames = [jpeg(750 + i % 3) for i in range(40)]
    url = "DATA:Video/JPEG;charset=x;base64," + ",".join(base64.b64encode(f).decode() for f in frames) + ",@@"
    status, answer, _ = post(proxy, chat_parts(video_part(url)))
    assert status == 200, answer
    (part,) = forwarded_videos(vllm.received[-1])
    assert part["video_url"] == {"url": url}
    with EncoderClient(encoder_server.target) as client:
        assert part["uuid"] == content_hash(Video(frames=frames[:32], reference="vllm"), client.cache_namespace())


def test_bad_jpeg_frames_are_a_400_naming_the_frame(proxy, vllm):
    before = len(vllm.received)
    good = base64.b64encode(jpeg(740)).decode()
    for url, says in ((f"data:video/jpeg;base64,{good},@@", "frame 1 of the video/jpeg data URL is not base64"),
                      (f"data:video/jpeg;base64,{good},,{good}", "frame 1 of the video/jpeg data URL is empty"),
                      (f"data:video/jpeg,{good}", "data URL is not base64")):
        status, answer, _ = post(proxy, chat_parts(video_part(url)))
        assert status == 400 and says in json.loads(answer)["error"]["message"], answer
    assert len(vllm.received) == before


def test_the_clips_fps_is_the_proxys_video_fps(start_proxy, vllm, encoder_server):
    clip = make_clip("mp4", "libx264", frames=12, fps=10)
    port = start_proxy(video_fps=1.0)
    assert post(port, chat_parts(video_part(video_data_url(clip))))[0] == 200
    (part,) = forwarded_videos(vllm.received[-1])
    with EncoderClient(encoder_server.target) as client:
        assert part["uuid"] == vllm_clip_hash(client, clip, fps=1.0) != vllm_clip_hash(client, clip)


def test_a_clip_from_an_allowed_host_is_forwarded_as_the_bytes_encoded(start_proxy, vllm, encoder_server):
    vllm.images["clip.mp4"] = clip = make_clip("mp4", "libx264", frames=6, fps=3)
    port = start_proxy(allowed_hosts=["127.0.0.*"])
    assert post(port, chat_parts(video_part(f"{vllm.url}/vid/clip.mp4")))[0] == 200
    (part,) = forwarded_videos(vllm.received[-1])
    assert part["video_url"] == {"url": video_data_url(clip)}
    with EncoderClient(encoder_server.target) as client:
        assert part["uuid"] == vllm_clip_hash(client, clip)
    status, answer, _ = post(start_proxy(), chat_parts(video_part(f"{vllm.url}/vid/clip.mp4")))
    assert status == 400 and "video URL host '127.0.0.1' not allowed" in json.loads(answer)["error"]["message"]


def test_a_clip_over_the_size_limit_is_a_413(start_proxy, vllm):
    port = start_proxy(max_video_bytes=1000)
    before = len(vllm.received)
    status, answer, _ = post(port, chat_parts(video_part(video_data_url(make_clip(frames=30)))))
    assert status == 413 and "clip larger than --max-video-bytes (1000 bytes)" in json.loads(answer)["error"]["message"]
    assert len(vllm.received) == before


def test_the_encoder_being_down_is_a_503_and_vllm_is_not_called(vllm):
    settings = ProxySettings(encoder=[f"127.0.0.1:{dead_port()}"], vllm=vllm.url, encoder_timeout_s=5)
    served = Served(EpdProxy(settings).app())
    try:
        before = len(vllm.received)
        status, answer, _ = post(served.port, chat(data_url(png(712))))
        assert status == 503
        assert "encoder service unavailable (UNAVAILABLE" in json.loads(answer)["error"]["message"]
        assert len(vllm.received) == before
        assert get(served.port, "/health")[0] == 200  # requests without images still go through
    finally:
        served.close()


def test_an_image_over_the_encoders_limits_is_a_413_naming_it_and_vllm_is_not_called(proxy, vllm):
    # 2100 x 2100 = 4.41 M pixels, over the test encoder's --max-image-pixels 4000000: a retry
    # cannot pass, so not the 503 an overloaded encoder gets (a client would retry that in vain).
    before = len(vllm.received)
    status, answer, headers = post(proxy, chat(data_url(png(717)), data_url(png(718, size=(2100, 2100), solid=True))))
    message = json.loads(answer)["error"]["message"]
    assert status == 413, answer
    assert "over its limits" in message and "pixel" in message and "messages[0].content[1]" in message
    assert "Retry-After" not in headers
    assert len(vllm.received) == before


def test_an_encoder_with_a_full_queue_is_a_503_with_its_retry_after(vllm):
    # Fake encoder: a full queue on cue, with the pushback the real server sends with it
    # (tests/api/test_server_lifecycle.py pins that).
    fake = FakeVisionEncoder()
    fake.fail_next.append(Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full: 64 images waiting",
                                  trailers=(("grpc-retry-pushback-ms", "1000"),)))
    with serve_fake(fake) as target:
        served = Served(EpdProxy(ProxySettings(encoder=[target], vllm=vllm.url)).app())
        try:
            before = len(vllm.received)
            status, answer, headers = post(served.port, chat(data_url(png(719))))
            assert status == 503, answer
            assert "queue full" in json.loads(answer)["error"]["message"]
            assert headers["Retry-After"] == "1"
            assert len(vllm.received) == before
            assert post(served.port, chat(data_url(png(719))))[0] == 200  # the queue has room again
        finally:
            served.close()


def test_several_encoders_route_around_one_that_is_down(start_proxy, encoder_server, vllm):
    port = start_proxy(encoder=[encoder_server.target, f"127.0.0.1:{dead_port()}"])
    image = png(713)
    assert post(port, chat(data_url(image)))[0] == 200
    with EncoderClient(encoder_server.target) as client:
        assert client.lookup([forwarded_images(vllm.received[-1])[0]["uuid"]]) == [True]


def test_vllm_being_down_is_a_502(encoder_server):
    settings = ProxySettings(encoder=[encoder_server.target], vllm=f"http://127.0.0.1:{dead_port()}")
    served = Served(EpdProxy(settings).app())
    try:
        status, answer, _ = post(served.port, chat(data_url(png(714))))
        assert status == 502 and "unreachable" in json.loads(answer)["error"]["message"]
    finally:
        served.close()


def test_the_readme_proxy_command_line_parses_with_the_real_parser():
    section = VLLM_PAGE.read_text().split("## The proxy", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    command = next(c for c in block.replace("\\\n", " ").splitlines() if c.strip().startswith("encoder-client proxy"))
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert args.command == "proxy"
    settings = settings_from_args(args, _security(args))
    assert settings.encoder and settings.vllm.startswith("http") and args.port


def test_importing_the_client_and_its_cli_does_not_import_aiohttp():
    code = ("import sys, encoder_client, encoder_client.cli, encoder_client.integrations.proxy_rewrite; "
            "sys.exit('aiohttp' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_the_command_serves_until_terminated(encoder_server, vllm):
    port = dead_port()
    proc = subprocess.Popen([sys.executable, "-m", "encoder_client.cli", "proxy", "--encoder", encoder_server.target,
                             "--vllm", vllm.url, "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                assert get(port, "/v1/models")[0] == 200
                break
            except ConnectionRefusedError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
                time.sleep(0.2)
        assert post(port, chat(data_url(png(715))))[0] == 200
    finally:
        proc.terminate()
        output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, output
    assert f"encoder-client proxy: http://127.0.0.1:{port} -> vLLM {vllm.url}" in output
