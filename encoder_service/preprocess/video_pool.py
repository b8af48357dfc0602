"""Video decoding in child processes, so that a decoder crash or hang cannot take the server down.

FFmpeg's demuxers and decoders are a large body of C reached by caller-supplied bytes. Each clip is
probed and decoded (``video_decode.probe_and_decode``) by one of N long-lived child processes
(started with spawn: no copy of the server's threads, locks or CUDA state). A call waits for the
child's answer at most ``limits.max_decode_seconds`` plus ``grace_s``: the child stops itself at
``--max-video-decode-seconds`` between frames, and the parent's bound catches what the child cannot (a
hang inside one FFmpeg call). A child that crashes (a segfault, an abort) or outlives the bound is
killed and replaced; that call fails with a clear error and the calls on the other children go on.

Not ``concurrent.futures.ProcessPoolExecutor``: one dead child breaks that whole pool (every pending
call fails with BrokenProcessPool), and it cannot kill one hung child. Here each child has its own
pipe, and each call holds one child from start to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import queue
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from encoder_service.errors import EncoderError, InvalidInput, ResourceExhausted
from encoder_service.preprocess.video_decode import VideoLimits, probe_and_decode
from encoder_service.preprocess.video_sampling import ClipFacts
from encoder_service.spawning import SPAWN_LOCK

log = logging.getLogger(__name__)

# The errors a child reports by name; anything else it raised is a bug, reported as INTERNAL.
_ERRORS: dict[str, type[EncoderError]] = {"InvalidInput": InvalidInput, "ResourceExhausted": ResourceExhausted}


@dataclass(frozen=True)
class DecodedClip:
    facts: ClipFacts
    indices: list[int]  # what indices_fn chose: row i of frames is frame indices[i]
    frames: np.ndarray  # uint8 [len(indices), H, W, 3] RGB


def _child_main(conn, nvdec_gpu: int | None = None) -> None:
    """A child's loop: (data, indices_fn, limits) in, ("ok", DecodedClip) or (error name, message) out.
    ``nvdec_gpu``: the frames decode with NVDEC on that GPU (video_nvdec.py)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group; the parent decides
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if job is None:
            return
        data, indices_fn, limits = job
        try:
            answer = ("ok", DecodedClip(*probe_and_decode(data, indices_fn, limits, nvdec_gpu)))
        except EncoderError as e:
            answer = (type(e).__name__, e.message)
        except Exception as e:  # a bug, reported to the caller; the child goes on
            answer = ("error", f"{type(e).__name__}: {e}")
        del data, job
        conn.send(answer)


class _Child:
    def __init__(self, ctx, nvdec_gpu: int | None = None) -> None:
        self.nvdec_gpu = nvdec_gpu
        self.conn, child_end = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_child_main, args=(child_end, nvdec_gpu), daemon=True,
                                   name="video-decode")
        with SPAWN_LOCK:  # not while a worker's spawn has narrowed CUDA_VISIBLE_DEVICES
            self.process.start()
        child_end.close()
        self.ready = False

    def wait_ready(self, timeout: float) -> None:
        if self.ready:
            return
        if not self.conn.poll(timeout):
            raise EncoderError(f"the video decode process did not start within {timeout:g} s")
        self.conn.recv()  # ("ready", None); EOFError if it died starting
        self.ready = True

    def stop(self, kill: bool) -> int | None:
        """Ends the child (kill: at once; else asked to leave, killed after a second) and returns its exit code."""
        if not kill and self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self.process.join(1.0)
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5.0)
        self.conn.close()
        return self.process.exitcode


