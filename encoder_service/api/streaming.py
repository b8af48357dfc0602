"""One image's embedding -> EmbeddingChunk messages of whole rows, each within the byte budget.

``serialized_chunks`` is the streaming path: it writes each chunk's wire bytes itself, the small
header through protobuf and the ``data`` field as a tag, a length and the embedding's own bytes, so
the embedding is copied once per chunk (into the joined message) instead of into a bytes object,
a message and its serialization. A cached embedding in the requested dtype is sent from its own
memory: chunks are views of it until that join.
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Executor
from typing import TYPE_CHECKING

import numpy as np
from encoder_client.protocol import BY_NAME, encoder_pb2
from encoder_client.protocol.chunks import data_field_prefix
from encoder_client.protocol.chunks import row_bytes as wire_row_bytes

if TYPE_CHECKING:  # the relay processes (api/relay/process.py) use this module without the engine and torch
    from ..engine import ImageResult

# Responses from this size on are copied into their chunks (or the caller's shared memory) in
# threads beside the event loop (``built_off_loop``); below it the thread hop costs more than
# the copy. A real model's embedding is far above it (8.8 MB for a 7B at 1008x1008, 0.46 MB at
# 224x224); the tiny test models' larger images are above it too, so the server tests go this way.
OFF_LOOP_MIN_BYTES = 32 * 1024
# ... except a lone call's one-image, one-chunk response in the model's dtype (the only call in flight,
# and no image in the engine: api/servicer.py): built right on the event loop, which has nothing else to
# do. The thread hops cost more than they save there: built off the loop, a one-chunk response goes to
# a thread, back, to the thread again (for the end of its chunks) and back, and a thread idle for a while
# wakes slowly (a loop-to-thread round trip took 59 us back to back and 379 us after 50 ms of quiet on an
# H200 host). On the CPU host, lone images 50 ms apart, from the engine's answer to the client's results:
# 3.0 -> 1.8 ms at 448x448, 6.5 -> 4.1 ms at 1008x1008 (bench/RESULTS.md). Several chunks stay in a
# thread, built one ahead of their writes; so does a conversion to another dtype (a pass over the rows).
# The bounds are the loop stall a lone call may cause a call that arrives meanwhile, once: a copy into a
# registered region, whose pages the server mapped when it was registered (api/caller_regions.py), of
# at most ALONE_REGION_BYTES (16 MiB: 1.4-5 ms on the CPU host, still in pieces beside the loop's own:
# copy_in_slices); a stream chunk of at most ALONE_STREAM_BYTES, a new bytes object whose pages may all
# fault after the server's idle trim (16 MiB took 9.5 ms median, 46 ms at worst, that way; 2 MiB holds
# a 448x448 image's 1.8 MB).
ALONE_REGION_BYTES = 16 << 20
ALONE_STREAM_BYTES = 2 << 20


def _template(result: ImageResult, name: str, request_id: str) -> encoder_pb2.EmbeddingChunk:
    """The fields every chunk of this image repeats."""
    return encoder_pb2.EmbeddingChunk(
        request_id=request_id, image_index=result.index, content_hash=result.content_hash,
        grid_thw=list(result.grid), num_tokens=result.num_tokens, hidden_size=result.hidden_size,
        dtype=BY_NAME[name].enum, cache_hit=result.cache_hit,
        # Set only for extra levels: a model without them keeps the field off the wire (0 means 1).
        feature_levels=result.feature_levels if result.feature_levels > 1 else 0)


# What only an image's last chunk carries.
LAST_CHUNK_FIELDS = ("timing", "frame_indices", "frame_timestamps_s", "sampled_frame_indices")


def _last_fields(result: ImageResult) -> encoder_pb2.EmbeddingChunk:
    """The fields of an image's last chunk: the server's timing and, for a clip, its frames."""
    t = result.timing
    last = encoder_pb2.EmbeddingChunk(timing=encoder_pb2.ServerTiming(
        queue_ms=t.queue_ms, preprocess_ms=t.preprocess_ms, forward_ms=t.forward_ms))
    if result.clip is not None:
        last.frame_indices.extend(result.clip.indices)
        last.frame_timestamps_s.extend(result.clip.timestamps_s)
        last.sampled_frame_indices.extend(result.clip.sampled)
    return last


def _headers(template: encoder_pb2.EmbeddingChunk, last_fields: encoder_pb2.EmbeddingChunk | None, row_bytes: int,
             max_chunk_bytes: int) -> Iterator[tuple[encoder_pb2.EmbeddingChunk, int, int]]:
    """Each chunk's message without ``data``, with its row range [start, stop): whole rows (every
    feature level of a token), at least one per chunk whatever the budget; the last one carries the
    server's timing and a clip's frames (``last_fields``)."""
    num_tokens = template.num_tokens
    rows_per_chunk = max(1, max_chunk_bytes // max(1, row_bytes))
    start = 0
    while True:
        stop = min(num_tokens, start + rows_per_chunk)
        last = stop >= num_tokens
        header = encoder_pb2.EmbeddingChunk()
        header.CopyFrom(template)
        header.token_offset = start
        header.last = last
        if last and last_fields is not None:
            header.MergeFrom(last_fields)
        yield header, start, stop
        if last:
            return
        start = stop


def _row_bytes(result: ImageResult, name: str) -> int:
    return result.row_width * BY_NAME[name].itemsize


def embedding_chunks(result: ImageResult, *, request_id: str, out_dtype: str | None, model_dtype: str,
                     max_chunk_bytes: int) -> Iterator[encoder_pb2.EmbeddingChunk]:
    name = out_dtype or model_dtype
    data = result.wire_bytes(name)
    row_bytes = _row_bytes(result, name)
    for chunk, start, stop in _headers(_template(result, name, request_id), _last_fields(result), row_bytes,
                                       max_chunk_bytes):
        chunk.data = bytes(data[start * row_bytes:stop * row_bytes])
        yield chunk


def region_chunk(result: ImageResult, *, request_id: str, out_dtype: str | None, model_dtype: str,
                 offset: int, length: int) -> bytes:
    """The one chunk (wire bytes) of an image written into the caller's shared-memory region."""
    name = out_dtype or model_dtype
    header = _template(result, name, request_id)
    header.last = True
    header.MergeFrom(_last_fields(result))
    header.region_offset = offset
    header.region_bytes = length
    return header.SerializeToString()


