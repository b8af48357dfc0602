"""Video bytes -> uint8 RGB frames: bounded, strict decoding of a clip, shared by every model family.

Decoder: PyAV (``av`` on PyPI), whose wheel bundles its own FFmpeg (with dav1d, libvpx, x264/x265),
so the service needs no system libraries. torchcodec, the other well-kept choice, loads the
system's FFmpeg shared libraries (libavcodec.so.N and friends) at import, which neither the
development machine nor CI has; PyAV is also transformers' default video backend, so frames equal
the reference's by construction.

Parity target: ``transformers.video_utils.read_video_pyav`` (transformers 5.x). For the same
strictly increasing indices our frames equal its frames bit for bit: the same ``av.open`` of the
same bytes, ``container.seek(0)``, ``container.decode(video=0)`` counted from 0 in presentation
order, and ``frame.to_ndarray(format="rgb24")`` (tests/video/test_video_decode.py compares the two).
Where they differ on purpose: an index repeated in ``indices`` gives the frame once per time asked
(read_video_pyav keeps each decoded frame once, in decode order), an index past the last decodable
frame is an error (read_video_pyav returns fewer frames), and a Matroska/WebM header's frame count
of 0 is replaced by the frames counted (read_video_pyav reports 0).

Attack surface: only three demuxers are reachable (ISO BMFF, i.e. MP4/MOV, Matroska/WebM, and AVI,
chosen from the file's first bytes and passed to FFmpeg, so FFmpeg never probes for HLS, concat or
any other format that opens further files) and only the decoders in ``SUPPORTED_CODECS``. AVI (a RIFF
list of chunks, one of FFmpeg's oldest and most fuzzed demuxers) opens no other file either; its
usual codecs are MJPEG (every frame a JPEG, decoded under the same pixel limit) and MPEG-4 Part 2. Limits
(``VideoLimits``) are checked from the header before any frame is decoded and again while decoding
(headers lie): FFmpeg's own ``max_pixels`` refuses a frame over the pixel limit before allocating
it. A decode can still crash or hang inside FFmpeg: ``video_pool.VideoDecodePool`` runs it in a
child process with a wall-clock bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from encoder_service.errors import DecodeTimeout, EncoderError, InvalidInput, ResourceExhausted
from encoder_service.preprocess import decoders, interrupt, video_skip
from encoder_service.preprocess.decode import decode_budget, decode_rgb
from encoder_service.preprocess.video_sampling import ClipFacts

# The codecs a clip may use (FFmpeg's canonical names; AV1 decodes with libdav1d). H.264, H.265, VP9
# and AV1 are what the service promises; VP8 and MPEG-4 Part 2 are the older codecs of WebM, MP4 and
# AVI, MJPEG AVI's own (what vLLM's and transformers' PyAV/OpenCV loaders take too).
SUPPORTED_CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg"})
SUPPORTED_CONTAINERS = "MP4, MOV, MKV, WebM, AVI"
# ISO BMFF top-level boxes a file may start with (FFmpeg's mov_probe accepts these at offset 4).
_ISO_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot")
_EBML_MAGIC = b"\x1a\x45\xdf\xa3"
# RIFF, the file's size, then the form type: "AVI " (FFmpeg's avi_probe also takes "AVIX", "AVI\x19",
# "AMV " and "ON2 "; those are other formats or AVI's extension chunks, not a file's start).
_RIFF_MAGIC, _AVI_FORM = b"RIFF", b"AVI "
# FFmpeg's message for a frame over the codec's max_pixels option (libavutil/imgutils.c).
_MAX_PIXELS_LOG = "exceeds specified max pixel count"
# The codecs a lone clip decodes on frame threads (VideoLimits.decode_threads): the common camera and
# upload codecs. VP9's frame threads refused a crafted stream (one key frame, thousands of empty frames) as
# invalid data that one thread decodes, and VP8, AV1 (dav1d's own threads), MPEG-4 and MJPEG keep the one
# decode path they had.
FRAME_THREAD_CODECS = frozenset({"h264", "hevc"})


@dataclass(frozen=True)
class VideoLimits:
    max_bytes: int  # --max-video-bytes
    max_frames: int  # --max-video-frames: frames in the clip, and frames asked for
    max_seconds: float  # --max-video-seconds
    max_frame_pixels: int  # --max-image-pixels: width * height of one frame
    max_decode_seconds: float  # --max-video-decode-seconds: the whole clip's probe and decode
    max_decoded_bytes: int = 1 << 62  # --max-video-decoded-bytes: the sampled frames, decoded
    # --max-video-pixels-per-sample: the pixels a decode may put through the decoder for each frame it
    # samples (the decode's cost, in proportion to what it yields; see DecodeCost)
    max_pixels_per_sample: int = 1 << 62
    # The decoder's threads: 1 decodes on one, as a reference decode of a stream without slices does; more
    # are FFmpeg's frame threads, which a clip decoding alone gets (video_pool.LONE_CLIP_MAX_THREADS).
    decode_threads: int = 1


class DecodeCost:
    """What a clip's decode has cost so far, in decoded pixels, against its budget: the frames it
    samples times ``--max-video-pixels-per-sample``. A clip whose sampled frames lie far apart in a
    long, large stream (the decode bomb: one key frame and thousands of empty inter frames, 2 frames
    sampled) costs a decoder seconds of CPU per frame it yields; this stops it after the budget's worth
    of pixels, long before the decode's time bound. Pixels, not seconds: the same clip is refused on a
    fast host and a slow one, under load or not."""

    def __init__(self, sampled: int, limits: VideoLimits) -> None:
        self.limits = limits
        self.budget = max(1, sampled) * limits.max_pixels_per_sample
        self.sampled = sampled
        self.pixels = 0

    def add(self, width: int, height: int) -> None:
        self.pixels += width * height
        if self.pixels > self.budget:
            raise ResourceExhausted(
                f"decoding the clip's {self.sampled} sampled frames took more than {self.budget} decoded pixels "
                f"(--max-video-pixels-per-sample {self.limits.max_pixels_per_sample} for each sampled frame): "
                "the frames sampled lie too far apart in too long or too large a stream; sample more frames "
                "(a higher fps or num_frames) or send a shorter clip")


def check_decoded_bytes(frames: int, height: int, width: int, limits: VideoLimits) -> None:
    """The sampled frames' bytes once decoded, before they are: RESOURCE_EXHAUSTED over the limit."""
    if (size := frames * height * width * 3) > limits.max_decoded_bytes:
        raise ResourceExhausted(
            f"the clip's {frames} sampled frames of {width}x{height} take {size} bytes decoded, over the limit of "
            f"--max-video-decoded-bytes {limits.max_decoded_bytes}")


