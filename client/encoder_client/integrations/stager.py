"""The scheduler side of the vLLM connector, free of torch and vLLM: fetch embeddings from the
encoder service by content hash in background threads, stage them in shared memory, and keep the
books of which request needs which staged item.

The engine's scheduler drives it from one thread (``ensure``, ``is_staged``, ``plan_load``,
``loads_done``, ``release``, ``take_failed``); fetch threads only hand results over through a lock.
A staged file is removed once no request holds it and every load of it dispatched to the workers
has been reported done (a worker may still be copying it otherwise).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any

import grpc
import numpy as np

from encoder_client.errors import EncoderClientError
from encoder_client.integrations.staging import CONTENT_HASH_RE, StagedItem, StagingArea, sweep_stale
from encoder_client.types import HashRef

logger = logging.getLogger(__name__)

PREPROCESS_CHECKS = ("refuse", "warn")
# vLLM's image processor decodes with Pillow; each of its transformers backends has the encoder mode
# that equals it (ModelInfo.preprocess).
ENCODER_MODE_OF_BACKEND = {"torchvision": "torch", "pil": "pil"}


class PreprocessMismatch(ValueError):
    """The encoder cannot give the pixels the engine's own processor gives (preprocess_check refuse)."""


def preprocess_problem(info: Any, engine_mode: str) -> str | None:
    """Why the encoder described by ``info`` (its ModelInfo) cannot equal an engine whose image
    processor is ``engine_mode`` ("pil" or "torch", as ModelInfo.preprocess says), or None."""
    problems = []
    if info.preprocess and info.preprocess != engine_mode:
        problems.append(f"the encoder preprocesses with --preprocess {info.preprocess} but vLLM's image "
                        f"processor is the {'torchvision' if engine_mode == 'torch' else 'PIL'} one, which "
                        f"--preprocess {engine_mode} equals")
    if info.decode and info.decode != "pillow":
        problems.append(f"the encoder decodes with --decode {info.decode} but vLLM decodes with Pillow "
                        "(--decode pillow)")
    if not problems:
        return None
    return ("; ".join(problems) + ": its embeddings differ from what vLLM's own vision tower computes (up to "
            "~1e-3, enough to flip tokens). Restart the encoder with the matching flags, or set "
            "ec_connector_extra_config preprocess_check \"warn\" to go on anyway")


