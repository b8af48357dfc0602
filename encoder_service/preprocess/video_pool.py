"""Video decoding in child processes, so that a decoder crash or hang cannot take the server down.

FFmpeg's demuxers and decoders are a large body of C reached by caller-supplied bytes. Each clip is
probed and decoded (``video_decode.probe_and_decode``) by one of N long-lived child processes
(started with spawn: no copy of the server's threads, locks or CUDA state). A call waits for the
child's answer at most ``limits.max_decode_seconds`` plus ``grace_s``: the child stops itself at
``--max-video-decode-seconds`` between frames, and the parent's bound catches what the child cannot (a
hang inside one FFmpeg call). A child that crashes (a segfault, an abort) or outlives the bound is
killed and replaced; that call fails with a clear error and the calls on the other children go on.

A child that a crafted clip has taken over is treated as hostile (``decoder_channel.py``): its answer is
one bounded JSON object checked field by field, never a pickle, its frames a sealed memfd of exactly
the announced size, every read has the call's deadline, and a child that breaks the protocol is killed
and replaced like one that crashed.

Not ``concurrent.futures.ProcessPoolExecutor``: one dead child breaks that whole pool (every pending
call fails with BrokenProcessPool), and it cannot kill one hung child. Here each child has its own
pipe, and each call holds one child from start to end.

A clip given as frames (encoded images) decodes in the children too (``decode_frames``), so that its
frames never take the image decode threads. The children run at a lower priority (nice
``DECODER_NICENESS``): under load the kernel gives the server's own threads (the event loop, image
decodes, the device worker) the CPU first. A call stops when its caller is cancelled: the server sends
``CANCEL``, the child stops at its next frame (``interrupt.check``), and a child that does not answer
within ``CANCEL_GRACE_S`` (stuck inside one FFmpeg call) is killed and replaced. A child that dies
before it takes a call (while starting, or idle) is replaced and the call tried on the new one, up
to ``START_ATTEMPTS`` children: it costs the caller nothing.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import logging
import math
import multiprocessing
import os
import pickle
import queue
import select
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from encoder_service.errors import (
    Cancelled,
    DecoderUnusable,
    DecodeTimeout,
    EncoderError,
    InvalidInput,
    ResourceExhausted,
    Unavailable,
)
from encoder_service.offload import run_to_the_end
from encoder_service.preprocess import decoders, interrupt
from encoder_service.preprocess.decoder_channel import (
    BadAnswer,
    Channel,
    frames_from_memfd,
    receive_json,
    sealed_frames,
    send_json,
)
from encoder_service.preprocess.video_decode import VideoLimits, _av, probe_and_decode, sample_frame_list
from encoder_service.preprocess.video_sampling import ClipFacts
from encoder_service.spawning import SPAWN_LOCK

log = logging.getLogger(__name__)

# The errors a child reports by name; anything else it raised is a bug, reported as INTERNAL.
_ERRORS: dict[str, type[EncoderError]] = {"InvalidInput": InvalidInput, "ResourceExhausted": ResourceExhausted,
                                          "DecodeTimeout": DecodeTimeout, "Cancelled": Cancelled,
                                          "DecoderUnusable": DecoderUnusable}
# What the server sends a child to stop the call it runs; a child that is idle when it comes ignores it.
CANCEL = b"cancel"
# How long a child has to answer a cancel (it checks between frames) before it is killed and replaced.
CANCEL_GRACE_S = 1.0
# How often a waiting call looks whether its caller has gone.
_CANCEL_POLL_S = 0.05
# Children a call tries when the one it got died before taking it (each replaced by a fresh one).
START_ATTEMPTS = 3
# The children's nice value: decoding yields the CPU to the server's own threads.
DECODER_NICENESS = 10
# A clip that finds no other clip decoding in the pool decodes on FFmpeg's frame threads, up to this many
# (and at most the cores this process may run on; the codecs that take them:
# video_decode.FRAME_THREAD_CODECS): one core's decode was most of a lone clip's time (a 10 s 448x448
# H.264 clip through the server on an H100: 126 of 174 ms, bench/RESULTS.md), and a lightly loaded
# server's other cores are idle then. Clips that start beside another decode on one
# thread, as before: under load, more threads than cores only add switching (more decode processes
# than that made a loaded node slower). The children run at DECODER_NICENESS whatever their threads, so
# the server's own threads come first.
LONE_CLIP_MAX_THREADS = 8
# FFmpeg's automatic thread count (thread_count 0, PyAV's default) is at most this (MAX_AUTO_THREADS).
FFMPEG_AUTO_THREADS = 16


def lone_clip_threads() -> int:
    """The frame threads a clip decoding alone gets here: LONE_CLIP_MAX_THREADS, at most the cores this
    process may run on and its cgroup's CPU quota (a container's CPU limit: cpu.max)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    with contextlib.suppress(OSError, ValueError, ZeroDivisionError):
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, math.ceil(int(quota) / int(period)))
    return max(1, min(LONE_CLIP_MAX_THREADS, cores))