def _deadline(limits: VideoLimits) -> float:
    return time.monotonic() + limits.max_decode_seconds


def _check_time(deadline: float, limits: VideoLimits) -> None:
    """Past the decode's time bound, DecodeTimeout; and whatever the thread's ``interrupt_when`` says
    (a cancelled request's decode stops here, between two frames)."""
    interrupt.check()
    if time.monotonic() > deadline:
        raise DecodeTimeout(
            f"decoding the clip took more than {limits.max_decode_seconds:g} s, over the limit of "
            f"--max-video-decode-seconds {limits.max_decode_seconds:g}")


def _check_bytes(size: int, limits: VideoLimits) -> None:
    if size > limits.max_bytes:
        raise ResourceExhausted(
            f"video is {size} bytes, over the limit of --max-video-bytes {limits.max_bytes}")


def _check_frames(frames: int, limits: VideoLimits, what: str) -> None:
    """``what`` reads before the count: "header claims" N frames; "has more than" (counting, N over)."""
    if frames > limits.max_frames:
        shown = limits.max_frames if what == "has more than" else frames
        raise ResourceExhausted(
            f"video {what} {shown} frames, over the limit of --max-video-frames {limits.max_frames}")


def _check_seconds(seconds: float, limits: VideoLimits, what: str) -> None:
    if seconds > limits.max_seconds:
        raise ResourceExhausted(
            f"video {what} {seconds:.3f} s, over the limit of --max-video-seconds {limits.max_seconds:g}")


def _check_frame_size(width: int, height: int, limits: VideoLimits, what: str) -> None:
    if width * height > limits.max_frame_pixels:
        raise ResourceExhausted(
            f"video {what} {width}x{height} = {width * height} pixels a frame, over the limit of "
            f"--max-image-pixels {limits.max_frame_pixels}")


def container_format(data: bytes) -> str:
    """The FFmpeg demuxer for ``data``, from its first bytes: "mov" (MP4, MOV), "matroska" (MKV,
    WebM) or "avi"; InvalidInput for anything else."""
    if data[:4] == _EBML_MAGIC:
        return "matroska"
    if len(data) >= 8 and data[4:8] in _ISO_BOXES:
        return "mov"
    if data[:4] == _RIFF_MAGIC and data[8:12] == _AVI_FORM:
        return "avi"
    raise InvalidInput(f"not a decodable video: container not recognised (supported: {SUPPORTED_CONTAINERS})")