@dataclass(frozen=True)
class ConnectorSettings:
    """``ec_connector_extra_config`` of ``EncoderServiceECConnector``.

    ``encoder``: a target ("host:port"), several (a list or a comma-separated string) or
    "dns:///name:port" (every address the name resolves to; several targets are routed by content
    hash through ``RoutingEncoderClient``). ``timeout_s`` bounds each fetch; ``retries`` is the
    client's retry count on UNAVAILABLE. ``output_dtype``: the dtype asked of the encoder (default:
    ``dtype``, else the model's); ``dtype``: the dtype of the tensors put in vLLM's encoder cache
    (default: the model's). ``tls_ca``/``tls_cert``/``tls_key``: PEM paths (``encoder_client.
    tls_credentials``); ``token`` or ``token_file``: a bearer token. ``fetch_threads``: concurrent
    fetches. ``shm_dir``: where staged files go (default /dev/shm). ``modalities``: the modalities
    this connector serves; other items are left to vLLM. ``shared_memory``: the encoder runs on this
    host with ``--shared-memory on`` and writes each embedding into this process's shared memory
    instead of the gRPC stream (one encoder target only; ``encoder_client.shared_memory``).
    ``preprocess_check``: what to do when the encoder's preprocessing (``ModelInfo.preprocess`` and
    ``decode``) cannot give the pixels vLLM's own image processor gives: ``"refuse"`` (the default:
    the connector does not start; with the encoder unreachable at start-up, every fetch fails
    until it is checked) or ``"warn"`` (log it and go on: embeddings then differ from the engine's
    own by up to ~1e-3, which can flip tokens).
    """

    encoder: Any = "localhost:50051"
    timeout_s: float = 30.0
    retries: int = 3
    output_dtype: str | None = None
    dtype: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token: str | None = None
    token_file: str | None = None
    fetch_threads: int = 8
    shm_dir: str | None = None
    modalities: tuple[str, ...] = ("image",)
    shared_memory: bool = False
    preprocess_check: str = "refuse"

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"EncoderServiceECConnector: unknown ec_connector_extra_config keys {unknown}; "
                             f"known: {sorted(known)}")
        if "modalities" in extra:
            extra["modalities"] = tuple(extra["modalities"])
        settings = cls(**extra)
        if settings.timeout_s <= 0 or settings.fetch_threads < 1:
            raise ValueError("EncoderServiceECConnector: timeout_s must be > 0 and fetch_threads >= 1")
        if settings.preprocess_check not in PREPROCESS_CHECKS:
            raise ValueError(f"EncoderServiceECConnector: preprocess_check must be one of {PREPROCESS_CHECKS}, "
                             f"got {settings.preprocess_check!r}")
        if settings.shared_memory and not settings._one_plain_target():
            raise ValueError("EncoderServiceECConnector: shared_memory needs exactly one encoder target "
                             f"(host:port on this host), got {settings.encoder!r}")
        return settings

    def _one_plain_target(self) -> bool:
        targets = self.targets()
        return len(targets) == 1 and not targets[0].startswith("dns:")

    def targets(self) -> list[str]:
        spec = self.encoder
        items = spec.split(",") if isinstance(spec, str) else list(spec)
        return [t.strip() for t in items if t.strip()]

    def make_client(self):
        """An EncoderClient for one plain target, else a RoutingEncoderClient."""
        from encoder_client import EncoderClient, RoutingEncoderClient, read_token_file, tls_credentials

        creds = None
        if self.tls_ca or self.tls_cert or self.tls_key:
            creds = tls_credentials(ca=self.tls_ca, cert=self.tls_cert, key=self.tls_key)
        token = self.token if self.token is not None else (read_token_file(self.token_file) if self.token_file
                                                           else None)
        targets = self.targets()
        if self._one_plain_target():
            return EncoderClient(targets[0], timeout_s=self.timeout_s, retries=self.retries,
                                 credentials=creds, token=token, shared_memory=self.shared_memory)
        return RoutingEncoderClient(targets, timeout_s=self.timeout_s, credentials=creds, token=token)


@dataclass
class _Entry:
    """One content hash: being fetched (``item`` None), or staged."""

    item: StagedItem | None = None
    holders: set[str] = field(default_factory=set)  # request ids
    loads_pending: int = 0  # worker reports still owed for dispatched loads


def describe_error(err: BaseException, timeout_s: float) -> str:
    """A reason a person can act on, for the log and the failed request."""
    if isinstance(err, EncoderClientError):
        if err.code == grpc.StatusCode.NOT_FOUND:
            # vLLM 0.33 keys an item by the uuid verbatim only without mm_processor_kwargs and
            # media_io_kwargs; with them the key is a blake3/sha256 hexdigest of the uuid and the
            # kwargs: 64 hex digits too, and the engine core no longer sees the kwargs, so the two
            # causes cannot be told apart here.
            return (f"the encoder does not cache this image (NOT_FOUND: {err.details}). Either the encoder "
                    "never encoded it (or evicted it): have it encode the image first, or send the image "
                    "itself through the EPD proxy; or the request carries mm_processor_kwargs or "
                    "media_io_kwargs, with which vLLM hashes the image's uuid into a key that names no "
                    "embedding of the encoder: send the request without them")
        if err.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"the encoder did not answer within {timeout_s:g} s (DEADLINE_EXCEEDED)"
        if err.code == grpc.StatusCode.UNAVAILABLE:
            return f"the encoder is unreachable (UNAVAILABLE: {err.details})"
        return f"the encoder refused it ({err.code.name}: {err.details})"
    return f"{type(err).__name__}: {err}"


