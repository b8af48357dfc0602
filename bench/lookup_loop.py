"""How much a big Lookup delays everything else the server's event loop answers: health-check
latency on an idle server, then while CLIENTS processes each send Lookups of HASHES hashes in a
loop. A measurement, not a test (numbers move with the machine and its load)::

    python bench/lookup_loop.py --clients 4 --hashes 65536 --seconds 10
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
from encoder_client.protocol import encoder_pb2, encoder_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encoder_service.benchmarks.reliability.server import start_server


def lookup_loop(target: str, hashes: int, stop_at: float, out) -> None:
    request = encoder_pb2.LookupRequest(content_hashes=[os.urandom(32).hex() for _ in range(hashes)])
    took = []
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = encoder_pb2_grpc.VisionEncoderStub(channel)
        while time.monotonic() < stop_at:
            t = time.perf_counter()
            stub.Lookup(request, timeout=60)
            took.append(time.perf_counter() - t)
    out.put(took)


def health_latencies(target: str, seconds: float) -> list[float]:
    out = []
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        stop_at = time.monotonic() + seconds
        while time.monotonic() < stop_at:
            t = time.perf_counter()
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            out.append(time.perf_counter() - t)
            time.sleep(0.005)
    return out


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--hashes", type=int, default=65536)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    server = start_server()
    try:
        idle = health_latencies(server.target, args.seconds / 2)
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        stop_at = time.monotonic() + args.seconds + 3.0
        procs = [ctx.Process(target=lookup_loop, args=(server.target, args.hashes, stop_at, queue))
                 for _ in range(args.clients)]
        for proc in procs:
            proc.start()
        time.sleep(2.0)  # the clients built their requests and are sending
        loaded = health_latencies(server.target, args.seconds)
        lookups = [t for _ in procs for t in queue.get(timeout=120)]
        for proc in procs:
            proc.join(30)
    finally:
        server.stop()
    print(f"health idle:   p50 {pct(idle, 0.5):.2f} ms  p99 {pct(idle, 0.99):.2f} ms  ({len(idle)} checks)")
    print(f"health loaded: p50 {pct(loaded, 0.5):.2f} ms  p99 {pct(loaded, 0.99):.2f} ms  ({len(loaded)} checks; "
          f"{args.clients} clients x Lookup of {args.hashes} hashes)")
    print(f"lookup:        p50 {pct(lookups, 0.5):.1f} ms  mean {statistics.mean(lookups) * 1000:.1f} ms  "
          f"({len(lookups)} calls)")


if __name__ == "__main__":
    main()