def _av():
    """PyAV, imported on first use. FFmpeg's log level is set to errors so that an error's
    message carries FFmpeg's last log line (how a frame over ``max_pixels`` is told from corrupt
    data); our decodes capture the lines instead of logging them."""
    import av
    import av.logging

    if av.logging.get_level() is None:
        av.logging.set_level(av.logging.ERROR)
    return av


# What PyAV raises on bytes it cannot parse besides FFmpeg's errors (av.error.FFmpegError): Python
# errors from its own handling of what FFmpeg returned (metadata that is not text, impossible rates).
_PARSE_ERRORS = (OSError, EOFError, ValueError, IndexError, ArithmeticError)


@contextlib.contextmanager
def _parse_errors(limits: VideoLimits) -> Iterator[None]:
    """PyAV's errors inside the block as the service's (InvalidInput; ResourceExhausted for a frame
    over FFmpeg's max_pixels), FFmpeg's log lines captured instead of logged. With frame threads, the
    lines of every thread: PyAV captures per thread, and a frame thread's lines would otherwise go to
    the process's log (one decode runs in a decoder process at a time: nothing else's are caught)."""
    import av.error
    import av.logging

    with av.logging.Capture(local=limits.decode_threads <= 1) as lines:
        try:
            yield
        except EncoderError:
            raise
        except (av.error.FFmpegError, *_PARSE_ERRORS) as e:  # FFmpeg's ENOMEM too: a size from corrupt data
            raise _av_error(e, limits, lines) from None


def _av_error(e: Exception, limits: VideoLimits, lines: Sequence = ()) -> EncoderError:
    """The service's error for an exception PyAV raised on this clip (``lines``: FFmpeg's log lines
    captured meanwhile, (level, name, message) each; the exception carries only the process's last)."""
    if _MAX_PIXELS_LOG in str(e) or any(_MAX_PIXELS_LOG in str(line[-1]) for line in lines):
        return ResourceExhausted(
            f"a video frame is over the limit of --max-image-pixels {limits.max_frame_pixels} pixels "
            f"(FFmpeg: {str(e).rsplit('last error log: ', 1)[-1].strip()})")
    return InvalidInput(f"not a decodable video (truncated or corrupt): {type(e).__name__}: {e}")


def _fps(stream) -> float | None:
    rate = stream.average_rate
    return float(rate) if rate else None


def _header_seconds(container, stream) -> float:
    """The longest duration the header states (stream or container), 0 where it states none."""
    seconds = 0.0
    if stream.duration and stream.time_base:
        seconds = float(stream.duration * stream.time_base)
    if container.duration:
        seconds = max(seconds, container.duration / 1_000_000)  # AV_TIME_BASE
    return seconds


