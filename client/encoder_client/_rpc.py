"""What the sync and async clients share: channel options, retry policy, the health-check codec."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_RETRIES = 3
MAX_GRPC_INT_OPTION = 2**31 - 1
# gRPC clamps a retryPolicy's maxAttempts at 5 (gRFC A6; no channel argument raises it), so at
# most 4 retries: more are clamped here rather than by the C core (which logs an error for it).
MAX_GRPC_ATTEMPTS = 5
RETRYABLE_CODES = ("UNAVAILABLE",)

HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"
# grpc.health.v1.HealthCheckResponse.ServingStatus
SERVING_STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


@dataclass(frozen=True)
class RetryPolicy:
    """Retries on UNAVAILABLE only, with exponential backoff, done by gRPC itself.

    UNAVAILABLE is what a server says while starting or draining, and what the channel says when
    it cannot connect: the request did no work, so sending it again is safe. Every other code is
    an answer (bad input, not found, overloaded, deadline) that a retry would not change or
    would make worse.

    The policy becomes the channel's service config (``service_config``), so gRPC's C core runs
    the retries: the n-th retry waits ``min(backoff_base_s * 2**(n-1), backoff_max_s)``, jittered
    by +-20%; a call whose response has started (response headers or a message received) is
    committed and never retried; every attempt lives within the call's one deadline, so retries
    never extend it; and a server's ``grpc-retry-pushback-ms`` is honoured. ``retries`` above 4 is
    clamped to 4 (gRPC's limit of 5 attempts).
    """

    retries: int = DEFAULT_RETRIES
    backoff_base_s: float = 0.1
    backoff_max_s: float = 5.0

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.backoff_base_s < 0 or self.backoff_max_s < 0:
            raise ValueError(f"backoff_base_s and backoff_max_s must be >= 0, got {self.backoff_base_s} "
                             f"and {self.backoff_max_s}")

    @property
    def max_attempts(self) -> int:
        """Attempts gRPC makes, the first included."""
        return min(self.retries + 1, MAX_GRPC_ATTEMPTS)

    def service_config(self) -> dict[str, Any] | None:
        """The service config carrying this policy for every method of the channel (None: no retries)."""
        if self.max_attempts < 2:
            return None  # gRPC requires maxAttempts >= 2; without a policy nothing is retried
        return {
            "methodConfig": [{
                "name": [{}],  # every service and method on the channel: Encode, Lookup, ..., Health
                "retryPolicy": {
                    "maxAttempts": self.max_attempts,
                    # gRPC's first retry waits initialBackoff as is, later ones are capped at
                    # maxBackoff; both must be > 0 (0 here means "at once": 1 ns).
                    "initialBackoff": _duration(min(self.backoff_base_s, self.backoff_max_s)),
                    "maxBackoff": _duration(self.backoff_max_s),
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": list(RETRYABLE_CODES),
                },
            }],
        }

    def channel_options(self, max_message_bytes: int) -> list[tuple[str, Any]]:
        config = self.service_config()
        if config is None:
            return []
        return [
            ("grpc.enable_retries", 1),
            ("grpc.service_config", json.dumps(config)),
            # gRPC keeps a call's request for a retry only while it fits this buffer (256 KiB by
            # default), and commits the call (no retry) once it does not: images are megabytes.
            ("grpc.per_rpc_retry_buffer_size", max_message_bytes),
            # The retry policy is this client's arguments, never a DNS TXT record's.
            ("grpc.service_config_disable_resolution", 1),
        ]


def _duration(seconds: float) -> str:
    """A protobuf JSON Duration, > 0 as gRPC requires."""
    return f"{max(seconds, 1e-9):.9f}s"


def build_channel_options(max_message_bytes: int, extra: Sequence[tuple[str, Any]],
                          retry: RetryPolicy | None = None) -> list[tuple[str, Any]]:
    if not 0 < max_message_bytes <= MAX_GRPC_INT_OPTION:
        raise ValueError(f"max_message_bytes must be in 1..{MAX_GRPC_INT_OPTION}, got {max_message_bytes}")
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        *(retry.channel_options(max_message_bytes) if retry is not None else ()),
    ]
    # A caller's extra options override these: gRPC keeps the first of two options with one key,
    # so ours of the same key are left out.
    overridden = {key for key, _ in extra}
    return [option for option in options if option[0] not in overridden] + list(extra)


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
