"""A stand-in for vLLM's OpenAI API as the EPD proxy sees it, and what the proxy tests send it
(tests/epd/test_epd_proxy.py, test_epd_proxy_cache_only.py; bench/proxy_cache_only.py runs it too). The
``vllm`` fixture of tests/epd/conftest.py serves one per test module."""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import socket
import threading

from aiohttp import web

NON_STREAMING_ANSWER = (b'{"id":"chatcmpl-1",  "object": "chat.completion",\n'
                        b' "choices":[{"index":0,"message":{"role":"assistant","content":"a cat"}}]}')
SSE_EVENTS = [b'data: {"choices":[{"delta":{"content":"a"}}]}', b'data: {"choices":[{"delta":{"content":" cat"}}]}',
              b"data: [DONE]"]


class Served:
    """An aiohttp app on a loopback port, run by its own event loop in a thread."""

    def __init__(self, app: web.Application) -> None:
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        started = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", 0).start())
            started.set()
            self.loop.run_forever()
            self.loop.run_until_complete(self.runner.cleanup())

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        assert started.wait(30), "app did not start"
        self.port = self.runner.addresses[0][1]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


class FakeVllm:
    """vLLM's OpenAI API as far as the proxy sees it; ``received`` holds each request it got."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        self.release_next_event = threading.Event()  # a streamed answer waits for it after each event
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/img/{name}", self.image)
        app.router.add_get("/vid/{name}", self.video)
        self.images: dict[str, bytes] = {}
        self.served = Served(app)
        self.url = f"http://127.0.0.1:{self.served.port}"

    def record(self, request: web.Request, body: dict | None) -> None:
        self.received.append({"path": request.path_qs, "headers": dict(request.headers), "body": body})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.record(request, body)
        if body.get("model") == "missing":
            return web.json_response({"error": {"message": "model missing does not exist", "code": 404}}, status=404)
        if not body.get("stream"):
            return web.Response(body=NON_STREAMING_ANSWER, content_type="application/json",
                                headers={"X-Fake-Vllm": "yes"})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in SSE_EVENTS:
            self.release_next_event.clear()  # before the write: the test may release it at once
            await response.write(event + b"\n\n")
            await asyncio.to_thread(self.release_next_event.wait, 30)
        await response.write_eof()
        return response

    async def health(self, request: web.Request) -> web.Response:
        self.record(request, None)
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        self.record(request, None)
        return web.Response(body=b'{"object":"list","data":[{"id":"qwen"}]}', content_type="application/json")

    async def image(self, request: web.Request) -> web.Response:
        return web.Response(body=self.images[request.match_info["name"]], content_type="image/png")

    async def video(self, request: web.Request) -> web.Response:
        return web.Response(body=self.images[request.match_info["name"]], content_type="video/mp4")


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def chat(*images: str, text: str = "what is this?", **extra) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    return {"model": "qwen", "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
            **extra}


def post(port: int, body: dict | bytes, path: str = "/v1/chat/completions") -> tuple[int, bytes, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, payload, {"Content-Type": "application/json", "Authorization": "Bearer sk-user"})
    resp = conn.getresponse()
    out = resp.status, resp.read(), dict(resp.headers)
    conn.close()
    return out


def forwarded_images(request: dict) -> list[dict]:
    return [p for m in request["body"]["messages"] for p in m["content"] if p.get("type") == "image_url"]


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
