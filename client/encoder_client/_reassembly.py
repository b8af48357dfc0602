"""Reassembly of the Encode stream: chunks of several images, interleaved, in completion order.

A row on the wire holds ``feature_levels`` levels side by side (the main embedding, then e.g.
Qwen3-VL's deepstack levels), each ``hidden_size`` wide. Rows are placed level-major into one
[levels, num_tokens, hidden_size] buffer as they arrive (the one copy out of the message), so each
level the caller gets is a contiguous view of it. A bf16 image is returned as a view of that buffer
too (``bf16_as="bfloat16"``, the default, or "uint16"), or widened to float32 when asked.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np

from encoder_client.dtypes import bf16_rows_as
from encoder_client.errors import EncoderClientError
from encoder_client.protocol import encoder_pb2
from encoder_client.protocol.dtypes import dtype_name, wire_numpy_dtype
from encoder_client.shared_memory import OutputRegion, RegionPool, SealedRegion, aligned, copy_in_slices
from encoder_client.types import EncodedImage


def _malformed(message: str) -> EncoderClientError:
    # The server broke the contract; INTERNAL, as for any server-side bug, with the client's words.
    return EncoderClientError(grpc.StatusCode.INTERNAL, f"malformed Encode response: {message}")


@dataclass
class _Partial:
    first: encoder_pb2.EmbeddingChunk  # fixes the image's header fields
    rows: np.ndarray  # [feature_levels, num_tokens, hidden_size], wire numpy dtype, filled by token_offset
    filled: np.ndarray  # [num_tokens] bool: which rows have arrived (catches overlaps and gaps)
    rows_received: int = 0
    result: EncodedImage | None = None


class Reassembler:
    """Feed chunks in arrival order; ``results()`` gives the images in request order.

    Each chunk says where its rows go (token_offset), so arrival order within and across images
    does not matter; an image is done when its ``last`` chunk has come and every row is filled.
    """

    def __init__(self, num_images: int, *, bf16_as: str, started_s: float,
                 region: OutputRegion | None = None) -> None:
        self._num_images = num_images
        self._bf16_as = bf16_as
        self._started_s = started_s
        self._region = region  # the call's output_region: chunks with region_bytes point into it
        self._partials: dict[int, _Partial] = {}
        self.chunks_received = 0
        # What the images take in a region (those on the stream included): sizes the next region.
        self.region_bytes_needed = 0

    def add(self, chunk: encoder_pb2.EmbeddingChunk) -> EncodedImage | None:
        """Take one chunk; returns the image it completed, if it completed one."""
        self.chunks_received += 1
        index = chunk.image_index
        if index >= self._num_images:
            raise _malformed(f"image_index {index} but the request has {self._num_images} images")
        part = self._partials.get(index)
        if part is None:
            part = self._start(chunk)
            self._partials[index] = part
        elif (chunk.num_tokens, chunk.hidden_size, chunk.dtype) != (
            part.first.num_tokens, part.first.hidden_size, part.first.dtype
        ):
            raise _malformed(f"image {index}: chunks disagree on num_tokens/hidden_size/dtype")
        elif chunk.feature_levels != part.first.feature_levels:
            raise _malformed(f"image {index}: chunks disagree on feature_levels "
                             f"({_levels(part.first)}, then {_levels(chunk)})")
        if part.result is not None:
            raise _malformed(f"image {index}: chunk after its last chunk")
        self._place(part, chunk)
        if not chunk.last:
            return None
        # One image's chunks travel in order on one stream, so its last chunk must complete it.
        if part.rows_received != part.first.num_tokens:
            raise _malformed(
                f"image {index}: last chunk came with {part.rows_received} of {part.first.num_tokens} rows"
            )
        part.result = self._finish(index, part, chunk)
        return part.result

    def results(self) -> list[EncodedImage]:
        """Every image, in request order; raises if the stream ended before one was complete."""
        out = []
        for index in range(self._num_images):
            part = self._partials.get(index)
            if part is None or part.result is None:
                raise _malformed(f"stream ended before image {index} was complete")
            out.append(part.result)
        return out

    def _start(self, chunk: encoder_pb2.EmbeddingChunk) -> _Partial:
        try:
            np_dtype = wire_numpy_dtype(chunk.dtype)
        except ValueError:
            raise _malformed(f"image {chunk.image_index}: unsupported dtype {chunk.dtype}") from None
        if chunk.hidden_size == 0 and chunk.num_tokens > 0:
            raise _malformed(f"image {chunk.image_index}: hidden_size 0")
        part = _Partial(
            first=chunk,
            rows=np.empty((_levels(chunk), chunk.num_tokens, chunk.hidden_size), dtype=np_dtype),
            filled=np.zeros(chunk.num_tokens, dtype=bool),
        )
        self.region_bytes_needed += aligned(part.rows.nbytes)
        return part

    def _place(self, part: _Partial, chunk: encoder_pb2.EmbeddingChunk) -> None:
        levels, _, hidden = part.rows.shape
        row_bytes = part.rows.dtype.itemsize * hidden * levels
        data = self._region_rows(part, chunk) if chunk.region_bytes else chunk.data
        if not len(data):
            return
        if row_bytes == 0 or len(data) % row_bytes:
            raise _malformed(f"image {chunk.image_index}: {len(data)} bytes is not whole rows")
        n = len(data) // row_bytes
        start = chunk.token_offset
        if start + n > part.first.num_tokens:
            raise _malformed(
                f"image {chunk.image_index}: rows {start}..{start + n} "
                f"past num_tokens {part.first.num_tokens}"
            )
        if part.filled[start:start + n].any():
            raise _malformed(f"image {chunk.image_index}: rows {start}..{start + n} sent twice")
        part.filled[start:start + n] = True
        wire_rows = np.frombuffer(data, dtype=part.rows.dtype).reshape(n, levels, hidden)

        def copy(first: int, stop: int) -> None:
            part.rows[:, start + first:start + stop] = wire_rows[first:stop].transpose(1, 0, 2)

        copy_in_slices(n, row_bytes, copy)
        part.rows_received += n

    def _region_rows(self, part: _Partial, chunk: encoder_pb2.EmbeddingChunk) -> np.ndarray:
        """The image's rows in the call's region (the whole image, in one chunk without data)."""
        index = chunk.image_index
        if self._region is None:
            raise _malformed(f"image {index}: rows in a shared-memory region, but the request lent none")
        if chunk.data or chunk.token_offset or not chunk.last or chunk.region_bytes != part.rows.nbytes:
            raise _malformed(f"image {index}: a region chunk must hold all {part.rows.nbytes} bytes of the "
                             f"image alone (got {chunk.region_bytes} at token_offset {chunk.token_offset})")
        rows = self._region.view(chunk.region_offset, chunk.region_bytes)
        if rows is None:
            raise _malformed(f"image {index}: bytes {chunk.region_offset}..+{chunk.region_bytes} are "
                             f"outside the {self._region.size}-byte region")
        return rows

    def _finish(self, index: int, part: _Partial, last: encoder_pb2.EmbeddingChunk) -> EncodedImage:
        # Native byte order for the caller (a no-op view on little-endian hosts).
        rows = part.rows.astype(part.rows.dtype.newbyteorder("="), copy=False)
        if part.first.dtype == encoder_pb2.DTYPE_BFLOAT16:
            rows = bf16_rows_as(rows, self._bf16_as)  # a view of the buffer, unless float32 is asked
        timing = None
        if last.HasField("timing"):
            t = last.timing
            timing = {"queue_ms": t.queue_ms, "preprocess_ms": t.preprocess_ms, "forward_ms": t.forward_ms}
        return EncodedImage(
            index=index,
            embedding=rows[0],
            deepstack=tuple(rows[1:]),
            content_hash=part.first.content_hash or last.content_hash,
            grid_thw=tuple(part.first.grid_thw),
            num_tokens=part.first.num_tokens,
            hidden_size=part.first.hidden_size,
            cache_hit=part.first.cache_hit,
            dtype=dtype_name(part.first.dtype),
            timing=timing,
            latency_ms=(time.monotonic() - self._started_s) * 1000.0,
            frame_indices=tuple(last.frame_indices),
            frame_timestamps_s=tuple(last.frame_timestamps_s),
            sampled_frame_indices=tuple(last.sampled_frame_indices),
        )


@contextlib.contextmanager
def reassembling(request: encoder_pb2.EncodeRequest, *, bf16_as: str, regions: RegionPool | None,
                 region: OutputRegion | SealedRegion | None = None) -> Iterator[Reassembler]:
    """A Reassembler for one Encode call of ``request``; with ``regions``, the call is lent a
    shared-memory region (``region``, acquired from them already, or one acquired here), set as the
    request's output_region and returned to the pool afterwards."""
    started = time.monotonic()
    if regions is None:
        yield Reassembler(len(request.images), bf16_as=bf16_as, started_s=started)
        return
    region = region if region is not None else regions.acquire()
    request.output_region.CopyFrom(region.proto())
    reassembler = Reassembler(len(request.images), bf16_as=bf16_as, started_s=started, region=region)
    failed = True
    try:
        yield reassembler
        failed = False
    except EncoderClientError as err:
        # A call refused as over a limit before any answer (admission, a full queue, per-client limits)
        # never had a row written: its region is reused, or an overload's refusals (most calls)
        # would each cost a new region (and, registered, a round trip to the busy server).
        failed = not (err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and reassembler.chunks_received == 0)
        raise
    finally:
        # A failed call's region is not reused: the server may not have seen the end of the call yet.
        regions.release(region, needed_bytes=region.header_bytes + reassembler.region_bytes_needed, failed=failed)


def _levels(chunk: encoder_pb2.EmbeddingChunk) -> int:
    return chunk.feature_levels or 1  # 0 on the wire (a model without extra levels) means 1


def check_lookup_response(
    request: encoder_pb2.LookupRequest, response: encoder_pb2.LookupResponse
) -> list[bool]:
    """The cached flags, one per requested hash (a short answer would misalign every flag after it)."""
    if len(response.cached) != len(request.content_hashes):
        raise EncoderClientError(
            grpc.StatusCode.INTERNAL,
            f"malformed Lookup response: {len(response.cached)} flags "
            f"for {len(request.content_hashes)} hashes",
        )
    return list(response.cached)
