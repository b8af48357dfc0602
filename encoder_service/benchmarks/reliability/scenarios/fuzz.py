"""Fuzzing Encode: hypothesis over every EncodeRequest field and over image bytes (truncated, corrupt,
bombs of pixels, JPEG scans, WebP memory and PNG chunks, animated, 16-bit, CMYK, EXIF-rotated), plus
fixed hostile cases (huge ids, thousands of images, tiny chunks). Every call has a deadline. 0 crashes,
0 INTERNAL/UNKNOWN, 0 hangs, responses bounded by the embeddings they carry, and the server healthy
afterwards."""

from __future__ import annotations

import time

import grpc
from encoder_client.protocol import BY_ENUM, encoder_pb2_grpc
from encoder_client.protocol import encoder_pb2 as pb
from hypothesis import HealthCheck, given, settings

from ..fuzz_inputs import CORPUS, encode_requests, mutated_image, sink_targets, texts
from ..result import ScenarioResult
from ..server import ServerSpec, start_server

# Codes a caller's bad input may earn. The fuzzed server allows sinks at 127.0.0.1:* (nothing listens
# on the ports fuzzed), so a well-formed allowed sink earns the uniform UNAVAILABLE after the bound.
EXPECTED = {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "NOT_FOUND", "PERMISSION_DENIED"}
SINK_TIMEOUT_S = 0.5
MAX_MESSAGE_BYTES = 8 << 20


class Caller:
    """Sends raw EncodeRequests; keeps what each one earned."""

    def __init__(self, target: str, timeout_s: float) -> None:
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20),
                                                              ("grpc.max_receive_message_length", 64 << 20)])
        self.stub = encoder_pb2_grpc.VisionEncoderStub(self.channel)
        self.timeout_s = timeout_s
        self.codes: dict[str, int] = {}
        self.problems: list[str] = []
        self.max_overhead = 0.0  # response bytes / embedding bytes, worst seen
        self.slowest_s = 0.0

    def send(self, request: pb.EncodeRequest, label: str) -> tuple[str, list[pb.EmbeddingChunk]]:
        t = time.monotonic()
        chunks: list[pb.EmbeddingChunk] = []
        try:
            chunks = list(self.stub.Encode(request, timeout=self.timeout_s))
            code, details = "OK", ""
        except grpc.RpcError as err:
            code, details = err.code().name, err.details() or ""
        took = time.monotonic() - t
        self.slowest_s = max(self.slowest_s, took)
        self.codes[code] = self.codes.get(code, 0) + 1
        if code == "UNAVAILABLE" and request.sink.target and "did not take the push" in details:
            if took > SINK_TIMEOUT_S + 5:
                self.problems.append(f"{label}: sink failure after {took:.1f} s, over the bound")
        elif code not in EXPECTED:
            self.problems.append(f"{label}: {code} after {took:.1f} s: {details[:160]} "
                                 f"(request {request.ByteSize()} bytes, {len(request.images)} images)")
        if code == "OK":
            self._check_size(request, chunks, label)
        return code, chunks

    def _check_size(self, request: pb.EncodeRequest, chunks: list[pb.EmbeddingChunk], label: str) -> None:
        """Response bytes stay within a small factor of the embedding bytes they carry: the chunk
        header repeated per chunk cannot be blown up by a long request_id or a tiny max_chunk_bytes."""
        if request.sink.target:
            return
        heads = {c.image_index: c for c in chunks if c.last}
        payload = sum(h.num_tokens * h.hidden_size * (BY_ENUM[h.dtype].itemsize if h.dtype in BY_ENUM else 4)
                      for h in heads.values())
        sent = sum(c.ByteSize() for c in chunks)
        if payload:
            overhead = (sent - payload) / payload
            self.max_overhead = max(self.max_overhead, overhead)
            # Per 4096-byte chunk at least: a header of < 600 bytes (256-char id, hash, grid, timing).
            if sent > payload * 1.15 + 1024 * len(heads):
                self.problems.append(f"{label}: {sent} response bytes for {payload} embedding bytes")
        if len(heads) != len(request.images):
            self.problems.append(f"{label}: OK with {len(heads)} of {len(request.images)} images")


