"""What the sync and async clients share: their base (arguments, channel, stubs), channel options,
retry policy, the health status and the requests built before a call."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from encoder_client.dtypes import BF16_AS
from encoder_client.errors import EncoderClientError
from encoder_client.protocol import ModelInfo, encoder_pb2, encoder_pb2_grpc
from encoder_client.protocol.chunks import parse_chunk
from encoder_client.security import call_metadata
from encoder_client.shared_memory import (
    AUTO_INITIAL_BYTES,
    AUTO_MAX_TOTAL_BYTES,
    DEFAULT_INITIAL_BYTES,
    RegionPool,
    RegionsExhausted,
    Registrar,
    region_refused,
    same_host_target,
    sealing_supported,
)

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_RETRIES = 3
MAX_GRPC_INT_OPTION = 2**31 - 1
# gRPC clamps a retryPolicy's maxAttempts at 5 (gRFC A6; no channel argument raises it), so at
# most 4 retries: more are clamped here rather than by the C core (which logs an error for it).
MAX_GRPC_ATTEMPTS = 5
RETRYABLE_CODES = ("UNAVAILABLE",)
_SERVICE = encoder_pb2.DESCRIPTOR.services_by_name["VisionEncoder"]
ENCODE_METHOD = f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name['Encode'].name}"


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


def health_status_name(response: health_pb2.HealthCheckResponse) -> str:
    """The status's name: SERVING, NOT_SERVING, SERVICE_UNKNOWN or UNKNOWN; one added to
    grpc.health.v1 after this client's grpcio-health-checking reads as ``STATUS_<n>`` (proto3 enums
    are open, so such a value parses)."""
    try:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    except ValueError:
        return f"STATUS_{response.status}"


class ClientBase:
    """What EncoderClient and AsyncEncoderClient share: their arguments (documented on
    EncoderClient), the channel and its stubs, and the requests they build before a call.

    A subclass names the module that makes its channels: ``grpc`` or ``grpc.aio``.
    """

    _channels: ClassVar[ModuleType]
    # Options of the subclass's channel surface, before the caller's (which override them, except
    # gRPC's SingleThreadedUnaryStream: any value of that key turns it on).
    _surface_options: ClassVar[tuple[tuple[str, Any], ...]] = ()

    def __init__(
        self,
        target: str,
        *,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        retries: int = DEFAULT_RETRIES,
        backoff_base_s: float = 0.1,
        backoff_max_s: float = 5.0,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: Sequence[tuple[str, str]] | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        token: str | None = None,
        shared_memory: bool | str = "auto",
        shared_memory_bytes: int = DEFAULT_INITIAL_BYTES,
    ) -> None:
        self.target = target
        if shared_memory not in (True, False, "auto"):
            raise ValueError(f"shared_memory must be True, False or 'auto', got {shared_memory!r}")
        # "auto": on this host, try; at the first refusal, stream for good (see _stream_from_now_on).
        self._shared_memory_auto = shared_memory == "auto"
        if shared_memory is True:
            self._regions = RegionPool(shared_memory_bytes)
        elif self._shared_memory_auto and same_host_target(target):
            initial = AUTO_INITIAL_BYTES if shared_memory_bytes == DEFAULT_INITIAL_BYTES else shared_memory_bytes
            self._regions = RegionPool(initial, max_total_bytes=AUTO_MAX_TOTAL_BYTES)
        else:
            self._regions = None
        self.timeout_s = timeout_s
        self._retry = RetryPolicy(retries, backoff_base_s, backoff_max_s)
        self._metadata = call_metadata(metadata, token)
        options = build_channel_options(max_message_bytes, [*self._surface_options, *channel_options], self._retry)
        self._channel = (
            self._channels.secure_channel(target, credentials, options=options)
            if credentials is not None
            else self._channels.insecure_channel(target, options=options)
        )
        self._stub = encoder_pb2_grpc.VisionEncoderStub(self._channel)
        # Encode as the generated stub has it, but each chunk's rows are read in place (not copied
        # by protobuf): see encoder_client.protocol.chunks.
        self._encode_rpc = self._channel.unary_stream(
            ENCODE_METHOD, request_serializer=encoder_pb2.EncodeRequest.SerializeToString,
            response_deserializer=parse_chunk)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._cache_namespace: str | None = None
        # Whether GetModelInfo was asked for the server's region socket (once, before the first call
        # that lends a region: see encoder_client.shared_memory).
        self._socket_asked = self._regions is None
        self._socket_lock = threading.Lock()

    def _timeout(self, timeout_s: float | None) -> float | None:
        return self.timeout_s if timeout_s is None else timeout_s

    @property
    def uses_shared_memory(self) -> bool:
        """Whether Encode calls lend the server a shared-memory region now."""
        return self._regions is not None

    # Status codes of GetModelInfo after which the region socket is asked again at the next call
    # (the server may not be up yet); after any other, never (an older server, no permission).
    _ASK_AGAIN = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED")

    def _use_region_socket(self, info: ModelInfo | None) -> None:
        """After GetModelInfo (None: it failed for good): where the server has a region socket, this
        client's regions are registered sealed memfds from now on."""
        registrar = self._connect_registrar(info)
        self._socket_asked = True
        if registrar is not None:
            self._regions.register_with(registrar)

    def _connect_registrar(self, info: ModelInfo | None) -> Registrar | None:
        """A connection to the region socket ``info`` names, or None (none, or not usable from here)."""
        if info is None or not info.region_socket or self._regions is None or not sealing_supported():
            return None
        if self._cache_namespace is None:
            self._cache_namespace = info.cache_namespace
        try:
            return Registrar(info.region_socket)
        except OSError as exc:  # another network namespace behind a loopback address, say
            log.info("encoder client for %s: the server's region socket is not reachable (%s); regions "
                     "are /dev/shm objects", self.target, exc)
            return None

    def _stream_from_now_on(self, error: BaseException, *, lent_registered: bool = False) -> bool:
        """Whether the call that failed with ``error`` goes again on the stream (the caller then sends
        it without a region). ``lent_registered``: the call lent a registered region.

        A registered region refused (the server restarted since, or dropped it): yes, and later
        regions are /dev/shm objects. Otherwise, with ``shared_memory="auto"``: whether ``error``
        says the server cannot write this process's regions (another host behind the address, shared
        memory off, a full /dev/shm here); if so this client streams from now on (its regions all
        lent, RegionsExhausted: only this call streams). With ``shared_memory=True`` every other
        error is the caller's."""
        refused = isinstance(error, EncoderClientError) and region_refused(error.code.name, error.details)
        if lent_registered and refused:
            regions = self._regions
            if regions is not None and regions.registered:
                log.info("encoder client for %s: the server refused a registered region (%s); regions are "
                         "/dev/shm objects from now on", self.target, error.details)
                regions.stop_registering()
            return True  # (another call may have stopped it first: this one streams all the same)
        if not self._shared_memory_auto:
            return False
        if isinstance(error, RegionsExhausted):
            return True  # the regions are all lent: this call streams, the next may have one
        if isinstance(error, EncoderClientError):
            if not refused:
                return False
        elif not isinstance(error, OSError):
            return False
        regions, self._regions = self._regions, None
        if regions is not None:  # (None: another call got here first)
            log.info("encoder client for %s: streaming responses (shared memory not usable: %s)", self.target,
                     error)
            regions.close()
        return True


def lookup_request(content_hashes: Sequence[str]) -> encoder_pb2.LookupRequest:
    if isinstance(content_hashes, str):
        raise TypeError("content_hashes must be a list of strings")
    return encoder_pb2.LookupRequest(content_hashes=list(content_hashes))


def address_to_sink(request: encoder_pb2.EncodeRequest, sink_target: str, sink_request_id: str | None) -> None:
    """Have the server push request's embeddings to sink_target, filed under sink_request_id (default:
    the request id)."""
    request.sink.target = sink_target
    request.sink.request_id = sink_request_id or request.request_id


def check_bf16_as(bf16_as: str) -> None:
    if bf16_as not in BF16_AS:
        raise ValueError(f"bf16_as must be one of {', '.join(BF16_AS)}, got {bf16_as!r}")