class _Clip:
    """An open container whose header passed every limit, and its first video stream with the
    decoder's pixel limit set. Use as a context manager (closes the container)."""

    def __init__(self, data: bytes, limits: VideoLimits, deadline: float) -> None:
        if not data:
            raise InvalidInput("not a decodable video: empty bytes")
        _check_bytes(len(data), limits)
        fmt = container_format(data)
        av = _av()
        self.av, self.limits, self.deadline = av, limits, deadline
        with _parse_errors(limits):
            # options reach every stream's decoder that stream-info probing runs: the pixel limit binds them.
            self.container = av.open(io.BytesIO(data), format=fmt, metadata_errors="replace",
                                     options={"max_pixels": str(limits.max_frame_pixels)})
        try:
            with _parse_errors(limits):
                self._check_header()
        except BaseException:
            self.container.close()
            raise

    def _check_header(self) -> None:
        limits = self.limits
        if not self.container.streams.video:
            raise InvalidInput("not a decodable video: the container has no video stream")
        stream = self.stream = self.container.streams.video[0]
        codec = stream.codec_context.codec.canonical_name if stream.codec_context else "unknown"
        if codec not in SUPPORTED_CODECS:
            raise InvalidInput(f"unsupported video codec {codec!r} (supported: {', '.join(sorted(SUPPORTED_CODECS))})")
        width, height = stream.codec_context.width, stream.codec_context.height
        _check_frame_size(width, height, limits, "header claims")
        self.size, self.codec = (height, width), codec
        self.pix_fmt = stream.codec_context.pix_fmt  # the decoder's output format by the header (None: unknown)
        self.color = (int(stream.codec_context.colorspace), int(stream.codec_context.color_range))
        if stream.frames:
            _check_frames(stream.frames, limits, "header claims")
        self.fps = _fps(stream)
        _check_seconds(_header_seconds(self.container, stream), limits, "header claims")
        if self.fps and stream.frames:
            _check_seconds(stream.frames / self.fps, limits, "header claims")
        stream.codec_context.options = {"max_pixels": str(limits.max_frame_pixels)}
        if limits.decode_threads > 1 and codec in FRAME_THREAD_CODECS:
            # Frames decode in parallel, each still bit for bit what one thread decodes (FFmpeg's frame
            # threads wait for the rows of the references they read); each frame's slices one after another.
            stream.codec_context.thread_type = "AUTO"
            stream.codec_context.thread_count = limits.decode_threads

    def count_frames(self) -> int:
        """The stream's packets (one a frame, what torchcodec's exact mode counts), read without
        decoding, with the frame, duration and time limits applied as they go."""
        count = 0
        with _parse_errors(self.limits):
            for packet in self.container.demux(self.stream):
                if packet.size == 0:  # the demuxer's end-of-stream packet
                    continue
                count += 1
                _check_frames(count, self.limits, "has more than")
                if packet.pts is not None and packet.time_base:
                    _check_seconds(float(packet.pts * packet.time_base), self.limits, "runs past")
                if count % 64 == 0:
                    _check_time(self.deadline, self.limits)
        return count

    def __enter__(self) -> _Clip:
        return self

    def __exit__(self, *exc) -> None:
        # The decoder's threads stopped first, without the GIL: PyAV's log callback takes the GIL in the
        # thread that logs, and frees the decoder (which waits for its threads) while holding it, so a
        # thread logging an error then (a frame over max_pixels, corrupt data) would wait for the GIL for
        # ever. Frame threads (a lone clip's) and dav1d's own workers run on after a call returns; the
        # flush waits for each to finish its frame, the GIL released (nothing when the decoder never opened).
        self.stream.codec_context.flush_buffers()
        self.container.close()


def _probe(data: bytes, limits: VideoLimits, deadline: float, header: dict | None = None) -> ClipFacts:
    """``header``, where given, receives the stream's frame size (H, W), its color tags, its codec and its
    pixel format (for NVDEC)."""
    with _Clip(data, limits, deadline) as clip:
        total = clip.stream.frames or clip.count_frames()
        if total == 0:
            raise InvalidInput("not a decodable video: the video stream has no frames")
        duration = total / clip.fps if clip.fps else (_header_seconds(clip.container, clip.stream) or None)
        if header is not None:
            header.update(size=clip.size, color=clip.color, codec=clip.codec, pix_fmt=clip.pix_fmt)
        return ClipFacts(total_frames=int(total), fps=clip.fps, duration_s=duration)


def probe(data: bytes, limits: VideoLimits) -> ClipFacts:
    """The clip's facts from its header (frames counted without decoding where the header has
    none), every limit checked. InvalidInput for bytes that are not a supported clip,
    ResourceExhausted over a limit."""
    return _probe(data, limits, _deadline(limits))


def _check_indices(indices: Sequence[int], limits: VideoLimits) -> list[int]:
    wanted = [int(i) for i in indices]
    if not wanted:
        raise InvalidInput("no frame indices asked for")
    if min(wanted) < 0:
        raise InvalidInput(f"frame index {min(wanted)} is negative")
    _check_frames(len(wanted), limits, "sampling asks for")
    return wanted


class WantedFrames:
    """The frames a decode keeps: frame number -> the rows of the answer that ask for it (a number may be
    asked for more than once), filled as the frames come, every frame of the same size."""

    def __init__(self, wanted: list[int], limits: VideoLimits) -> None:
        self.count, self.limits, self.last = len(wanted), limits, max(wanted)
        self.rows: dict[int, list[int]] = {}
        for row, index in enumerate(wanted):
            self.rows.setdefault(index, []).append(row)
        self.out: np.ndarray | None = None
        self.filled: set[int] = set()

    def put(self, number: int, frame) -> None:
        pixels = frame.to_ndarray(format="rgb24")
        if self.out is None:
            check_decoded_bytes(self.count, pixels.shape[0], pixels.shape[1], self.limits)
            self.out = np.empty((self.count, *pixels.shape), np.uint8)
        elif pixels.shape != self.out.shape[1:]:
            raise InvalidInput(
                f"video frames of different sizes: frame {number} is {pixels.shape[1]}x{pixels.shape[0]}, "
                f"an earlier one {self.out.shape[2]}x{self.out.shape[1]}")
        self.out[self.rows[number]] = pixels
        self.filled.add(number)

    @property
    def complete(self) -> bool:
        return len(self.filled) == len(self.rows)


