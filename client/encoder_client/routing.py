"""Many encoders: cache-affine routing by rendezvous hashing, health-aware, with failover.

``RoutingEncoderClient(["enc-0:50051", "enc-1:50051"])`` or
``RoutingEncoderClient("dns:///encoder-headless:50051")`` (a name that resolves to several
addresses, e.g. a Kubernetes headless Service; re-resolved every ``resolve_interval_s``).

Each image goes to the encoder that scores highest for its content hash (rendezvous / highest
random weight hashing: ``sha256(target, hash)``), so a repeated image lands where it is cached, and
when an encoder leaves only the images it owned move. Targets whose health service does not say
SERVING are skipped (checked at most every ``health_interval_s``); an Encode that fails UNAVAILABLE
(an encoder stopping, draining or unreachable) marks that encoder down and its images go to their
next-ranked encoder. One refused for a momentary limit (RESOURCE_EXHAUSTED with a retry pushback
>= 0: its queue is full) stays up, and only that call's images go to their next-ranked encoder;
a request itself over a limit (pushback -1) is raised at once. One request's images are split by
encoder and the parts run in parallel; results come back in request order, ``index`` being the
image's position in the request.
"""

from __future__ import annotations

import dataclasses
import hashlib
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from encoder_client._request import check_images_sequence, content_hash, image_to_proto
from encoder_client.client import EncoderClient
from encoder_client.dtypes import DEFAULT_BF16_AS
from encoder_client.errors import EncoderClientError
from encoder_client.protocol import ModelInfo
from encoder_client.types import EncodedImage, ImageInput

# Codes after which the same request may go to another encoder: it did no lasting work there.
FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE,)


def _full(err: EncoderClientError) -> bool:
    """A momentary refusal (a full queue): the encoder is up, the images may go to the next one."""
    return err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.retry_may_pass


def resolve_targets(targets: str | Sequence[str]) -> list[str]:
    """host:port strings for targets: a comma-separated string or a list, where a ``dns:///host:port``
    entry stands for every address host resolves to (socket.getaddrinfo)."""
    return list(resolve_target_names(targets))


def resolve_target_names(targets: str | Sequence[str]) -> dict[str, str | None]:
    """resolve_targets, each address with the host name it was resolved from (None for a target
    given as is): TLS must check a resolved address's certificate against that name, not the IP."""
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    out: dict[str, str | None] = {}
    for target in targets:
        if target.startswith("dns:"):
            rest = target[len("dns:"):]
            if rest.startswith("//"):
                rest = rest[2:].split("/", 1)[-1]  # dns://[authority]/host:port: the authority is ignored
            host, sep, port = rest.rpartition(":")
            if not sep or not (port.isascii() and port.isdigit()) or not host:
                raise ValueError(f"{target!r}: expected dns:///host:port")
            name = host.strip("[]")
            infos = socket.getaddrinfo(name, int(port), type=socket.SOCK_STREAM)
            for ip in sorted({info[4][0] for info in infos}):
                out.setdefault(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}", name)
        else:
            out.setdefault(target, None)
    if not out:
        raise ValueError("no encoder targets")
    return out


def rendezvous_rank(content_hash: str, targets: Sequence[str]) -> list[str]:
    """targets ordered by preference for content_hash (highest random weight first)."""
    def score(target: str) -> bytes:
        return hashlib.sha256(f"{target}\0{content_hash}".encode()).digest()

    return sorted(targets, key=score, reverse=True)