def _fixed_cases() -> dict[str, tuple[pb.EncodeRequest, set[str]]]:
    good = pb.Image(encoded=CORPUS["png_rgb"])
    return {
        "decompression bomb": (pb.EncodeRequest(images=[pb.Image(encoded=CORPUS["png_bomb"])]),
                               {"RESOURCE_EXHAUSTED"}),
        "JPEG of 2006 scans": (pb.EncodeRequest(images=[pb.Image(encoded=CORPUS["jpeg_scan_bomb"])]),
                               {"RESOURCE_EXHAUSTED"}),
        "WebP needing 17 bytes a pixel": (pb.EncodeRequest(images=[pb.Image(encoded=CORPUS["webp_canvas_bomb"])]),
                                          {"RESOURCE_EXHAUSTED"}),
        "PNG of 2000 text chunks": (pb.EncodeRequest(images=[pb.Image(encoded=CORPUS["png_chunk_bomb"])]), {"OK"}),
        "animated gif, 300 frames": (pb.EncodeRequest(images=[pb.Image(encoded=CORPUS["gif_animated"])]), {"OK"}),
        "16-bit png": (pb.EncodeRequest(images=[pb.Image(encoded=CORPUS["png_16bit"])]), {"OK"}),
        "cmyk jpeg": (pb.EncodeRequest(images=[pb.Image(encoded=CORPUS["jpeg_cmyk"])]), {"OK"}),
        "every exif orientation": (pb.EncodeRequest(images=[pb.Image(encoded=CORPUS[f"jpeg_exif_{o}"])
                                                            for o in range(1, 9)]), {"OK"}),
        "request_id of 256 characters": (pb.EncodeRequest(request_id="r" * 256, images=[good]), {"OK"}),
        "request_id of 257 characters": (pb.EncodeRequest(request_id="r" * 257, images=[good]),
                                         {"INVALID_ARGUMENT"}),
        "request_id of 1 MB": (pb.EncodeRequest(request_id="r" * (1 << 20), images=[good]),
                               {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}),
        "257 images (cap 256)": (pb.EncodeRequest(images=[good] * 257), {"INVALID_ARGUMENT"}),
        "5000 hash references": (pb.EncodeRequest(images=[pb.Image(content_hash="ab" * 32)] * 5000),
                                 {"INVALID_ARGUMENT"}),
        "max_chunk_bytes 1 with a long request_id": (
            pb.EncodeRequest(request_id="\U0001F600" * 256, max_chunk_bytes=1, images=[good] * 4), {"OK"}),
        "max_chunk_bytes 2^32-1": (pb.EncodeRequest(max_chunk_bytes=2**32 - 1, images=[good]), {"OK"}),
        "unknown output dtype": (pb.EncodeRequest(output_dtype=77, images=[good]), {"INVALID_ARGUMENT"}),
    }


def run(*, max_examples: int = 200, image_examples: int = 200, call_timeout_s: float = 30.0,
        spec: ServerSpec = ServerSpec(), log_dir=None, seed: int | None = 0) -> ScenarioResult:
    result = ScenarioResult("fuzz")
    server = start_server("--max-batch-tokens", "4096", "--max-message-bytes", str(MAX_MESSAGE_BYTES),
                          "--max-image-pixels", "4000000", "--allowed-sinks", "127.0.0.1:*",
                          "--sink-timeout-s", str(SINK_TIMEOUT_S), spec=spec, log_dir=log_dir)
    caller = Caller(server.target, call_timeout_s)
    try:
        t0 = time.monotonic()
        for label, (request, expected) in _fixed_cases().items():
            code, _ = caller.send(request, label)
            result.check(f"{label}: {' or '.join(sorted(expected))}", code in expected, code)

        common = dict(deadline=None, database=None, derandomize=seed is not None,
                      suppress_health_check=list(HealthCheck), print_blob=True)

        @settings(max_examples=max_examples, **common)
        @given(encode_requests())
        def every_field(request):
            caller.send(request, "request")
            assert server.alive(), "the server died"

        @settings(max_examples=image_examples, **common)
        @given(mutated_image())
        def image_bytes(data):
            caller.send(pb.EncodeRequest(images=[pb.Image(encoded=data)]), f"image of {len(data)} bytes")
            assert server.alive(), "the server died"

        @settings(max_examples=max(10, max_examples // 4), **common)
        @given(sink_targets, texts)
        def sink_fields(target, sink_request_id):
            request = pb.EncodeRequest(images=[pb.Image(encoded=CORPUS["jpeg_rgb"])])
            request.sink.target, request.sink.request_id = target, sink_request_id
            caller.send(request, f"sink {target!r}")
            assert server.alive(), "the server died"

        for name, test in (("every EncodeRequest field", every_field), ("image bytes", image_bytes),
                           ("sink targets", sink_fields)):
            try:
                test()
                result.check(f"hypothesis over {name}: the server survived", True)
            except Exception as exc:  # hypothesis re-raises the falsifying example's error
                result.check(f"hypothesis over {name}: the server survived", False, f"{type(exc).__name__}: {exc}")
        elapsed = time.monotonic() - t0

        result.figure("calls", sum(caller.codes.values()))
        for code, n in sorted(caller.codes.items()):
            result.figure(f"code_{code.lower()}", n)
        result.figure("slowest_call_s", caller.slowest_s)
        result.figure("max_response_overhead_pct", 100 * caller.max_overhead)
        result.figure("fuzz_s", elapsed)
        result.check("no INTERNAL, UNKNOWN, hang (deadline) or other unexpected status; responses bounded",
                     not caller.problems, "; ".join(caller.problems[:5]))
        healthy = server.alive() and server.health() == "SERVING"
        code, _ = caller.send(pb.EncodeRequest(images=[pb.Image(encoded=CORPUS["jpeg_rgb"])]), "after")
        result.check("the server is SERVING and encodes a normal image afterwards", healthy and code == "OK")
        result.check("no traceback in the server log", "Traceback" not in server.log_text())
    finally:
        caller.channel.close()
        server.stop()
    return result
