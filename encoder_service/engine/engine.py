"""The engine: from a request's images to their embeddings, as each becomes ready.

Lives on the event loop. Per image: cache hit (served at once), join of an in-flight computation
of the same content (in-flight de-duplication), or a new job. A job is prepared (decoded to uint8
pixels, or its patch bytes checked) in a thread pool (an image that is expensive to decode by its
header in a smaller pool of its own, so ordinary images never queue behind it), queued for the device
worker once every image of its request validated, batched with other requests' images, and cached
when its forward returns.
A job lives while some request still waits for it; the last one leaving removes it from the queue
and frees its admission slot. The engine serves while some device worker is up and making progress
(engine/watchdog.py); what it counts goes to the ServiceMetrics it is given.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

import torch
from encoder_client.protocol.model_info import ModelInfo

from .. import __version__
from ..config import OnWorkers, ServiceConfig
from ..errors import InvalidInput, NotFound, Unavailable
from ..metrics import ServiceMetrics
from ..models.base import validate_grid
from ..models.served import ServedModel
from ..preprocess import decode, jpeg_direct
from ..preprocess.staged import StagedInput, check_patch_bytes
from ..preprocess.worker_decode import EncodedImage, decoding_in_workers
from .admission import Admission
from .batch_queue import BatchQueue, WorkItem
from .cache import CacheEntry, EmbeddingCache
from .clip_parts import check_size, work_items
from .devices_pool import InProcessDevice, WorkerProcesses
from .facts import PixelLimits, model_info
from .fair_slots import Caller
from .jobs import ClipParts, Job, JobState, Wait, await_prepared, completed, detached, image_result
from .keys import content_keys
from .preparation import EXPENSIVE, PreparePools
from .types import Grid, ImageInput, ImageResult
from .video_preparation import VideoPreparer
from .warm_memory import DECODE_BUFFERS
from .watchdog import UP, Watchdog
from .worker import BatchOutcome

log = logging.getLogger(__name__)


def _forget_task(job: Job, _task: asyncio.Task) -> None:
    job.task = None


class Engine:
    """``Engine(config, metrics=...)`` loads the configured model when started: in this process (one
    device worker thread on ``--device``), or, with ``--devices``, one worker process per device.
    ``Engine(config, model, metrics=...)`` serves an already loaded model in this process (tests,
    embedding). Everything it counts goes to ``metrics`` (its registry is the engine's only record).
    ``worker_setup`` (tests only; the server never passes one): a picklable function each worker
    process of ``--devices`` calls before it loads the model, e.g. to install a stand-in."""

    def __init__(self, config: ServiceConfig, model: ServedModel | None = None, *, metrics: ServiceMetrics,
                 worker_setup: Callable[[], None] | None = None) -> None:
        # The engine composes the components: each is handed only its group of the config.
        self.config = config
        self.batching = config.batching
        self.video = config.video
        self.metrics = metrics
        placement = config.placement
        self.devices = (WorkerProcesses(placement, config.loading, config.batching, metrics, worker_setup)
                        if isinstance(placement, OnWorkers)
                        else InProcessDevice(config.loading, config.batching, metrics, model))
        self.front = model.front() if model is not None else None  # a ModelFront, once known
        self.cache = EmbeddingCache(config.cache_bytes, on_evict=lambda _entry: metrics.cache_evictions.inc())
        self._admission = Admission(config.batching.max_queue_images, metrics.queue_images)
        self._watchdog = Watchdog(config.watchdog_timeout_s, metrics.worker_stalled,
                                  batch_wait_s=config.batching.batch_wait_s)
        self._queue = BatchQueue()
        self._inflight: dict[str, Job] = {}
        self._tasks: set[asyncio.Task] = set()
        self._pools = PreparePools(config.preprocess_threads)
        stage_seconds = metrics.video_stage_seconds
        self._videos = VideoPreparer(config.video, config.batching, placement,
                                     observe=lambda stage, s: stage_seconds.labels(stage=stage).observe(s))
        self._closed = False
        self._started = False
        self._watch_task: asyncio.Task | None = None
        self._serving = False
        # Called on the loop with True/False when the engine starts or stops being able to serve:
        # some device worker up and progressing (engine/watchdog.py) / none.
        self.on_serving_change: Callable[[bool], None] | None = None
        self.namespace = self.front.cache_namespace if self.front is not None else ""
        self._set_pixel_limits()

    # --- life cycle ------------------------------------------------------------------------------
    async def start(self) -> float:
        """Loads the model if needed, starts the device worker(s) and waits for their warm-up
        forwards; returns the warm-up seconds (the slowest worker's)."""
        self.front, warmup_s = await self.devices.start(self._queue, self._on_batch_start, self._on_batch_done,
                                                        self._update_serving)
        # The direct JPEG decode's check against Pillow (once, ~25 ms) before serving, not on the first image.
        await asyncio.get_running_loop().run_in_executor(None, jpeg_direct.agrees_with_pillow)
        if self.config.decode_in_workers and isinstance(self.devices, WorkerProcesses):
            self.front = decoding_in_workers(self.front, self.config.max_decode_seconds)
        self.namespace = self.front.cache_namespace
        self._set_pixel_limits()
        d = self.describe()
        self.metrics.track_engine(model_id=d.model_id, model_type=d.model_type, attn_backend=d.attention_backend,
                                  device=d.device, dtype=d.dtype, cache=self.cache,
                                  cache_capacity_bytes=self.config.cache_bytes,
                                  queue_capacity_images=self.batching.max_queue_images,
                                  device_memory=self.devices.memory_sources())
        self._started = True
        self._update_serving()
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())
        return warmup_s

    async def stop(self) -> None:
        """Stops taking work; jobs still queued fail UNAVAILABLE; waits for the running forwards."""
        if self._closed:
            return
        self._closed = True
        if self._watch_task is not None:  # a worker thread ending from here on is no death
            self._watch_task.cancel()
        for item in self._queue.close():
            job: Job = item.job
            job.state = JobState.FAILED
            self._inflight.pop(job.key, None)
            if not job.done.done():
                job.done.set_exception(Unavailable("server is shutting down"))
        await self.devices.stop()
        self._pools.shutdown()
        self._videos.close()

    @property
    def serving(self) -> bool:
        """Whether some device is up and making progress (see engine/watchdog.py)."""
        return self._serving

    def _update_serving(self, _any_up: object = None) -> None:
        """Called when a worker comes up or goes down (the pool's flag is re-read from the devices'
        states, with the watchdog's verdict), and after every watchdog check."""
        states = self.devices.states()
        serving = self._started and any(s == UP and d not in self._watchdog.stalled for d, s in states.items())
        if serving != self._serving and not self._closed:
            self._serving = serving
            if self.on_serving_change is not None:
                self.on_serving_change(serving)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._watchdog.period_s)
            self._watchdog.check(self.devices.states(), self._queue.oldest_enqueued_at())
            self._update_serving()

    def _set_pixel_limits(self) -> None:
        """The pixel limit in force (--max-image-pixels; -1: derived from the model's max_pixels) and
        the size above which an image decodes in the expensive pool (the derived default)."""
        self.pixel_limits = PixelLimits.derive(self.config.max_image_pixels, self.front)
        self.max_image_pixels = self.pixel_limits.in_force
        self._described: ModelInfo | None = None  # the front or the limits changed: describe again

    def pixel_limit_rule(self) -> str:
        """The pixel limit in force and where it comes from, for the start-up log."""
        return self.pixel_limits.rule()

    # --- plain facts ---------------------------------------------------------------------------------
    def describe(self, **edge_facts) -> ModelInfo:
        """The served model's facts, as GetModelInfo answers them and the start-up log states them.

        Every field of ``ModelInfo`` is taken by its own name (``facts.model_info``) from
        ``edge_facts`` (what only the API knows, e.g. ``shared_memory``), the engine's facts, the
        model's ``ModelFront`` and its ``ModelSpec``: a new reported fact is a field there and in
        ModelInfo and the proto. Read once (requests ask it for the dtype and the patch width),
        again only after the model or the limits change."""
        if self._described is None:
            self._described = model_info(self.engine_facts(), self.front, self.front.spec)
        return dataclasses.replace(self._described, **edge_facts) if edge_facts else self._described

    def engine_facts(self) -> dict[str, object]:
        """The reported facts the engine adds to the model's: where it runs, the limits in force."""
        return {"device": self.devices.label, "cache_namespace": self.namespace,
                "max_image_pixels": self.max_image_pixels, "max_batch_tokens": self.batching.max_batch_tokens,
                "max_message_bytes": self.config.max_message_bytes, "version": __version__,
                **self._videos.facts(self.front)}

    @property
    def busy(self) -> bool:
        """Whether any image is being prepared, queued or in a forward, or a cancelled one's decode is
        still stopping (its request is gone, but a thread or a decoder still holds its memory: the
        idle memory trim must come after it)."""
        return bool(self._inflight) or self._pools.busy or self._videos.busy

    @property
    def queued_images(self) -> int:
        return self._admission.waiting

    def check_grid(self, grid: Sequence[int]) -> Grid:
        """A patches grid checked against the model's rules and the batch limit (before queueing)."""
        checked = validate_grid(grid, self.front.spec)
        check_size(self.front, self.batching, self.video, checked, "video" if checked[0] > 1 else "image")
        return checked

    def lookup(self, content_hashes: Sequence[str]) -> list[bool]:
        return [h in self.cache for h in content_hashes]

    # --- encode ----------------------------------------------------------------------------------------
    async def encode(self, images: Sequence[ImageInput], caller: Caller | None = None) -> AsyncIterator[ImageResult]:
        """Yields one result per image in completion order (cache hits first).

        Every image is validated before any is queued. A result's cache pin is held until the
        consumer asks for the next one, i.e. until it has been streamed. ``caller``: who asks (its
        client), for the fair shares of the decode threads and decoders; None: a caller of its own.
        """
        caller = caller or Caller()
        if self._closed:
            raise Unavailable("server is draining")
        if not images:
            raise InvalidInput("no images in the request")
        for image in images:
            self.metrics.image_received(image.kind)
        keys = await self._pools.hashed(functools.partial(content_keys, self.namespace), images,
                                        alone=not self.busy)

        # Everything from here to the first await runs atomically on the loop: admission counts
        # exactly the jobs this request creates.
        for image, key in zip(images, keys):
            if image.kind == "content_hash" and key not in self.cache and key not in self._inflight:
                raise NotFound(f"content_hash {key} is not cached (evicted or never encoded); "
                               "send the image itself", image_index=image.index)
        new_keys = {k for k in keys if k not in self.cache and k not in self._inflight}
        self._admission.admit(len(new_keys))

        hits: list[tuple[ImageInput, CacheEntry]] = []
        waits: list[Wait] = []
        try:
            for image, key in zip(images, keys):
                entry = self.cache.acquire(key)
                if entry is not None:
                    hits.append((image, entry))
                    self.metrics.cache_hits.inc()
                    continue
                job = self._inflight.get(key)
                if job is not None:
                    job.refs += 1
                    self.metrics.inflight_joins.inc()
                else:
                    job = Job(key)
                    self._inflight[key] = job
                    new_keys.discard(key)  # from here on the job holds (and frees) its slot
                    self.metrics.cache_misses.inc()
                    task = job.task = asyncio.get_running_loop().create_task(self._prepare(job, image, caller))
                    self._tasks.add(task)  # the loop keeps only weak references to tasks
                    task.add_done_callback(self._tasks.discard)
                    # A cancelled task keeps its CancelledError, whose traceback holds _prepare's frame (the
                    # job, and the request's bytes): the job must not keep the task, or the two make a cycle
                    # that holds those bytes until a garbage-collection pass.
                    task.add_done_callback(functools.partial(_forget_task, job))
                waits.append(Wait(image, job))
        finally:
            self._admission.release(len(new_keys))  # slots of jobs not created (only on a bug)

        released_hits = 0
        try:
            await await_prepared(waits)
            for wait in waits:
                self._enqueue(wait.job)
            for image, entry in hits:
                yield self._result(image.index, entry, entry.embedding, cache_hit=True)
                self.cache.release(entry.key)  # streamed: unpin now, not at the end of the request
                released_hits += 1
            async for wait, embedding in completed(waits):
                job = wait.job
                entry = self.cache.peek(job.key) if job.stored else None
                yield self._result(wait.image.index, entry, embedding, cache_hit=False, job=job)
                wait.leave(self._leave)  # streamed: unpin now, not at the end of the request
        finally:
            for _, entry in hits[released_hits:]:
                self.cache.release(entry.key)
            for wait in waits:
                wait.leave(self._leave)

    def _result(self, index: int, entry: CacheEntry | None, embedding: torch.Tensor, *, cache_hit: bool,
                job: Job | None = None) -> ImageResult:
        return image_result(index, entry, embedding, self.cache, self.front.spec.feature_levels,
                            cache_hit=cache_hit, job=job)

    # --- jobs ------------------------------------------------------------------------------------------
    async def _prepare(self, job: Job, image: ImageInput, caller: Caller) -> None:
        started = time.perf_counter()
        try:
            if image.kind == "video":
                payload, job.clip = await self._videos.prepare(self.front, image.video, self.max_image_pixels, caller)
                check_size(self.front, self.batching, self.video, payload.grid, "video")
            else:
                # Alone: this job is the only one in flight (none preparing, queued or on a device) and no
                # decoder still works for a cancelled clip (the pools check their own threads).
                payload = await self._pools.prepared(self._prepare_sync, image, self.pixel_limits.ordinary, caller,
                                                     alone=len(self._inflight) == 1 and not self._videos.busy)
        except Exception as exc:
            if job.state is JobState.PREPARING:
                job.state = JobState.FAILED
                self._drop(job)  # a later request for the same bytes gets its own attempt
            job.prepared.set_exception(detached(exc))
            return
        job.timing.preprocess_ms = (time.perf_counter() - started) * 1000.0
        if isinstance(payload, EncodedImage):
            pass  # its decode is still to come, in a worker: observed with its batch (_on_batch_done)
        elif image.kind == "encoded":
            self.metrics.preprocess_seconds.observe(job.timing.preprocess_ms / 1000.0)
        elif job.clip is not None:
            self.metrics.video_decode_seconds.observe(job.timing.preprocess_ms / 1000.0)
            self.metrics.video_frames_decoded.inc(len(set(job.clip.indices)))
        if job.state is not JobState.PREPARING:  # abandoned while it was being prepared
            return
        job.payload, job.grid, job.state = payload, payload.grid, JobState.PREPARED
        job.prepared.set_result(None)

    def _prepare_sync(self, image: ImageInput, expensive_pixels: int | None) -> StagedInput | object:
        """The CPU half of preprocessing (a thread pool's, or the loop's for a lone small image): decode
        to uint8 pixels, or check a client's patch bytes. Resize, normalize and patchify run on the
        model's device, batched per forward. An image of more than ``expensive_pixels`` pixels (or
        more scans than encoders write) by its header is answered ``EXPENSIVE`` (to be decoded in the
        expensive pool) before any of its pixels is decoded; None: decoded whatever its size."""
        if image.kind == "encoded":
            try:
                with decode.decode_budget(self.config.max_decode_seconds, expensive_pixels), \
                        decode.decode_into(DECODE_BUFFERS.take_array):
                    decoded = self.front.decode_image(image.data, self.max_image_pixels)
            except decode.ExpensiveImage:
                return EXPENSIVE
            check_size(self.front, self.batching, self.video, decoded.grid)
            return decoded
        return check_patch_bytes(image.data, image.patch_dtype, image.grid, self.front.spec.patch_dim)

    def _enqueue(self, job: Job) -> None:
        if job.state is not JobState.PREPARED:
            return  # already queued by another request, or further along
        if self._closed:
            raise Unavailable("server is draining")
        job.parts = ClipParts(work_items(job, self.front, self.batching.max_batch_tokens))
        job.payload = None  # the items hold it now; freed as soon as the forwards are done
        job.state = JobState.QUEUED
        for item in job.parts.items:
            self._queue.put(item)

    def _leave(self, job: Job) -> None:
        """One waiting image slot is done with the job (streamed it, failed or was cancelled)."""
        job.refs -= 1
        if job.state is JobState.DONE:
            if job.stored:
                self.cache.release(job.key)
            return
        if job.refs > 0 or job.state in (JobState.FAILED, JobState.ABANDONED):
            return
        split = job.parts.split
        if job.state is JobState.PREPARING and job.task is not None:
            job.task.cancel()  # its decode stops: a waiting clip never starts, a running one at its next frame
        if job.state is JobState.RUNNING and not split:
            return  # its forward is under way; the result will still be cached
        # Nobody waits any more and no forward has taken it: drop it and free its slot.
        if job.state is JobState.QUEUED and not split and not self._queue.remove(job.parts.items[0]):
            return  # the worker took it a moment ago; its result will still be cached
        if split:  # a clip over several forwards: the parts not yet taken are dropped, those taken ignored
            job.parts.withdraw(self._queue)
        job.state = JobState.ABANDONED
        job.parts.release()
        job.payload = None
        self.metrics.images_abandoned.inc()
        self._drop(job)

    def _drop(self, job: Job) -> None:
        if self._inflight.get(job.key) is job:
            del self._inflight[job.key]
        if job.holds_slot:
            job.holds_slot = False
            self._admission.release()

    # --- worker callbacks (on the loop) ---------------------------------------------------------------
    def _on_batch_start(self, items: list[WorkItem], device: str) -> None:
        self._watchdog.batch_started(device)
        now = time.perf_counter()
        for item in items:
            job: Job = item.job
            if job.state is JobState.QUEUED:
                job.state = JobState.RUNNING
                job.timing.queue_ms = (now - item.enqueued_at) * 1000.0
                self.metrics.queue_seconds.observe(now - item.enqueued_at)
            elif job.state is not JobState.RUNNING:
                continue
            # A split clip still waits while any part does: its slot goes with its last part.
            if job.parts.start() and job.holds_slot:
                job.holds_slot = False
                self._admission.release()

    def _on_batch_done(self, outcome: BatchOutcome) -> None:
        device, m = outcome.device, self.metrics
        self._watchdog.batch_done(device)
        ran = outcome.ran
        if ran:  # a batch whose every image failed to decode ran no forward: no time to count
            m.record_forward(device, outcome.forward_s, len(ran), sum(item.num_patches for item in ran),
                             outcome.preprocess_s)
        forward_ms = outcome.forward_s * 1000.0
        embeddings = iter(outcome.embeddings or ())
        for i, item in enumerate(outcome.items):
            job: Job = item.job
            error = outcome.item_errors.get(i) or outcome.error
            embedding: torch.Tensor | None = next(embeddings) if error is None else None
            if job.state in (JobState.FAILED, JobState.ABANDONED):  # another part of this clip failed, or nobody waits
                continue
            if isinstance(item.payload, EncodedImage):  # its decode ran in the worker, before the forward
                job.timing.preprocess_ms += outcome.host_decode_s * 1000.0
                m.preprocess_seconds.observe(job.timing.preprocess_ms / 1000.0)
            # A clip split over forwards: the forwards of its parts together.
            job.timing.forward_ms = forward_ms + (job.timing.forward_ms if job.parts.split else 0.0)
            if error is None:
                rows = int(embedding.shape[0])  # a shape: no device sync
                embedding = job.parts.gather(item, embedding)
                m.record_encoded(device, item.num_patches, rows, "video" if job.clip is not None else "image",
                                 complete=embedding is not None)
                if embedding is None:
                    continue  # the clip's other parts are still to come
            elif job.parts.split:
                job.parts.withdraw(self._queue)  # one part failed: the clip has failed, the others need not run
            job.parts.release()
            self._drop(job)  # out of the in-flight map; a split clip that failed early gives its slot back
            if error is not None:
                job.state = JobState.FAILED
                job.done.set_exception(error)
                continue
            job.state = JobState.DONE
            # Pin once per request still waiting: each unpins after streaming it.
            job.stored = self.config.cache_bytes > 0 and self.cache.put(job.key, embedding, job.grid,
                                                                        pins=job.refs, clip=job.clip)
            job.done.set_result(embedding)

