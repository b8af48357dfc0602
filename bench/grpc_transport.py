"""How fast gRPC alone carries embeddings: a bare ``grpc.aio`` server on loopback streaming one
1008x1008 image's Qwen2.5-VL-7B embedding (1296 x 3584 bf16 = 9.29 MB) per call, in messages of
the service's default ``--max-chunk-bytes`` (4 MiB), to client processes that read them as bytes.

No model, no cache, no protobuf: what is left is gRPC's own transport (HTTP/2 framing, flow
control, the copies into and out of its buffers). Its images/s is the ceiling that streamed
responses of the real service (``encoder-service bench --service``, ``bench/multi_gpu_scaling.py``)
can reach on the same machine; channel options are passed as ``key=int,...``, e.g.
``--client-opts grpc.http2.max_frame_size=16777215``, to try gRPC's flow-control and framing
settings against the defaults in one run.

    python bench/grpc_transport.py --procs 8 --threads 4 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import threading
import time

import grpc

CHUNK_BYTES = 4 << 20
IMAGE_BYTES = 1296 * 3584 * 2
METHOD = "/bench.Transport/Stream"


def parse_options(spec: str) -> list[tuple[str, int]]:
    """``a=1,b=2`` -> [("a", 1), ("b", 2)] (gRPC channel arguments)."""
    pairs = []
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        pairs.append((key.strip(), int(value)))
    return pairs


async def _serve(port: int, options: list[tuple[str, int]], chunk_bytes: int, ready) -> None:
    payload = os.urandom(chunk_bytes)
    messages = [payload[:n] for n in _message_sizes(chunk_bytes)]

    async def stream(request: bytes, context):
        for _ in range(int(request.decode() or 1)):
            for message in messages:
                yield message

    handler = grpc.method_handlers_generic_handler("bench.Transport", {
        "Stream": grpc.unary_stream_rpc_method_handler(stream)})
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20), *options])
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    ready.set()
    await server.wait_for_termination()


def _message_sizes(chunk_bytes: int) -> list[int]:
    full, rest = divmod(IMAGE_BYTES, chunk_bytes)
    return [chunk_bytes] * full + ([rest] if rest else [])


def _server_main(port: int, options: list[tuple[str, int]], chunk_bytes: int, ready) -> None:
    asyncio.run(_serve(port, options, chunk_bytes, ready))


def _client_main(port: int, options: list[tuple[str, int]], threads: int, t0: float, t1: float, out) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}",
                                    options=[("grpc.max_receive_message_length", 64 << 20), *options])
    call = channel.unary_stream(METHOD)
    received = [0] * threads

    def run(i: int) -> None:
        time.sleep(max(0.0, t0 - time.time()))
        while time.time() < t1:
            n = sum(len(message) for message in call(b"1"))
            if time.time() < t1:  # whole calls inside the window only
                received[i] += n

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    out.put(sum(received))


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_cpu_over(pid: int, t0: float, t1: float) -> float:
    """The server's CPU seconds between wall times t0 and t1 (sampled on a thread)."""
    time.sleep(max(0.0, t0 - time.time()))
    start = _cpu_seconds(pid)
    time.sleep(max(0.0, t1 - time.time()))
    return _cpu_seconds(pid) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, default=8, help="client processes, one channel each")
    parser.add_argument("--threads", type=int, default=4, help="concurrent calls per client process")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window")
    parser.add_argument("--server-opts", default="", help="server channel arguments, key=int,...")
    parser.add_argument("--client-opts", default="", help="client channel arguments, key=int,...")
    parser.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES,
                        help="bytes per message (the service's --max-chunk-bytes)")
    parser.add_argument("--port", type=int, default=50991)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    ready, out = ctx.Event(), ctx.Queue()
    server = ctx.Process(target=_server_main, args=(args.port, parse_options(args.server_opts),
                                                             args.chunk_bytes, ready), daemon=True)
    server.start()
    if not ready.wait(60):
        raise SystemExit("the server did not start")
    t0 = time.time() + 3.0  # the clients' imports and connections happen before the window
    t1 = t0 + args.seconds
    clients = [ctx.Process(target=_client_main, args=(args.port, parse_options(args.client_opts), args.threads,
                                                      t0, t1, out)) for _ in range(args.procs)]
    for client in clients:
        client.start()
    server_cpu: list[float] = []
    sampler = threading.Thread(target=lambda: server_cpu.append(_server_cpu_over(server.pid, t0, t1)))
    sampler.start()
    total = sum(out.get() for _ in clients)
    sampler.join()
    for client in clients:
        client.join()
    server.kill()
    print(json.dumps({"procs": args.procs, "threads": args.threads, "chunk_bytes": args.chunk_bytes,
                      "server_opts": args.server_opts,
                      "client_opts": args.client_opts, "cpu_count": os.cpu_count(),
                      "gb_per_s": round(total / args.seconds / 1e9, 3),
                      "images_per_s": round(total / args.seconds / IMAGE_BYTES, 1),
                      # all the server's threads (gRPC's own included): what each image costs it
                      "server_cpu_ms_per_image": round(1000 * server_cpu[0] / max(1.0, total / IMAGE_BYTES), 2)}))


if __name__ == "__main__":
    main()