class EmbeddingStager:
    """Fetch-and-stage with per-request bookkeeping (see the module's docstring).

    ``reports_per_load``: how many workers report each dispatched load (tensor-parallel ranks).
    """

    def __init__(self, settings: ConnectorSettings, *, output_dtype: str, reports_per_load: int = 1,
                 client: Any = None, log: logging.Logger | None = None, engine_preprocess: str | None = None) -> None:
        self.settings = settings
        self.log = log or logger
        self.output_dtype = output_dtype
        self.reports_per_load = reports_per_load
        self.staging = StagingArea(settings.shm_dir)
        swept = sweep_stale(self.staging.directory)
        if swept:
            self.log.info("encoder-service EC connector: removed %d staged files of dead processes", swept)
        self._client = client if client is not None else settings.make_client()
        self._pool = ThreadPoolExecutor(settings.fetch_threads, thread_name_prefix="ec-fetch")
        self._entries: dict[str, _Entry] = {}
        self._held: dict[str, set[str]] = {}  # request id -> content hashes it holds
        self._done_lock = threading.Lock()
        self._done: list[tuple[str, bool, StagedItem | None, str | None]] = []  # hash, fetched, item, reason
        self._failed: dict[str, str] = {}  # request id -> reason, until taken
        self.reasons: dict[str, str] = {}  # request id -> reason of its failure (last 1000)
        self.stats: Counter[str] = Counter()
        self._closed = False
        self.engine_preprocess = engine_preprocess
        self._check_lock = threading.Lock()
        self._checked = engine_preprocess is None
        self._check_refusal: str | None = None
        if not self._checked:
            self.check_preprocess(at_start=True)

    def check_preprocess(self, at_start: bool = False) -> None:
        """Compare the encoder's preprocessing with the engine's (see ``preprocess_check``). At
        start-up a mismatch raises PreprocessMismatch (refuse) or is logged (warn); an encoder that
        cannot be asked yet is asked again before the first fetch, whose failure then says why."""
        with self._check_lock:
            if self._checked:
                return
            try:
                info = self._client.model_info()
            except Exception as err:  # the encoder may start after vLLM
                if at_start:
                    self.log.warning("encoder-service EC connector: cannot check the encoder's preprocessing "
                                     "yet (%s); it is checked before the first fetch", err)
                    return
                raise
            self._checked = True
            assert self.engine_preprocess is not None
            problem = preprocess_problem(info, self.engine_preprocess)
            if problem is None:
                return
            if self.settings.preprocess_check == "warn":
                self.log.warning("encoder-service EC connector: %s (preprocess_check warn: going on)", problem)
                return
            self._check_refusal = problem
            if at_start:
                self.close()
                raise PreprocessMismatch(f"EncoderServiceECConnector: {problem}")
            self.log.error("encoder-service EC connector: %s (preprocess_check refuse: every fetch fails)",
                           problem)

    # --- the scheduler's calls --------------------------------------------------------------------
    def ensure(self, request_id: str, items: list[tuple[str, int]]) -> bool:
        """True once every (content hash, expected rows) of the request is staged; otherwise start
        what is missing and say False. A request that cannot have its items is reported by
        ``take_failed`` (and this says False for it meanwhile)."""
        self._poll()
        if request_id in self._failed:
            return False
        ready = True
        for content_hash, rows in items:
            if not CONTENT_HASH_RE.match(content_hash):
                self._fail(request_id, f"its image uuid {content_hash[:80]!r} is not an encoder-service content "
                                       "hash (64 hex digits); send the image part's uuid = its content hash")
                return False
            entry = self._entries.get(content_hash)
            if entry is None:
                entry = self._entries[content_hash] = _Entry()
                self._submit(content_hash)
            if request_id not in entry.holders:
                entry.holders.add(request_id)
                self._held.setdefault(request_id, set()).add(content_hash)
            if entry.item is None:
                ready = False
            elif entry.item.shape[0] != rows:
                self._fail(request_id, f"the encoder's embedding of {content_hash[:16]}... has {entry.item.shape[0]} "
                                       f"rows but the prompt has {rows} placeholders for it (another model or "
                                       "preprocessing than vLLM's?)")
                return False
        return ready

    def is_staged(self, content_hash: str) -> bool:
        self._poll()
        entry = self._entries.get(content_hash)
        return entry is not None and entry.item is not None

    def plan_load(self, content_hash: str) -> StagedItem | None:
        """The staged item to load now, pinned until ``loads_done`` reports it (None if not staged)."""
        entry = self._entries.get(content_hash)
        if entry is None or entry.item is None:
            return None
        entry.loads_pending += self.reports_per_load
        return entry.item

    def loads_done(self, content_hashes: list[str]) -> None:
        for content_hash in content_hashes:
            entry = self._entries.get(content_hash)
            if entry is not None and entry.loads_pending > 0:
                entry.loads_pending -= 1
                self._maybe_drop(content_hash)

    def release(self, request_id: str, content_hash: str | None = None) -> None:
        """The request no longer needs content_hash (None: any of its items; it finished)."""
        held = self._held.get(request_id, set())
        for h in [content_hash] if content_hash is not None else list(held):
            held.discard(h)
            entry = self._entries.get(h)
            if entry is not None:
                entry.holders.discard(request_id)
                self._maybe_drop(h)
        if content_hash is None:
            self._held.pop(request_id, None)
            self._failed.pop(request_id, None)

    def take_failed(self) -> dict[str, str]:
        self._poll()
        failed, self._failed = self._failed, {}
        return failed

    def staged_files(self) -> list[str]:
        return self.staging.owned_files()

    def close(self) -> None:
        """Stop fetching, close the client, remove every staged file."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.staging.close()  # fetches still running find it closed and leave nothing behind
        try:
            self._client.close()
        except Exception:  # best effort at shutdown
            self.log.debug("closing the encoder client failed", exc_info=True)
        self._entries.clear()
        self._held.clear()

    # --- internals ----------------------------------------------------------------------------------
    def _submit(self, content_hash: str) -> None:
        self._pool.submit(self._fetch, content_hash)

    def _fetch(self, content_hash: str) -> None:
        fetched, item, reason = False, None, None
        try:
            if not self._checked:
                self.check_preprocess()
            if self._check_refusal is not None:
                raise PreprocessMismatch(self._check_refusal)
            (result,) = self._client.encode([HashRef(content_hash)], output_dtype=self.output_dtype,
                                            timeout_s=self.settings.timeout_s, bf16_as="uint16")
            array = result.embedding if not result.deepstack else np.concatenate(
                [result.embedding, *result.deepstack], axis=1)  # vLLM's layout: levels along the width
            fetched = True
            item = self.staging.stage(content_hash, array, result.dtype)
        except BaseException as err:  # every failure becomes the request's reason
            reason = describe_error(err, self.settings.timeout_s)
        with self._done_lock:
            self._done.append((content_hash, fetched, item, reason))

    def _poll(self) -> None:
        with self._done_lock:
            done, self._done = self._done, []
        for content_hash, fetched, item, reason in done:
            self.stats["items_fetched"] += fetched
            entry = self._entries.get(content_hash)
            if entry is None:  # released meanwhile: nobody wants it
                if item is not None:
                    self.staging.remove(content_hash)
                continue
            if item is not None:
                entry.item = item
                self.stats["items_staged"] += 1
                self.stats["bytes_staged"] += item.nbytes
                self._maybe_drop(content_hash)
                continue
            self.stats["items_failed"] += 1
            del self._entries[content_hash]  # a later request tries again
            for request_id in sorted(entry.holders):
                self._held.get(request_id, set()).discard(content_hash)
                self._fail(request_id, f"image {content_hash[:16]}...: {reason}")

    def _fail(self, request_id: str, reason: str) -> None:
        if request_id in self._failed:
            return
        self.log.error("encoder-service EC connector: request %s cannot have its embeddings: %s", request_id, reason)
        self._failed[request_id] = reason
        self.reasons[request_id] = reason
        while len(self.reasons) > 1000:
            self.reasons.pop(next(iter(self.reasons)))
        self.release_items_only(request_id)

    def release_items_only(self, request_id: str) -> None:
        for h in list(self._held.get(request_id, ())):
            self.release(request_id, h)

    def _maybe_drop(self, content_hash: str) -> None:
        entry = self._entries.get(content_hash)
        if entry is None or entry.holders or entry.loads_pending or entry.item is None:
            return
        del self._entries[content_hash]
        self.staging.remove(content_hash)
