"""What the sync and async clients share: channel options, retry policy, the health-check codec."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_RETRIES = 3
MAX_GRPC_INT_OPTION = 2**31 - 1

HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"
# grpc.health.v1.HealthCheckResponse.ServingStatus
SERVING_STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def build_channel_options(max_message_bytes: int, extra: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    if not 0 < max_message_bytes <= MAX_GRPC_INT_OPTION:
        raise ValueError(f"max_message_bytes must be in 1..{MAX_GRPC_INT_OPTION}, got {max_message_bytes}")
    # Extra options come last so a caller can override these.
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        *extra,
    ]


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter, for UNAVAILABLE only.

    UNAVAILABLE is what a server says while starting or draining, and what the channel says when
    it cannot connect: the request did no work, so sending it again is safe. Every other code is
    an answer (bad input, not found, overloaded, deadline) that a retry would not change or
    would make worse.
    """

    retries: int = DEFAULT_RETRIES
    backoff_base_s: float = 0.1
    backoff_max_s: float = 5.0

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")

    def delay_s(self, attempt: int) -> float | None:
        """Seconds to wait before retry number ``attempt + 1``, or None when retries are spent."""
        if attempt >= self.retries:
            return None
        ceiling = min(self.backoff_max_s, self.backoff_base_s * (2**attempt))
        # Jitter spreads clients that failed together (a server restart) so they do not return
        # together; the floor at half keeps the backoff a backoff.
        return ceiling * random.uniform(0.5, 1.0)

    def retry_delay_s(self, err: grpc.RpcError, attempt: int, deadline_s: float | None) -> float | None:
        """The wait before retrying after err, or None when err must be raised."""
        code = err.code() if hasattr(err, "code") else None
        if code != grpc.StatusCode.UNAVAILABLE:
            return None
        delay = self.delay_s(attempt)
        if delay is None:
            return None
        if deadline_s is not None and time.monotonic() + delay >= deadline_s:
            return None  # no time left for another attempt: the UNAVAILABLE is the truthful answer
        return delay


def deadline_after(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else time.monotonic() + timeout_s


def remaining_s(deadline_s: float | None) -> float | None:
    # Each attempt gets what is left of the call's deadline, so retries never extend it.
    return None if deadline_s is None else max(deadline_s - time.monotonic(), 0.0)


# grpc.health.v1 messages, hand-encoded: grpcio-health-checking is a server dependency, and
# these two messages are one string field and one enum field.
def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def encode_health_request(service: str) -> bytes:
    """HealthCheckRequest{service}: field 1, length-delimited (empty string = omitted)."""
    data = service.encode()
    return b"\x0a" + _varint(len(data)) + data if data else b""


def decode_health_response(buf: bytes) -> str:
    """HealthCheckResponse -> status name; unknown fields are skipped as protobuf requires."""
    status, pos = 0, 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _read_varint(buf, pos)
            if field == 1:
                status = value
        elif wire_type == 2:
            length, pos = _read_varint(buf, pos)
            pos += length
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire_type} in HealthCheckResponse")
    if pos > len(buf):
        raise ValueError("truncated HealthCheckResponse")
    return SERVING_STATUS_NAMES.get(status, f"STATUS_{status}")