def _thread_stack_bytes() -> int:
    """A new thread's stack, as glibc sizes it: RLIMIT_STACK's soft limit, 8 MiB where that is unlimited."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_STACK)[0]
    return 8 << 20 if soft == resource.RLIM_INFINITY or soft <= 0 else soft


@dataclass(frozen=True)
class SampledFrames:
    """A decoder process's answer: what it learned of the clip and the frames it sampled, not yet staged for
    the device (``staged.DecodedClip`` is that)."""

    facts: ClipFacts
    indices: list[int]  # what indices_fn chose: row i of frames is frame indices[i]
    frames: np.ndarray  # uint8 [len(indices), H, W, 3] RGB


def child_memory_bytes(limits: VideoLimits) -> int:
    """The private memory (RLIMIT_DATA) a CPU decode process may hold: what a clip at every limit needs,
    with room. The interpreter and its libraries (about 0.3 GiB measured after a 1080p clip; 1 GiB
    given), the clip's bytes three times (the job, its unpickled copy, the demuxer's reads), the sampled
    frames twice, and 24 decoder frames of the largest frame allowed at 6 bytes a pixel (16-bit 4:4:4;
    H.264 and H.265 keep at most 16 reference frames); for each of a lone clip's frame threads
    (LONE_CLIP_MAX_THREADS), two frames more (the one it decodes, the one it hands on), its stack (private
    memory too: RLIMIT_STACK's size) and 8 MiB for its copy of the decoder's state; or, where more, the
    stacks of the slice threads every other decode runs on (PyAV's default: FFmpeg's automatic count, at
    most FFMPEG_AUTO_THREADS, with no frames of their own; a decoder uses one kind or the other). A
    decoder bug that allocates beyond fails there, in the child, instead of taking the host's memory."""
    frame, stack = 6 * limits.max_frame_pixels, _thread_stack_bytes()
    threads = max(LONE_CLIP_MAX_THREADS * (2 * frame + stack + (8 << 20)), FFMPEG_AUTO_THREADS * stack)
    return (1 << 30) + 3 * limits.max_bytes + 2 * limits.max_decoded_bytes + 24 * frame + threads


def _limit_memory(memory_bytes: int | None, nvdec_gpu: int | None) -> None:
    import resource

    # Not for a decoder on a GPU (nvdec): the CUDA driver's own allocations are not ours to bound.
    if memory_bytes is not None and decoders.clip_decoder(nvdec_gpu).bounds_child_memory:
        with contextlib.suppress(OSError, ValueError):  # a hard limit already lower stays
            resource.setrlimit(resource.RLIMIT_DATA, (memory_bytes, memory_bytes))


def _child_main(conn, nvdec_gpu: int | None = None, memory_bytes: int | None = None,
                preload: tuple[str, ...] = ()) -> None:
    """A child's loop: a pickled (data, indices_fn, limits) in from the server; out, a JSON answer
    (``{"status": "ok", "facts", "indices", "shape"}`` with the frames' sealed memfd, or
    ``{"status": error name, "message"}``). ``nvdec_gpu``: the frames decode with NVDEC on that GPU
    (video_nvdec.py). ``memory_bytes``: its RLIMIT_DATA (``child_memory_bytes``), None for none.
    ``preload``: modules imported before the child says it is ready (``VideoDecodePool``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group; the parent decides
    with contextlib.suppress(OSError):
        os.nice(DECODER_NICENESS)
    _limit_memory(memory_bytes, nvdec_gpu)
    # What a clip's first job would otherwise import (PyAV, the family's sampling code that its
    # indices_fn unpickles from): 0.3-0.4 s of that clip's time. Before "ready", which no call's time
    # bound counts, and while the child is idle.
    _av()
    for module in preload:
        importlib.import_module(module)
    channel = Channel(conn.fileno())
    send_json(channel, {"status": "ready"})
    try:
        _serve_jobs(channel, memory_bytes, nvdec_gpu)
    finally:
        # An NVDEC decoder kept from the last clip closed here, before the interpreter's teardown frees
        # objects in no order the CUDA driver expects.
        if nvdec_gpu is not None and "encoder_service.preprocess.video_nvdec" in sys.modules:
            sys.modules["encoder_service.preprocess.video_nvdec"].drop_session()


def _serve_jobs(channel: Channel, memory_bytes: int | None, nvdec_gpu: int | None) -> None:
    while True:
        try:
            body, stray = channel.receive(1 << 40)  # the server's job: it alone writes these
        except (EOFError, OSError):  # the parent is gone
            return
        if stray is not None:
            os.close(stray)
        if body == CANCEL:  # for a call that ended before the cancel came
            continue
        job = read_job(body)
        if job is None:
            return
        kind, data, indices_fn, limits = job
        # The bytes as bytes (they arrive as views of the message), the message then let go.
        data = ([bytes(frame) for frame in data[0]], data[1]) if kind == "frames" else bytes(data)
        del body, job
        fd, leave = None, False
        try:
            with interrupt.interrupt_when(lambda: _stop_if_cancelled(channel)):
                if kind == "frames":
                    facts, indices, frames = sample_frame_list(data[0], data[1], indices_fn, limits)
                else:
                    facts, indices, frames = probe_and_decode(data, indices_fn, limits, nvdec_gpu)
            if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
                raise TypeError(f"decoded frames of {frames.dtype} {frames.shape}, not uint8 [N, H, W, 3]")
            fd = sealed_frames(frames)
            answer = {"status": "ok", "indices": [int(i) for i in indices], "shape": [int(n) for n in frames.shape],
                      "facts": {"total_frames": int(facts.total_frames), "fps": _finite(facts.fps),
                                "duration_s": _finite(facts.duration_s)}}
            del frames
        except EncoderError as e:
            answer = {"status": type(e).__name__, "message": e.message}
            leave = isinstance(e, DecoderUnusable)
        except MemoryError:
            answer = {"status": "ResourceExhausted", "message": "decoding the clip needed more memory than its "
                      f"decode process may hold ({memory_bytes} bytes, from the --max-video-* limits)"}
        except Exception as e:  # a bug, reported to the caller; the child goes on
            answer = {"status": "error", "message": f"{type(e).__name__}: {e}"}
        del data
        try:
            send_json(channel, answer, fd)
        except (EOFError, OSError):
            return
        finally:
            if fd is not None:
                os.close(fd)
        if leave:  # the server replaces this process as it reads the answer
            return


_JOB_HEAD = struct.Struct("!QQ")  # the pickle's length, the number of out-of-band buffers
_BUFFER_LENGTH = struct.Struct("!Q")


def job_message(job) -> list:
    """A job (or None: stop) as the parts of one message: a header, the job pickled with protocol 5,
    and its bytes (the clip, or each frame) out of band, sent from the objects the server already
    holds: a clip of up to --max-video-bytes is never copied into a pickle."""
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(job, protocol=5, buffer_callback=buffers.append)
    views = [buffer.raw() for buffer in buffers]
    head = _JOB_HEAD.pack(len(body), len(views)) + b"".join(_BUFFER_LENGTH.pack(len(v)) for v in views)
    return [head, body, *views]


def read_job(message: bytes):
    """The child's side of ``job_message`` (only the server writes these)."""
    view = memoryview(message)
    size, count = _JOB_HEAD.unpack_from(view)
    offset = _JOB_HEAD.size
    lengths = [_BUFFER_LENGTH.unpack_from(view, offset + 8 * i)[0] for i in range(count)]
    offset += 8 * count
    body = view[offset:offset + size]
    offset += size
    buffers = []
    for length in lengths:
        buffers.append(view[offset:offset + length])
        offset += length
    return pickle.loads(body, buffers=buffers)


def _out_of_band(data: bytes) -> pickle.PickleBuffer:
    return pickle.PickleBuffer(data)


def _stop_if_cancelled(channel: Channel) -> None:
    """The child's side of a cancel, between two frames: the server wrote to us mid-call, which it
    does only to cancel (or it is gone)."""
    if channel.has_input():
        raise Cancelled("the clip's request was cancelled; its decode stopped")


def _finite(value: float | None) -> float | None:
    """A container's fps or duration as JSON carries it: None where unknown (None, NaN, infinite, < 0)."""
    return float(value) if value is not None and math.isfinite(value) and value >= 0 else None


def _number(value, name: str, *, optional: bool = False, integer: bool = False):
    if value is None and optional:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value < 0:
        raise BadAnswer(f"{name} is {value!r}, not a number >= 0")
    return value


def clip_from_answer(answer: dict, fd: int | None, limits: VideoLimits) -> SampledFrames:
    """A child's JSON answer (and the descriptor that came with it, owned here) as SampledFrames, or the
    error it reports. BadAnswer for anything a correct child does not send: a wrong type, a shape or
    index out of the limits, frames without their memfd, a memfd not sealed or of the wrong size."""
    status = answer.get("status")
    if status != "ok":
        if fd is not None:
            os.close(fd)
        message = answer.get("message")
        if not isinstance(status, str) or not isinstance(message, str):
            raise BadAnswer(f"an answer with status {status!r} and no message")
        message = message[:4000]
        raise _ERRORS[status](message) if status in _ERRORS else EncoderError(f"video decode failed: {message}")
    try:
        facts, indices, shape = answer.get("facts"), answer.get("indices"), answer.get("shape")
        if not isinstance(facts, dict) or not isinstance(indices, list) or not isinstance(shape, list):
            raise BadAnswer("an answer without facts, indices and shape")
        total = _number(facts.get("total_frames"), "total_frames", integer=True)
        fps = _number(facts.get("fps"), "fps", optional=True)
        duration = _number(facts.get("duration_s"), "duration_s", optional=True)
        if len(shape) != 4 or shape[3] != 3:
            raise BadAnswer(f"frames of shape {shape!r}, not [N, H, W, 3]")
        n, height, width, _ = (_number(v, "shape", integer=True) for v in shape)
        if not 0 < n <= limits.max_frames or n != len(indices) or min(height, width) < 1 \
                or height * width > limits.max_frame_pixels or n * height * width * 3 > limits.max_decoded_bytes:
            raise BadAnswer(f"frames of shape {shape!r} for {len(indices)} indices, outside the limits")
        if not 0 < total <= limits.max_frames:  # the child's probe refuses longer clips
            raise BadAnswer(f"total_frames {total!r} outside 1..{limits.max_frames}")
        indices = [_number(i, "a frame index", integer=True) for i in indices]  # each >= 0
        if max(indices) >= total:
            raise BadAnswer(f"frame indices outside the clip's {total} frames")
        if fd is None:
            raise BadAnswer("frames announced without their memfd")
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    frames = frames_from_memfd(fd, (n, height, width, 3))
    return SampledFrames(ClipFacts(total, fps, duration), indices, frames)


def _input_unless(stop: threading.Event, channel: Channel, deadline: float) -> bool:
    """Waits until the child's answer starts (True) or ``stop`` is set (False); TimeoutError past
    ``deadline``. Only whole answers are read, after this: a read is never cut in the middle."""
    poller = select.poll()
    poller.register(channel.sock, select.POLLIN)
    while True:
        if stop.is_set():
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        if poller.poll(max(1, int(min(left, _CANCEL_POLL_S) * 1000))):
            return True


class _Child:
    def __init__(self, ctx, nvdec_gpu: int | None = None, memory_bytes: int | None = None,
                 preload: tuple[str, ...] = ()) -> None:
        self.nvdec_gpu = nvdec_gpu
        self.conn, child_end = ctx.Pipe(duplex=True)
        self.channel = Channel(self.conn.fileno())
        self.process = ctx.Process(target=_child_main, args=(child_end, nvdec_gpu, memory_bytes, preload),
                                   daemon=True, name="video-decode")
        with SPAWN_LOCK:  # not while a worker's spawn has narrowed CUDA_VISIBLE_DEVICES
            self.process.start()
        child_end.close()
        self.ready = False
        self.stopped = False
        self.exitcode: int | None = None

    def wait_ready(self, timeout: float, stop: threading.Event | None = None) -> bool:
        """Until the child says it is ready (its imports done): True; TimeoutError past ``timeout``. False
        as soon as ``stop`` is set: a cancelled call waits for no child's start (the child goes on
        starting, and says it is ready to the next call)."""
        if self.ready:
            return True
        deadline = time.monotonic() + timeout
        if stop is not None and not _input_unless(stop, self.channel, deadline):
            return False
        answer, fd = receive_json(self.channel, deadline)  # TimeoutError: not started
        if fd is not None:
            os.close(fd)
        if answer != {"status": "ready"}:
            raise BadAnswer(f"a first answer that is not 'ready': {str(answer)[:200]}")
        self.ready = True
        return True

    def stop(self, kill: bool) -> int | None:
        """Ends the child (kill: at once; else asked to leave, killed after a second) and returns its exit
        code; once stopped, it stays so (a second call returns the same code)."""
        if self.stopped:
            return self.exitcode
        if not kill and self.process.is_alive():
            with contextlib.suppress(OSError, EOFError, TimeoutError):
                self.channel.send(job_message(None), time.monotonic() + 1.0)
            self.process.join(1.0)
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5.0)
        self.exitcode = self.process.exitcode
        self.stopped = True
        self.channel.close()
        self.conn.close()
        if self.exitcode is not None:
            self.process.close()  # its sentinel descriptor, now rather than when collected
        return self.exitcode