def check_decoded_frame(frame, number: int, limits: VideoLimits, deadline: float,
                        cost: DecodeCost | None = None) -> None:
    """The limits every decoded frame is held to: time, frame count, frame size, seconds, the decode's
    cost (``cost``: counted for this frame)."""
    _check_time(deadline, limits)
    if cost is not None:
        cost.add(frame.width, frame.height)
    _check_frames(number + 1, limits, "has more than")
    _check_frame_size(frame.width, frame.height, limits, "frame of")
    if frame.time is not None:
        _check_seconds(frame.time, limits, "runs past")


def _decode(data: bytes, indices: Sequence[int], limits: VideoLimits, deadline: float) -> np.ndarray:
    wanted = _check_indices(indices, limits)
    cost = DecodeCost(len(set(wanted)), limits)  # one budget for every try below
    if limits.decode_threads > 1:
        try:
            return _decode_once(data, wanted, limits, deadline, cost)
        except InvalidInput:
            # What FFmpeg refuses on frame threads (a crafted stream can decode on one and not the other):
            # decoded again on one thread, as the reference decodes it, within what is left of the same
            # budget and time bound; a clip broken for both is refused by this second try.
            limits = dataclasses.replace(limits, decode_threads=1)
    return _decode_once(data, wanted, limits, deadline, cost)


def _decode_once(data: bytes, wanted: list[int], limits: VideoLimits, deadline: float, cost: DecodeCost) -> np.ndarray:
    def check(frame, number: int) -> None:
        check_decoded_frame(frame, number, limits, deadline, cost)

    with _Clip(data, limits, deadline) as clip, _parse_errors(limits):
        if clip.stream.codec_context.codec.canonical_name not in video_skip.CODECS:
            return _decode_all(clip, WantedFrames(wanted, limits), check)
        try:
            return video_skip.decode(clip.container, clip.stream, WantedFrames(wanted, limits), check,
                                     lambda: _check_time(deadline, limits))
        except video_skip.Fallback:
            pass
    # A stream the skipping decode cannot number: every frame, as the reference decodes them.
    with _Clip(data, limits, deadline) as clip, _parse_errors(limits):
        return _decode_all(clip, WantedFrames(wanted, limits), check)


def _decode_all(clip: _Clip, frames: WantedFrames, check) -> np.ndarray:
    """Every frame up to the last one wanted, numbered as they come out (what read_video_pyav does)."""
    decoded = 0
    clip.container.seek(0)  # as read_video_pyav does
    for i, frame in enumerate(clip.container.decode(video=0)):
        decoded = i + 1
        check(frame, i)
        if i in frames.rows:
            frames.put(i, frame)
        if i >= frames.last:
            break
    if decoded == 0:
        raise InvalidInput("not a decodable video: no frame could be decoded")
    if decoded <= frames.last:
        raise InvalidInput(f"video has {decoded} decodable frames; frame index {frames.last} is past the end")
    assert frames.out is not None
    return frames.out


def decode_frames(data: bytes, indices: Sequence[int], limits: VideoLimits) -> np.ndarray:
    """The frames at ``indices`` (counted from 0 in presentation order, as read_video_pyav counts),
    uint8 ``[len(indices), H, W, 3]`` RGB, one row per entry of ``indices`` in its order.
    InvalidInput for bad bytes, an index past the last decodable frame, frames of different sizes;
    ResourceExhausted over a limit."""
    return _decode(data, indices, limits, _deadline(limits))


def probe_and_decode(data: bytes, indices_fn, limits: VideoLimits, nvdec_gpu: int | None = None
                     ) -> tuple[ClipFacts, list[int], np.ndarray]:
    """``probe``, ``indices_fn(facts)``, then ``decode_frames`` of those indices, under one time budget.
    ``nvdec_gpu``: decode the frames with NVDEC on that GPU instead (video_nvdec.py; the probe, the
    sampling and the checks stay these)."""
    deadline = _deadline(limits)
    header: dict = {}
    facts = _probe(data, limits, deadline, header)
    indices = [int(i) for i in indices_fn(facts)]
    check_decoded_bytes(len(indices), *header["size"], limits)
    decoder = decoders.clip_decoder(nvdec_gpu)
    return facts, indices, decoder.decode(data, indices, facts, header, limits, deadline, nvdec_gpu)