def serialize_chunk(chunk: bytes | encoder_pb2.EmbeddingChunk) -> bytes:
    """The Encode response serializer: chunks from ``serialized_chunks`` are already bytes."""
    return chunk if isinstance(chunk, bytes) else chunk.SerializeToString()


def serialized_chunks(result: ImageResult, *, request_id: str, out_dtype: str | None, model_dtype: str,
                      max_chunk_bytes: int, data: memoryview | None = None) -> Iterator[bytes]:
    """Like ``embedding_chunks``, as wire bytes (see the module docstring); parses to the same
    messages. ``data``: ``result.wire_bytes`` already taken (on the event loop: it may touch the cache)."""
    name = out_dtype or model_dtype
    yield from _serialized(_template(result, name, request_id), _last_fields(result),
                           result.wire_bytes(name) if data is None else data, _row_bytes(result, name),
                           max_chunk_bytes)


def rows_on_stream(header: encoder_pb2.EmbeddingChunk, rows: memoryview | np.ndarray,
                   max_chunk_bytes: int) -> Iterator[bytes]:
    """An image whose rows were written into a shared-memory region (``header`` is its region
    chunk, ``rows`` the bytes it points at) as the chunks (wire bytes) ``serialized_chunks`` gives
    for it on the stream: what a relay process (api/relay/process.py) sends its caller."""
    template = encoder_pb2.EmbeddingChunk()
    template.CopyFrom(header)
    last_fields = encoder_pb2.EmbeddingChunk()
    for name in LAST_CHUNK_FIELDS:
        if name != "timing" or header.HasField("timing"):
            getattr(last_fields, name).MergeFrom(getattr(header, name))
    for name in ("region_offset", "region_bytes", "last", "token_offset", "data", *LAST_CHUNK_FIELDS):
        template.ClearField(name)
    yield from _serialized(template, last_fields, rows, wire_row_bytes(header), max_chunk_bytes)


def _serialized(template: encoder_pb2.EmbeddingChunk, last_fields: encoder_pb2.EmbeddingChunk | None,
                data: memoryview | np.ndarray, row_bytes: int, max_chunk_bytes: int) -> Iterator[bytes]:
    data = np.frombuffer(data, np.uint8)
    for header, start, stop in _headers(template, last_fields, row_bytes, max_chunk_bytes):
        payload = data[start * row_bytes:stop * row_bytes]
        prefix = header.SerializeToString()
        if len(payload):  # proto3 leaves an empty bytes field off the wire
            prefix += data_field_prefix(len(payload))
        yield _message(prefix, payload)


# The embedding's bytes are copied into each message without holding the GIL: ``b"".join`` holds
# it for the whole copy, and under load (megabytes per image, on the event loop) that copy was a
# quarter of the time the front end held the GIL, starving the threads that feed the devices
# (bench/RESULTS.md, "Several GPUs on one node"). No library offers "bytes from buffers without
# the GIL", so this is our own: ``PyBytes_FromStringAndSize(NULL, n)`` is CPython's documented way
# to get a bytes object to fill before it is shared, and ctypes' ``memmove`` releases the GIL.
_GIL_FREE_BYTES = sys.implementation.name == "cpython"
if _GIL_FREE_BYTES:
    _new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
    _new_bytes.restype = ctypes.py_object
    _new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    _BYTES_DATA_OFFSET = bytes.__basicsize__ - 1  # PyBytesObject.ob_sval
GIL_FREE_MIN_BYTES = 64 * 1024  # below it a join is cheaper than two ctypes calls


def _message(prefix: bytes, payload: np.ndarray) -> bytes:
    """prefix + payload (contiguous uint8) as one new bytes object."""
    n = len(payload)
    if not _GIL_FREE_BYTES or n < GIL_FREE_MIN_BYTES:
        return b"".join((prefix, payload))
    out = _new_bytes(None, len(prefix) + n)
    start = id(out) + _BYTES_DATA_OFFSET
    ctypes.memmove(start, prefix, len(prefix))
    ctypes.memmove(start + len(prefix), payload.ctypes.data, n)
    return out


async def built_off_loop(chunks: Iterator[bytes], executor: Executor) -> AsyncIterator[bytes]:
    """``chunks``, each built in ``executor`` one ahead of the consumer (the next chunk's copy runs
    while the caller writes this one).

    Building a chunk copies megabytes (~1 ms per 9.3 MB image). The copy releases the GIL, but on
    the event loop's thread it still stops the loop, and that one thread serves every call. Only the
    copies move: the caller takes ``wire_bytes`` on the loop, where the cache lives.
    A consumer that stops early leaves ``chunks`` closed once the build under way is done."""
    future = executor.submit(next, chunks, None)
    try:
        while (chunk := await asyncio.wrap_future(future)) is not None:
            future = executor.submit(next, chunks, None)
            yield chunk
    finally:
        # Now if that build is done or was cancelled before it started, else in its thread right
        # after it: a generator cannot be closed while another thread runs it.
        future.add_done_callback(lambda _: chunks.close())