class VideoDecodePool:
    """``processes`` child processes that probe and decode clips; ``await pool.decode(...)``.

    ``grace_s``: how long past ``limits.max_decode_seconds`` a child may take before it is killed
    (the child's own time check answers first with a clear message; this is the backstop).
    ``start_timeout_s``: how long a new child may take to start (imports), not counted in a call's bound.
    ``nvdec_gpus``: the children decode frames with NVDEC (``--video-decode nvdec``), spread over these GPUs.
    """

    def __init__(self, processes: int = 2, *, grace_s: float = 2.0, start_timeout_s: float = 60.0,
                 nvdec_gpus: tuple[int, ...] = ()) -> None:
        if processes < 1:
            raise ValueError("a video decode pool needs at least one process")
        self._ctx = multiprocessing.get_context("spawn")
        self.grace_s, self.start_timeout_s = grace_s, start_timeout_s
        self._lock = threading.Lock()
        self._closed = False
        self._idle: queue.SimpleQueue[_Child] = queue.SimpleQueue()
        self._children: set[_Child] = set()
        for n in range(processes):  # with NVDEC, the children spread over the GPUs
            self._idle.put(self._start_child(nvdec_gpus[n % len(nvdec_gpus)] if nvdec_gpus else None))
        # One thread per child: a running call holds one child, so a thread never waits for one.
        self._threads = ThreadPoolExecutor(processes, thread_name_prefix="video-decode")
        self.replaced = 0  # children killed and replaced (crash or hang), for tests and metrics

    def _start_child(self, nvdec_gpu: int | None = None) -> _Child:
        child = _Child(self._ctx, nvdec_gpu)
        with self._lock:
            self._children.add(child)
        return child

    def _replace(self, child: _Child) -> int | None:
        code = child.stop(kill=True)
        with self._lock:
            self._children.discard(child)
            self.replaced += 1
        return code

    def _call(self, data: bytes, indices_fn: Callable[[ClipFacts], list[int]], limits: VideoLimits) -> DecodedClip:
        child = self._idle.get()
        try:
            try:
                child.wait_ready(self.start_timeout_s)
            except (EOFError, OSError):
                code = self._replace(child)
                child = self._start_child(child.nvdec_gpu)
                raise EncoderError(f"the video decode process died starting (exit code {code})") from None
            try:
                child.conn.send((data, indices_fn, limits))  # pickled whole before a byte is written
            except OSError:  # the idle child had died (killed from outside)
                code = self._replace(child)
                child = self._start_child(child.nvdec_gpu)
                raise EncoderError(f"the video decode process was gone (exit code {code}); replaced") from None
            bound = limits.max_decode_seconds + self.grace_s
            if not child.conn.poll(bound):
                self._replace(child)
                child = self._start_child(child.nvdec_gpu)
                log.warning("video decode process killed: no answer within %.1f s", bound)
                raise ResourceExhausted(
                    f"decoding the clip took more than {bound:g} s and was stopped, over the limit of "
                    f"--max-video-decode-seconds {limits.max_decode_seconds:g}")
            try:
                status, payload = child.conn.recv()
            except (EOFError, OSError):
                code = self._replace(child)
                child = self._start_child(child.nvdec_gpu)
                log.warning("video decode process crashed (exit code %s); replaced", code)
                raise InvalidInput(
                    f"the video decoder crashed on this clip (decode process exit code {code}); "
                    f"the clip is corrupt or hostile") from None
        finally:
            if self._closed:
                child.stop(kill=False)
            else:
                self._idle.put(child)
        if status == "ok":
            return payload
        raise _ERRORS.get(status, EncoderError)(payload if status in _ERRORS else f"video decode failed: {payload}")

    async def decode(self, data: bytes, indices_fn: Callable[[ClipFacts], list[int]],
                     limits: VideoLimits) -> DecodedClip:
        """Probe ``data``, choose frames with ``indices_fn(facts)`` (a picklable callable: a
        module-level function or a ``functools.partial`` of one) and decode them, in a child process.
        Raises what ``probe``/``decode_frames``/``indices_fn`` raise (InvalidInput, ResourceExhausted),
        InvalidInput when the decoder crashed, ResourceExhausted when it outlived the bound."""
        if self._closed:
            raise EncoderError("the video decode pool is closed")
        return await asyncio.get_running_loop().run_in_executor(self._threads, self._call, data, indices_fn, limits)

    def close(self) -> None:
        """Stops every child; calls in flight finish first."""
        self._closed = True
        self._threads.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            children = list(self._children)
            self._children.clear()
        for child in children:
            child.stop(kill=False)

    def __enter__(self) -> VideoDecodePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
