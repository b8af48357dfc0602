"""The EPD proxy's encoder traffic per proxied request: ``--encode-mode full`` (the encoder streams
each miss's embedding back and the proxy drops it: the behaviour before cache_only) against
``cache`` (Encode cache_only: each image's header only).

A real encoder process (the tiny preset on the CPU unless ``--model`` says otherwise), the proxy in
this process, and a stand-in vLLM answering every chat request with a fixed JSON body. Each request
carries one new image (a cache miss, the case that differs). Per mode: bytes of the encoder's
answers (the chunks the proxy's client received: rows plus headers, the rows also when the client
got them in shared memory), and the wall time of each proxied request (client POST to answer).
The proxy's client streams (``shared_memory`` off), as a proxy on another host than the encoder does.

    python bench/proxy_cache_only.py --requests 30 --rounds 3 --size 448
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the tests' shared helpers
sys.path.insert(0, str(ROOT / "tests" / "epd"))  # the tests' fake vLLM server

from aiohttp import web  # noqa: E402
from encoder_client.integrations.proxy import EpdProxy, ProxySettings  # noqa: E402
from fake_vllm import Served  # noqa: E402

from encoder_service.benchmarks.reliability.server import start_server  # noqa: E402


def png(seed: int, size: int) -> bytes:
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((size, size, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def _header_bytes(chunk) -> int:
    """The serialized size of a chunk's fields other than its rows."""
    header = getattr(chunk, "header", chunk)
    return header.ByteSize() - (len(header.data) + 5 if len(header.data) else 0)


def fake_vllm() -> Served:
    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"id": "x", "choices": [{"index": 0, "message": {"content": "ok"}}]})

    app = web.Application(client_max_size=256 << 20)
    app.router.add_post("/v1/chat/completions", chat)
    return Served(app)


def run_mode(mode: str, target: str, vllm_url: str, images: list[bytes]) -> dict:
    proxy = EpdProxy(ProxySettings(encoder=[target], vllm=vllm_url, encode_mode=mode,
                                   security={"shared_memory": False}))
    received = {"rows": 0, "wire": 0, "chunks": 0}
    client, call = proxy.bridge.client, proxy.bridge.client._call_encode

    def counting(request, timeout_s, consume):
        def chunks(stream):
            for chunk in stream:
                received["chunks"] += 1
                received["rows"] += len(chunk.data) + chunk.region_bytes
                received["wire"] += len(chunk.data) + chunk.region_bytes + _header_bytes(chunk)
                yield chunk
        return call(request, timeout_s, lambda stream: consume(chunks(stream)))

    client._call_encode = counting
    served = Served(proxy.app())
    times = []
    try:
        for image in images:
            url = "data:image/png;base64," + base64.b64encode(image).decode()
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "what is this?"}]}]}).encode()
            conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=120)
            started = time.perf_counter()
            conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            times.append(time.perf_counter() - started)
            conn.close()
            assert resp.status == 200, resp.status
    finally:
        served.close()
    n = len(images)
    return {"mode": mode, "requests": n, "encoder_bytes_per_request": received["wire"] / n,
            "row_bytes_per_request": received["rows"] / n, "chunks_per_request": received["chunks"] / n,
            "p50_ms": statistics.median(times) * 1e3, "mean_ms": statistics.fmean(times) * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=40, help="proxied requests per mode, each a new image")
    p.add_argument("--rounds", type=int, default=3, help="rounds of (full, cache)")
    p.add_argument("--size", type=int, default=448, help="image side, pixels")
    p.add_argument("--model", default=None, help="encoder --model (default: the tiny preset)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    flags = ("--model", args.model) if args.model else ()
    server = start_server(*flags)
    vllm = fake_vllm()
    try:
        results = []
        url = f"http://127.0.0.1:{vllm.port}"
        run_mode("full", server.target, url, [png(900 + i, args.size) for i in range(3)])  # warm-up
        # Rounds alternate the modes so that drift of a shared machine falls on both alike.
        for r in range(args.rounds):
            for k, mode in enumerate(("full", "cache")):
                images = [png(100_000 * r + 10_000 * k + i, args.size) for i in range(args.requests)]
                results.append({"round": r, **run_mode(mode, server.target, url, images)})
                print(json.dumps(results[-1]), flush=True)
    finally:
        vllm.close()
        server.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