def pyav_frames(data: bytes, indices: list[int], facts: ClipFacts, header: dict, limits: VideoLimits,
                deadline: float, gpu: None) -> np.ndarray:
    """``--video-decode pyav`` (decoders.py): the frames decoded by FFmpeg, here."""
    return _decode(data, indices, limits, deadline)


def nvdec_frames(data: bytes, indices: list[int], facts: ClipFacts, header: dict, limits: VideoLimits,
                 deadline: float, gpu: int) -> np.ndarray:
    """``--video-decode nvdec`` (decoders.py): the frames decoded by NVDEC on ``gpu`` (video_nvdec.py),
    imported here only, so that a CPU decoder process never loads PyNvVideoCodec."""
    from . import video_nvdec

    wanted = _check_indices(indices, limits)
    if max(wanted) >= facts.total_frames:
        raise InvalidInput(f"video has {facts.total_frames} frames; frame index {max(wanted)} is past the end")
    if header["pix_fmt"] not in video_nvdec.NV12_SOURCES:
        # A format NVDEC's surfaces are not converted from (10-bit HDR from a phone, 4:2:2, 4:4:4), by the
        # header: FFmpeg decodes it here, as the pyav path does, the same frames, without touching the
        # process's NVDEC decoder. What NVDEC then refuses of a clip in its format is refused, as before.
        return _decode(data, indices, limits, deadline)
    height, width = header["size"]
    return video_nvdec.decode_frames(data, wanted, facts.total_frames, height, width, header["color"],
                                     header["codec"], gpu, deadline, limits.max_decode_seconds)


def decode_frame_list(frames: Sequence[bytes], limits: VideoLimits) -> np.ndarray:
    """A clip given as its frames, each an encoded image (JPEG, PNG, or what ``decode_image``
    takes), decoded with the image decoder's limits: uint8 ``[len(frames), H, W, 3]`` RGB. Every
    frame must be the same size (InvalidInput otherwise); ResourceExhausted over a limit: frames,
    their bytes together, a frame's pixels, the decode time of the whole list."""
    if not frames:
        raise InvalidInput("a video given as frames has no frames")
    _check_frames(len(frames), limits, "has")
    _check_bytes(sum(len(f) for f in frames), limits)
    deadline = _deadline(limits)
    out: np.ndarray | None = None
    for i, data in enumerate(frames):
        _check_time(deadline, limits)
        try:
            with decode_budget(max(0.0, deadline - time.monotonic())):
                pixels = decode_rgb(data, limits.max_frame_pixels)
        except DecodeTimeout:
            _check_time(float("-inf"), limits)  # the clip's bound, named as such
            raise
        except ResourceExhausted as e:
            raise ResourceExhausted(f"video frame {i}: {e.message} (per frame: --max-image-pixels "
                                    f"{limits.max_frame_pixels})") from None
        except InvalidInput as e:
            raise InvalidInput(f"video frame {i}: {e.message}") from None
        if out is None:
            check_decoded_bytes(len(frames), pixels.shape[0], pixels.shape[1], limits)
            out = np.empty((len(frames), *pixels.shape), np.uint8)
        elif pixels.shape != out.shape[1:]:
            raise InvalidInput(
                f"video frames of different sizes: frame {i} is {pixels.shape[1]}x{pixels.shape[0]}, "
                f"frame 0 is {out.shape[2]}x{out.shape[1]}")
        out[i] = pixels
    assert out is not None
    return out



def sample_frame_list(frames: Sequence[bytes], fps: float | None, sample, limits: VideoLimits
                      ) -> tuple[ClipFacts, list[int], np.ndarray]:
    """A clip given as frames: ``sample(facts)`` chooses the frames the reference samples, and only
    those are decoded, each once (as images, with the image checks): (facts, indices, frames with one
    row per index)."""
    _check_frames(len(frames), limits, "has")
    fps = fps or None
    clip = ClipFacts(len(frames), fps, len(frames) / fps if fps else None)
    indices = [int(i) for i in sample(clip)]
    _check_indices(indices, limits)
    if max(indices) >= len(frames):
        raise InvalidInput(f"the clip has {len(frames)} frames; frame index {max(indices)} is past the end")
    distinct = sorted(set(indices))
    decoded = decode_frame_list([frames[i] for i in distinct], limits)
    position = {index: n for n, index in enumerate(distinct)}
    return clip, indices, decoded[[position[i] for i in indices]]
