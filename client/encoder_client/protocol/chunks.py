"""EmbeddingChunk on the wire with its ``data`` field kept out of protobuf: the payload is written
and read as a slice of the message's own bytes.

An embedding is megabytes (9.3 MB for a 1008x1008 image of Qwen2.5-VL-7B, 33.5 MB with Qwen3-VL's
deepstack levels). Through protobuf each chunk's payload is copied three more times than needed:
into a bytes object, into the message and into its serialization on the sender; out of the
received bytes by the parser, and again on every read of ``chunk.data`` on the receiver. Measured
on one thread of a 2-core machine, those receiver copies took 2-3 ms of a 9.3 MB image, a fifth to
a third of a cache hit.

- Sending: ``data_field_prefix(n)`` is the tag and length that precede an ``n``-byte payload, so
  a sender writes header + prefix + payload in one copy (``encoder_service.api.streaming``).
- Receiving: ``parse_chunk`` is the Encode (and Push) response deserializer. It finds the payload
  by walking the message's top-level fields (a dozen varints), parses only the header bytes with
  protobuf, and returns a ``ReceivedChunk``: the header's fields, with ``data`` a read-only
  memoryview of the received bytes (which gRPC hands over and nobody else holds).

Any message protobuf accepts is accepted here with the same meaning; what the walk does not
expect (a repeated ``data`` field, a group, a truncated field) goes to protobuf whole, which
parses or rejects it as the generated deserializer would.
"""

from __future__ import annotations

from typing import Any

from encoder_client.protocol.dtypes import BY_ENUM
from encoder_client.protocol.stubs import encoder_pb2

DATA_FIELD = encoder_pb2.EmbeddingChunk.DESCRIPTOR.fields_by_name["data"].number
_LENGTH_DELIMITED = 2
_DATA_TAG = (DATA_FIELD << 3) | _LENGTH_DELIMITED  # one byte while DATA_FIELD < 16


def varint(n: int) -> bytes:
    """``n`` (>= 0) as a protobuf varint."""
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if not n:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def data_field_prefix(nbytes: int) -> bytes:
    """The bytes before an ``nbytes`` payload of EmbeddingChunk.data: its tag and length. Appended
    to a serialized header, then the payload, it gives the message with that ``data``. (proto3
    leaves an empty bytes field off the wire: for 0, send no prefix and no payload.)"""
    return varint(_DATA_TAG) + varint(nbytes)


def row_bytes(chunk) -> int:
    """Bytes of one row of a chunk's image on the wire: every feature level of one token, in the
    chunk's dtype (``feature_levels`` 0 means 1)."""
    return chunk.hidden_size * max(1, chunk.feature_levels) * BY_ENUM[chunk.dtype].itemsize


class ReceivedChunk:
    """A received EmbeddingChunk: every field of ``header`` (attribute access and ``HasField``
    reach it), with ``data`` a read-only memoryview into the received message."""

    __slots__ = ("data", "header")

    def __init__(self, header: encoder_pb2.EmbeddingChunk, data: memoryview | bytes) -> None:
        self.header = header
        self.data = data

    def __getattr__(self, name: str) -> Any:  # only for names not in __slots__: the header's
        return getattr(self.header, name)

    def __repr__(self) -> str:
        return f"ReceivedChunk({self.header!r}, data=<{len(self.data)} bytes>)"


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while shift < 64:
        byte = buf[pos]  # IndexError past the end: the caller falls back to protobuf
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise ValueError("varint over 10 bytes")


def _data_span(raw: bytes) -> tuple[int, int, int] | None:
    """(field start, payload start, payload end) of the one ``data`` field, None when there is
    none, and ValueError/IndexError for anything the walk does not handle."""
    pos, end, span = 0, len(raw), None
    while pos < end:
        start = pos
        tag, pos = _read_varint(raw, pos)
        wire_type = tag & 7
        if wire_type == 0:
            _, pos = _read_varint(raw, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == _LENGTH_DELIMITED:
            length, pos = _read_varint(raw, pos)
            if tag >> 3 == DATA_FIELD:
                if span is not None:
                    raise ValueError("data field repeated")  # protobuf's rule (the last wins) applies
                span = (start, pos, pos + length)
            pos += length
        else:
            raise ValueError(f"wire type {wire_type}")  # groups: protobuf's business
        if pos > end:
            raise ValueError("field past the end")
    return span


def parse_chunk(raw: bytes) -> ReceivedChunk:
    """An EmbeddingChunk from its wire bytes, the payload not copied (see the module docstring)."""
    try:
        span = _data_span(raw)
    except (ValueError, IndexError):
        whole = encoder_pb2.EmbeddingChunk.FromString(raw)  # parses it as protobuf does, or raises
        return ReceivedChunk(whole, whole.data)
    if span is None:
        return ReceivedChunk(encoder_pb2.EmbeddingChunk.FromString(raw), b"")
    field_start, data_start, data_end = span
    # Only the header's bytes are copied: a sender puts the payload last (ours) or anywhere else,
    # and the bytes around it are a few dozen.
    header = encoder_pb2.EmbeddingChunk.FromString(raw[:field_start] + raw[data_end:])
    return ReceivedChunk(header, memoryview(raw)[data_start:data_end])