class RoutingEncoderClient:
    """Synchronous client over several encoders; ``encode`` as EncoderClient.encode.

    ``hash_first`` (default on) asks each encoder's Lookup before sending pixels. ``credentials``
    and ``token`` go to every channel this client opens, so health checks, Lookups and Encodes all
    use TLS and carry the token; with TLS, an address resolved from ``dns:///NAME:PORT`` is checked
    against NAME (its certificate must name the DNS name, not each pod's IP). Extra keyword
    arguments go to each target's EncoderClient (``retries`` defaults to 0 here: failing over to
    the next encoder beats waiting for this one).
    """

    def __init__(self, targets: str | Sequence[str], *, hash_first: bool = True, timeout_s: float | None = 60.0,
                 health_interval_s: float = 2.0, health_timeout_s: float = 1.0, resolve_interval_s: float = 30.0,
                 max_parallel: int = 8, credentials: grpc.ChannelCredentials | None = None,
                 token: str | None = None, **client_kwargs: Any) -> None:
        self._spec = targets
        self.hash_first = hash_first
        self.timeout_s = timeout_s
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.resolve_interval_s = resolve_interval_s
        client_kwargs.setdefault("retries", 0)
        self._credentials = credentials
        self._client_kwargs = {"timeout_s": timeout_s, "credentials": credentials, "token": token, **client_kwargs}
        self._dynamic = any(t.startswith("dns:") for t in ([targets] if isinstance(targets, str) else targets))
        self._lock = threading.Lock()
        self._clients: dict[str, EncoderClient] = {}
        self._health: dict[str, tuple[bool, float]] = {}  # target -> (healthy, checked at)
        self._targets: list[str] = []
        self._names: dict[str, str | None] = {}  # target -> the DNS name it was resolved from
        self._resolved_at = 0.0
        self._namespace: str | None = None
        self._pool = ThreadPoolExecutor(max_parallel, thread_name_prefix="encoder-route")
        self._refresh_targets(force=True)

    def __enter__(self) -> RoutingEncoderClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    @property
    def targets(self) -> list[str]:
        self._refresh_targets()
        return list(self._targets)

    # --- routing ---------------------------------------------------------------------------------
    def route(self, content_hash: str) -> str | None:
        """The encoder content_hash goes to now (None when none is healthy)."""
        healthy = self.healthy_targets()
        return rendezvous_rank(content_hash, healthy)[0] if healthy else None

    def healthy_targets(self) -> list[str]:
        targets = self.targets
        now = time.monotonic()
        stale = [t for t in targets if now - self._health.get(t, (False, -1e9))[1] > self.health_interval_s]
        if stale:
            list(self._pool.map(self._check_health, stale))
        return [t for t in targets if self._health.get(t, (False, 0.0))[0]]

    def mark_down(self, target: str) -> None:
        """Skip target until its next health check says SERVING."""
        self._health[target] = (False, time.monotonic())

    def _check_health(self, target: str) -> None:
        try:
            ok = self._client(target).health(timeout_s=self.health_timeout_s) == "SERVING"
        except EncoderClientError:
            ok = False
        self._health[target] = (ok, time.monotonic())

    def _refresh_targets(self, force: bool = False) -> None:
        if not force and (not self._dynamic or time.monotonic() - self._resolved_at < self.resolve_interval_s):
            return
        try:
            names = resolve_target_names(self._spec)
        except (OSError, ValueError):
            if force or not self._targets:
                raise
            return  # keep the last good answer when the resolver hiccups
        self._names.update(names)
        self._targets, self._resolved_at = list(names), time.monotonic()

    def _client(self, target: str) -> EncoderClient:
        with self._lock:
            client = self._clients.get(target)
            if client is None:
                client = self._clients[target] = EncoderClient(target, **self._target_kwargs(target))
            return client

    def _target_kwargs(self, target: str) -> dict[str, Any]:
        name = self._names.get(target)
        if self._credentials is None or name is None:
            return self._client_kwargs
        # The channel connects to an IP address; TLS checks the certificate against the name.
        options = (("grpc.ssl_target_name_override", name), *self._client_kwargs.get("channel_options", ()))
        return {**self._client_kwargs, "channel_options": options}

    # --- calls -----------------------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        """ModelInfo of a healthy encoder (all of them must serve the same model)."""
        last: EncoderClientError | None = None
        for target in self.healthy_targets() or self.targets:
            try:
                return self._client(target).model_info()
            except EncoderClientError as err:
                last = err
                if err.code in FAILOVER_CODES:
                    self.mark_down(target)
                    continue
                raise
        raise last or EncoderClientError(grpc.StatusCode.UNAVAILABLE, "no encoder is healthy")

    def cache_namespace(self) -> str:
        if self._namespace is None:
            self._namespace = self.model_info().cache_namespace
        return self._namespace

    def encode(self, images: Sequence[ImageInput], *, output_dtype: str | None = None,
               max_chunk_bytes: int | None = None, timeout_s: float | None = None,
               bf16_as: str = DEFAULT_BF16_AS, cache_only: bool = False) -> list[EncodedImage]:
        """Embeddings of images in request order, each computed where its hash routes.
        ``cache_only``: have each encoder encode and cache its images and return their headers
        only (``encoder_client.cache_only``: a PushedImage per image, no rows)."""
        check_images_sequence(images)
        protos = [image_to_proto(i, image) for i, image in enumerate(images)]
        if not protos:
            return []
        namespace = self.cache_namespace()
        hashes = [content_hash(p, namespace) for p in protos]
        deadline = None if (timeout_s or self.timeout_s) is None else time.monotonic() + (timeout_s or self.timeout_s)
        kwargs = ({"hash_first": self.hash_first, "cache_only": True} if cache_only else
                  {"output_dtype": output_dtype, "max_chunk_bytes": max_chunk_bytes, "bf16_as": bf16_as,
                   "hash_first": self.hash_first})
        results: dict[int, EncodedImage] = {}
        tried: dict[int, set[str]] = {i: set() for i in range(len(protos))}
        todo = list(range(len(protos)))
        last_error: EncoderClientError | None = None
        while todo:
            healthy = self.healthy_targets()
            groups: dict[str, list[int]] = {}
            for i in todo:
                ranked = [t for t in rendezvous_rank(hashes[i], healthy) if t not in tried[i]]
                if not ranked:
                    raise last_error or EncoderClientError(
                        grpc.StatusCode.UNAVAILABLE, f"no healthy encoder left for image {i} "
                        f"(targets {', '.join(self.targets)})")
                groups.setdefault(ranked[0], []).append(i)
            futures = {target: self._pool.submit(self._encode_on, target, [protos[i] for i in idx], deadline, kwargs)
                       for target, idx in groups.items()}
            todo = []
            for target, future in futures.items():
                idx = groups[target]
                try:
                    for i, result in zip(idx, future.result(), strict=True):
                        if cache_only:  # PushedImage headers are frozen
                            result = dataclasses.replace(result, index=i)
                        else:
                            result.index = i
                        results[i] = result
                except EncoderClientError as err:
                    if err.code not in FAILOVER_CODES and not _full(err):
                        raise
                    last_error = err
                    if not _full(err):  # a full encoder stays up: only these images move on
                        self.mark_down(target)
                    for i in idx:
                        tried[i].add(target)
                    todo.extend(idx)
            todo.sort()
        return [results[i] for i in range(len(protos))]

    def _encode_on(self, target: str, images: list, deadline: float | None, kwargs: dict) -> list[EncodedImage]:
        timeout_s = None if deadline is None else max(0.0, deadline - time.monotonic())
        if kwargs.get("cache_only"):
            from encoder_client.cache_only import encode_cache_only

            return encode_cache_only(self._client(target), images, timeout_s=timeout_s,  # type: ignore[return-value]
                                     hash_first=kwargs["hash_first"])
        return self._client(target).encode(images, timeout_s=timeout_s, **kwargs)