class _IdleChildren:
    """The idle children, a stack whose top is the one that finished last, except that a child not yet
    ready (a replacement, or one whose call was cancelled while it started) goes to the bottom: the next
    clip takes a warm child, not one still importing, while any is idle."""

    def __init__(self) -> None:
        self.queue: collections.deque[_Child] = collections.deque()  # the top is the right end
        self._ready = threading.Condition()

    def put(self, child: _Child) -> None:
        with self._ready:
            (self.queue.append if child.ready and not child.stopped else self.queue.appendleft)(child)
            self._ready.notify()

    def get(self, timeout: float) -> _Child:
        """The top child; queue.Empty when none is idle within ``timeout``."""
        with self._ready:
            if not self._ready.wait_for(lambda: self.queue, timeout):
                raise queue.Empty
            return self.queue.pop()


class VideoDecodePool:
    """``processes`` child processes that probe and decode clips; ``await pool.decode(...)``.

    ``grace_s``: how long past ``limits.max_decode_seconds`` a child may take before it is killed
    (the child's own time check answers first with a clear message; this is the backstop).
    ``start_timeout_s``: how long a new child may take to start (imports), not counted in a call's bound.
    ``nvdec_gpus``: the children decode frames with NVDEC (``--video-decode nvdec``), spread over these GPUs.
    ``memory_bytes``: each CPU child's RLIMIT_DATA (``child_memory_bytes``); None: no bound of its own.
    ``cancel_grace_s``: how long a child told to stop may take to answer before it is killed.
    ``preload``: modules each child imports before it is ready (the model family's sampling code).

    A call takes the child that finished last (the idle ones are a stack): under light load the same
    few children take every clip, warm, instead of each of the pool's children in turn paying its first
    clip's costs (first touches of the decoder's code and memory; with NVDEC, opening its session). A
    child not yet ready waits below the ready ones (a hostile clip's crash must not make the next
    caller wait for its replacement's start while a warm child is idle).
    """

    def __init__(self, processes: int = 2, *, grace_s: float = 2.0, start_timeout_s: float = 60.0,
                 nvdec_gpus: tuple[int, ...] = (), memory_bytes: int | None = None,
                 cancel_grace_s: float = CANCEL_GRACE_S, preload: tuple[str, ...] = ()) -> None:
        if processes < 1:
            raise ValueError("a video decode pool needs at least one process")
        self._ctx = multiprocessing.get_context("spawn")
        self.grace_s, self.start_timeout_s, self.memory_bytes = grace_s, start_timeout_s, memory_bytes
        self.cancel_grace_s, self.preload = cancel_grace_s, preload
        self._lock = threading.Lock()
        self._closed = False
        self._idle = _IdleChildren()
        self._children: set[_Child] = set()
        for n in range(processes):  # with NVDEC, the children spread over the GPUs
            self._idle.put(self._start_child(nvdec_gpus[n % len(nvdec_gpus)] if nvdec_gpus else None))
        # One thread per child: a running call holds one child, so a thread never waits for one.
        self._threads = ThreadPoolExecutor(processes, thread_name_prefix="video-decode")
        self.replaced = 0  # children killed and replaced (crash or hang), for tests and metrics
        self.lone_clip_threads = lone_clip_threads()  # a clip's decoder threads when no other clip decodes
        self._decoding = 0  # calls between their job's send and their answer (under _lock)
        self._stops: set[threading.Event] = set()  # the calls in flight's: close() stops them

    def _start_child(self, nvdec_gpu: int | None = None) -> _Child:
        child = _Child(self._ctx, nvdec_gpu, self.memory_bytes, self.preload)
        with self._lock:
            self._children.add(child)
        return child

    def _replace(self, child: _Child) -> int | None:
        code = child.stop(kill=True)
        with self._lock:
            self._children.discard(child)
            self.replaced += 1
        return code

    def _renew(self, child: _Child) -> tuple[_Child, int | None]:
        """Kills ``child`` and starts its replacement: (the new child, the old one's exit code). Where the
        new one cannot start, the stopped one comes back, and the next call on its slot tries again."""
        code = self._replace(child)
        try:
            return self._start_child(child.nvdec_gpu), code
        except Exception as e:  # e.g. out of descriptors or processes: the slot must not stay dead
            log.error("could not start a video decode process: %s: %s", type(e).__name__, e)
            return child, code

    def _started(self, child: _Child) -> _Child:
        """``child``, or where it is a stopped one whose replacement could not start, a new one now."""
        if not child.stopped:
            return child
        try:
            return self._start_child(child.nvdec_gpu)
        except Exception as e:
            raise EncoderError(f"could not start a video decode process ({type(e).__name__}: {e})") from None

    def _ready_child(self, child: _Child, stop: threading.Event) -> tuple[_Child, str | None]:
        """``(child, "")``: ``child`` started and ready for a call, or another in its place: a child
        that died or hung starting, or went away while idle, is replaced and the next one tried, up to
        START_ATTEMPTS children. ``(the last one, why)`` when none came up; ``(child, None)`` as soon as
        ``stop`` is set (the child, perhaps still starting, goes back to the pool)."""
        why = ""
        for _attempt in range(START_ATTEMPTS):
            try:
                child = self._started(child)
                if not child.wait_ready(self.start_timeout_s, stop):
                    return child, None
                # A ready child that is gone, or holds bytes nobody asked for (an answer queued ahead),
                # is replaced before this call, which is not failed for it.
                if not child.channel.has_input():
                    return child, ""
                log.warning("video decode process sent bytes while idle (or is gone); replaced")
                why = "it went away while idle"
            except TimeoutError:  # before OSError, its base: a child that hangs starting is replaced too
                why = f"it did not start within {self.start_timeout_s:g} s"
            except (EOFError, OSError, BadAnswer, EncoderError) as e:
                why = f"it died starting ({type(e).__name__}: {str(e)[:200]})"
            child, code = self._renew(child)
            log.warning("video decode process replaced before its call: %s (exit code %s)", why, code)
        return child, why

    def _call(self, job: tuple, limits: VideoLimits, stop: threading.Event) -> SampledFrames:
        try:
            child = self._idle.get(timeout=self.start_timeout_s)
        except queue.Empty:  # every child busy: a caller past the slots the pool was sized for
            raise Unavailable("every video decode process is busy; retry later") from None
        try:
            if stop.is_set():
                raise Cancelled("the clip's request was cancelled before its decode started")
            child, why = self._ready_child(child, stop)
            if why is None:
                raise Cancelled("the clip's request was cancelled while its decode process started")
            if why:
                raise Unavailable(f"no video decode process could be started ({START_ATTEMPTS} tried; the last: "
                                  f"{why}); retry later")
            bound = limits.max_decode_seconds + self.grace_s
            deadline = time.monotonic() + bound
            with self._lock:
                alone = self._decoding == 0
                self._decoding += 1
            if alone and job[0] == "container" and child.nvdec_gpu is None and self.lone_clip_threads > 1:
                # At most what the decoder process's memory bound counts (child_memory_bytes).
                limits = dataclasses.replace(limits, decode_threads=min(self.lone_clip_threads, LONE_CLIP_MAX_THREADS))
            try:
                child.channel.send(job_message((*job, limits)), deadline)
                if not _input_unless(stop, child.channel, deadline):
                    child.channel.send(CANCEL, time.monotonic() + self.cancel_grace_s)
                    answer, fd = receive_json(child.channel, time.monotonic() + self.cancel_grace_s)
                    if fd is not None:
                        os.close(fd)
                    if answer.get("status") == "DecoderUnusable":  # it leaves: not back to the idle ones
                        child, _ = self._renew(child)
                    raise Cancelled("the clip's request was cancelled; its decode stopped")
                answer, fd = receive_json(child.channel, deadline)
                return clip_from_answer(answer, fd, limits)
            except DecoderUnusable:  # the child leaves after this answer: its replacement starts now
                child, code = self._renew(child)
                log.warning("video decode process replaced: its GPU context no longer works (exit code %s)", code)
                raise
            except TimeoutError:
                child, _ = self._renew(child)
                if stop.is_set():
                    log.info("video decode process killed: it did not stop within %.1f s of a cancel",
                             self.cancel_grace_s)
                    raise Cancelled("the clip's request was cancelled; its decode was stopped") from None
                log.warning("video decode process killed: no answer within %.1f s", bound)
                raise DecodeTimeout(
                    f"decoding the clip took more than {bound:g} s and was stopped, over the limit of "
                    f"--max-video-decode-seconds {limits.max_decode_seconds:g}") from None
            except (EOFError, OSError):
                child, code = self._renew(child)
                log.warning("video decode process crashed (exit code %s); replaced", code)
                raise InvalidInput(
                    f"the video decoder crashed on this clip (decode process exit code {code}); "
                    f"the clip is corrupt or hostile") from None
            except BadAnswer as e:
                child, _ = self._renew(child)
                log.warning("video decode process broke the protocol (%s); replaced", e)
                raise InvalidInput(f"the video decoder failed on this clip and was replaced ({e}); "
                                   "the clip is corrupt or hostile") from None
            finally:
                with self._lock:
                    self._decoding -= 1
        finally:
            if self._closed:
                child.stop(kill=False)
            else:
                self._idle.put(child)

    async def _run(self, job: tuple, limits: VideoLimits) -> SampledFrames:
        if self._closed:
            raise Unavailable("the video decode pool is closed (the server is stopping)")
        stop = threading.Event()
        self._stops.add(stop)
        try:
            return await run_to_the_end(self._threads, self._call, job, limits, stop, stop=stop)
        finally:
            self._stops.discard(stop)

    async def decode(self, data: bytes, indices_fn: Callable[[ClipFacts], list[int]],
                     limits: VideoLimits) -> SampledFrames:
        """Probe ``data``, choose frames with ``indices_fn(facts)`` (a picklable callable: a
        module-level function or a ``functools.partial`` of one) and decode them, in a child process.
        Raises what ``probe``/``decode_frames``/``indices_fn`` raise (InvalidInput, ResourceExhausted),
        InvalidInput when the decoder crashed, DecodeTimeout when it outlived the bound. Cancelled
        (the awaiting task), the decode stops and this returns once its child is free again."""
        return await self._run(("container", _out_of_band(data), indices_fn), limits)

    async def decode_frames(self, frames: list[bytes], fps: float | None, indices_fn: Callable[[ClipFacts], list[int]],
                            limits: VideoLimits) -> SampledFrames:
        """A clip given as encoded frames: ``indices_fn`` chooses among them, and the chosen ones are
        decoded in a child (``video_decode.sample_frame_list``), as ``decode`` does a container."""
        return await self._run(("frames", ([_out_of_band(f) for f in frames], fps), indices_fn), limits)

    def close(self) -> None:
        """Stops every child; calls in flight are cancelled and finish first."""
        self._closed = True
        for stop in list(self._stops):
            stop.set()
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
