"""EmbeddingChunk's wire form with the payload outside protobuf (encoder_client.protocol.chunks):
whatever protobuf parses, ``parse_chunk`` gives the same fields and the same data, without copying
the data; what protobuf rejects, it rejects too."""

from __future__ import annotations

import random

import numpy as np
import pytest
from encoder_client.protocol import encoder_pb2
from encoder_client.protocol.chunks import ReceivedChunk, data_field_prefix, parse_chunk, varint
from google.protobuf.message import DecodeError


def _chunk(rng: random.Random, data: bytes) -> encoder_pb2.EmbeddingChunk:
    chunk = encoder_pb2.EmbeddingChunk(
        request_id=f"req-{rng.randrange(10**6)}", image_index=rng.randrange(300), content_hash="ab" * 32,
        grid_thw=[1, rng.randrange(1, 90), rng.randrange(1, 90)], num_tokens=rng.randrange(1, 5000),
        hidden_size=rng.choice([16, 3584]), dtype=encoder_pb2.DTYPE_BFLOAT16,
        token_offset=rng.randrange(5000), data=data, last=rng.random() < 0.5, cache_hit=rng.random() < 0.5,
        num_images=rng.randrange(3), feature_levels=rng.choice([0, 4]), region_offset=rng.randrange(2**40))
    if chunk.last:
        chunk.timing.CopyFrom(encoder_pb2.ServerTiming(queue_ms=1.5, preprocess_ms=2.5, forward_ms=3.5))
    return chunk


def _same(received: ReceivedChunk, expected: encoder_pb2.EmbeddingChunk) -> None:
    assert bytes(received.data) == expected.data
    rebuilt = encoder_pb2.EmbeddingChunk()
    rebuilt.CopyFrom(received.header)
    rebuilt.data = bytes(received.data)
    assert rebuilt == expected


@pytest.mark.parametrize("size", [0, 1, 127, 128, 70_000, 1 << 20])
def test_a_serialized_chunk_parses_to_the_same_fields_and_data(size):
    rng = random.Random(size)
    expected = _chunk(rng, rng.randbytes(size))
    received = parse_chunk(expected.SerializeToString())
    _same(received, expected)
    # Attribute access and HasField reach the header, as on the message itself.
    assert received.num_tokens == expected.num_tokens and received.last == expected.last
    assert received.HasField("timing") == expected.HasField("timing")


def test_the_data_is_a_view_of_the_received_bytes_not_a_copy():
    payload = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    raw = _chunk(random.Random(0), payload).SerializeToString()
    received = parse_chunk(raw)
    assert isinstance(received.data, memoryview) and received.data.readonly
    assert received.data.obj is raw  # the message gRPC handed over, not a copy of it
    assert np.shares_memory(np.frombuffer(received.data, np.uint8), np.frombuffer(raw, np.uint8))


def test_a_header_then_the_data_prefix_then_the_payload_is_the_message_with_that_data():
    rng = random.Random(1)
    payload = rng.randbytes(300_000)
    header = _chunk(rng, b"")
    raw = header.SerializeToString() + data_field_prefix(len(payload)) + payload
    expected = encoder_pb2.EmbeddingChunk()
    expected.CopyFrom(header)
    expected.data = payload
    assert encoder_pb2.EmbeddingChunk.FromString(raw) == expected
    _same(parse_chunk(raw), expected)


def test_the_data_anywhere_in_the_message_and_repeated_fields_mean_what_protobuf_says():
    rng = random.Random(2)
    head, tail = _chunk(rng, b""), encoder_pb2.EmbeddingChunk(num_tokens=7, grid_thw=[9])
    payload, other = rng.randbytes(5000), rng.randbytes(40)
    middle = head.SerializeToString() + data_field_prefix(len(payload)) + payload + tail.SerializeToString()
    repeated = data_field_prefix(len(other)) + other + middle  # protobuf: the last data wins
    for raw in (middle, repeated, data_field_prefix(len(payload)) + payload):
        _same(parse_chunk(raw), encoder_pb2.EmbeddingChunk.FromString(raw))


@pytest.mark.parametrize("raw", [
    data_field_prefix(100) + b"x" * 99,  # payload cut short
    varint((2 << 3) | 0) + b"\xff",  # varint cut short
    varint((1 << 3) | 2) + varint(5) + b"ab",  # another length-delimited field cut short
    b"\x0f",  # wire type 7 does not exist
])
def test_a_broken_message_is_refused_as_protobuf_refuses_it(raw):
    with pytest.raises(DecodeError):
        encoder_pb2.EmbeddingChunk.FromString(raw)
    with pytest.raises(DecodeError):
        parse_chunk(raw)


def test_unknown_fields_and_an_empty_message_parse_as_protobuf_does():
    unknown = varint((99 << 3) | 2) + varint(3) + b"abc" + varint((98 << 3) | 0) + varint(5)
    for raw in (b"", unknown, unknown + data_field_prefix(4) + b"wxyz"):
        _same(parse_chunk(raw), encoder_pb2.EmbeddingChunk.FromString(raw))
