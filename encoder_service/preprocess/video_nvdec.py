"""``--video-decode nvdec``: a clip's sampled frames decoded by the GPU's video decoder (NVDEC, through
NVIDIA's PyNvVideoCodec) instead of FFmpeg on the CPU, in the same decoder processes (video_pool.py).

Everything before the decode is the CPU path's: the container is opened and checked by PyAV from its
header (``video_decode.probe``: the two demuxers, the codecs, every limit), the frames are counted and
sampled there. NVDEC then decodes the sampled frames (``SimpleDecoder.get_batch_frames_by_index``) into
NV12 on the GPU, and this module copies each to the host and converts it to RGB there, uint8 [T, H, W, 3]:
from there a clip is the CPU path's.

Sessions: opening a decoder (its parser, the hardware session, its surfaces) took ~0.25 s a clip, as long as
decoding a 10 s 448x448 clip's samples. So each decoder process keeps its decoder from clip to clip and
points it at the next clip (``reconfigure_decoder``) where that clip is of the same codec, on the same GPU,
and its frames fit the surfaces the decoder was built for; any other clip gets a new decoder (the kept one
closed first: one session a process, its GPU memory that of the largest frames the limits allow). After
any failure (a hostile clip, a cancel) the kept decoder is closed, so no state of a failed clip reaches
the next. The decoder reads each clip from an anonymous memory file of this process (``/proc/self/fd``),
closed when the decoder moves on.

Pixels: an H.264/H.265/VP9/AV1 decoder's YUV output is defined by the standard, so NVDEC's planes are
FFmpeg's; the YUV -> RGB step is not (NVDEC's own RGB output picks BT.709 for HD frames where FFmpeg
takes BT.601 for an untagged stream: up to 33 levels apart at 720p, and its fixed point differs). So
each sampled NV12 surface is copied to the host and converted there by FFmpeg's own converter
(swscale, through PyAV: ``yuv420p_to_rgb``), from the planes of a yuv420p frame carrying the stream's
matrix and range tags, which is how PyAV converts the frames FFmpeg decodes: the frames equal the CPU
path's bit for bit (tests/video/test_video_nvdec.py checks the conversion on the CPU against PyAV's on
the same planes, for untagged, BT.709, BT.2020 and full-range streams; tests/gpu/test_gpu_video.py the
whole decode). The tags are the stream header's: FFmpeg converts each frame with its own, so a stream
whose bitstream changes its tags midway, or contradicts its header, converts differently. Only 8-bit
4:2:0 (NV12) surfaces are taken: a clip whose header says another pixel format (``NV12_SOURCES``) is
decoded by FFmpeg in the same process instead (video_decode.nvdec_frames), and a surface of another
format from a clip whose header lied is refused with a clear error. The choice stays part of
the cache namespace.

Attack surface: NVDEC's bitstream parser (in the NVIDIA driver) reads caller bytes, in the decoder
process, which holds a CUDA context of its own on the GPU: a crash there costs the clip and the process
(replaced), as with FFmpeg; a driver fault that takes the GPU down is outside what a process can bound.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import DecoderUnusable, DecodeTimeout, EncoderError, InvalidInput
from . import interrupt

# The pixel formats (FFmpeg's names, from the stream's header) whose frames NVDEC hands over as NV12.
NV12_SOURCES = frozenset({"yuv420p", "yuvj420p"})
# Sampled frames copied to the host at a time: bounds the GPU memory a clip's decode takes in a decoder
# process (its NV12 surfaces), which shares the GPU, and the work between two cancel checks.
_GROUP = 8


def available() -> bool:
    try:
        import PyNvVideoCodec  # noqa: F401
    except Exception:  # ImportError, or its native module failing to load
        return False
    return True


def yuv420p_to_rgb(luma: np.ndarray, u: np.ndarray, v: np.ndarray, colorspace: int, color_range: int) -> np.ndarray:
    """uint8 planes of a 4:2:0 frame (luma [H, W], u and v [ceil(H/2), ceil(W/2)]) -> uint8 [H, W, 3] RGB,
    converted by swscale as PyAV's ``to_ndarray("rgb24")`` converts a decoded frame with these tags
    (``colorspace``: AVColorSpace, ``color_range``: AVColorRange, the stream's)."""
    import av  # imported here only: nothing else of PyAV's is needed (video_decode imports this module)

    height, width = luma.shape
    frame = av.VideoFrame(width, height, "yuv420p")
    for plane, data in zip(frame.planes, (luma, u, v), strict=True):
        if data.shape != (plane.height, plane.width):
            raise InvalidInput(f"nvdec: a plane of {list(data.shape)} for a {width}x{height} frame's "
                               f"{plane.width}x{plane.height} plane")
        np.frombuffer(plane, np.uint8).reshape(plane.height, plane.line_size)[:, :plane.width] = data
    frame.colorspace, frame.color_range = colorspace, color_range
    return frame.to_ndarray(format="rgb24")


def _planes(frame, height: int, width: int):
    """An NV12 frame of PyNvVideoCodec (DLPack, [H * 3 / 2, W] bytes) -> (luma, chroma [.., .., 2]) on the host."""
    import torch

    plane = torch.from_dlpack(frame)
    if plane.dtype != torch.uint8:  # a 10- or 16-bit surface (P016): not NV12
        raise InvalidInput(f"nvdec returned a {plane.dtype} surface; only 8-bit NV12 is converted")
    if plane.dim() == 3:
        plane = plane[..., 0]
    rows, cols = (height + 1) // 2, (width + 1) // 2
    # The surface of a frame of the header's size: luma rows (the height, or rounded up to whole chroma
    # samples), then the chroma rows, each at least as wide as the interleaved chroma; any other (a
    # stream that changes size midway) is refused, as the CPU path refuses frames of other sizes.
    luma_rows = plane.shape[0] - rows
    if luma_rows not in (height, 2 * rows) or plane.shape[1] not in (width, 2 * cols) or plane.shape[1] < 2 * cols:
        raise InvalidInput(f"nvdec returned a {list(plane.shape)} NV12 surface for the header's {width}x{height} "
                           "frames (a stream whose frame size changes?)")
    # One copy of the whole surface to the host, sliced there: each copy from this process's CUDA context
    # is work the GPU switches to from the tower's forward (two a frame before, one for each plane).
    plane = plane.cpu()
    return plane[:height, :width], plane[luma_rows:, :2 * cols].reshape(rows, cols, 2)


@dataclass
class _Session:
    """A decoder kept from clip to clip: what it was built for, and the memory file it reads."""

    decoder: object
    gpu: int
    codec: str
    width: int
    height: int
    source: int  # the descriptor of the clip it reads (its /proc/self/fd path)

    def takes(self, gpu: int, codec: str, width: int, height: int) -> bool:
        return (gpu, codec) == (self.gpu, self.codec) and width <= self.width and height <= self.height

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a decoder a failure left broken may fail to stop too
            stop = getattr(self.decoder, "stop", None)
            if stop is not None:
                stop()
        self.decoder = None
        os.close(self.source)


_kept: _Session | None = None  # this process's decoder (a decoder process decodes one clip at a time)


def drop_session() -> None:
    """Closes the kept decoder, if any (after a failure: the next clip gets a new one)."""
    global _kept
    kept, _kept = _kept, None
    if kept is not None:
        kept.close()


def _memory_file(data: bytes) -> int:
    fd = os.memfd_create("nvdec-clip", os.MFD_CLOEXEC)
    try:
        with open(fd, "wb", closefd=False) as out:
            out.write(data)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _session(nvc, data: bytes, gpu: int, codec: str, width: int, height: int) -> _Session:
    """The kept decoder pointed at ``data`` where it takes this clip, else a new one (built for these frames)."""
    global _kept
    source = _memory_file(data)
    path = f"/proc/self/fd/{source}"
    try:
        if _kept is not None and _kept.takes(gpu, codec, width, height):
            try:
                _kept.decoder.reconfigure_decoder(path)
            except Exception:  # refused: a new decoder below, as for a clip it does not take
                drop_session()
            else:
                os.close(_kept.source)
                _kept.source = source
                return _kept
        drop_session()
        # max_width / max_height: the decoder is sized for the header's frames, never larger ones.
        decoder = nvc.SimpleDecoder(path, gpu_id=gpu, use_device_memory=True, decoder_cache_size=1,
                                    max_width=width, max_height=height, output_color_type=nvc.OutputColorType.NATIVE)
    except BaseException:
        os.close(source)
        raise
    _kept = _Session(decoder, gpu, codec, width, height, source)
    return _kept


def decode_frames(data: bytes, indices: Sequence[int], total_frames: int, height: int, width: int,
                  color: tuple[int, int], codec: str, gpu: int, deadline: float,
                  max_decode_seconds: float) -> np.ndarray:
    """The frames at ``indices`` (checked by the caller: in the clip, limits applied), uint8
    [len(indices), H, W, 3], one row per entry in its order, decoded by NVDEC on GPU ``gpu``, a few
    frames at a time. ``total_frames``: PyAV's count, which NVDEC's must equal (else its frame ``i``
    might not be PyAV's). ``color``: the stream's (AVColorSpace, AVColorRange), what FFmpeg converts with.
    ``codec``: FFmpeg's name of the stream's codec (a kept decoder takes only clips of its own)."""
    import PyNvVideoCodec as nvc
    import torch

    distinct = sorted(set(int(i) for i in indices))
    decoded = np.empty((len(distinct), height, width, 3), np.uint8)
    try:
        with torch.cuda.device(gpu):
            decoder = _session(nvc, data, gpu, codec, width, height).decoder
            try:
                _decode_into(nvc, decoder, distinct, decoded, total_frames, height, width, color, deadline,
                             max_decode_seconds)
            except BaseException:
                drop_session()
                raise
            finally:
                del decoder
            position = {index: n for n, index in enumerate(distinct)}
            host = decoded[[position[int(i)] for i in indices]]
    except EncoderError:
        raise
    except Exception as e:  # PyNvVideoCodec's errors: PyNvVCException, RuntimeError, a bare Exception
        reason = f"not decodable by nvdec: {type(e).__name__}: {e}"
        if not _device_works(gpu):
            raise DecoderUnusable(f"{reason}; the decode left its process's GPU context unusable, and the "
                                  "process is replaced") from None
        raise InvalidInput(reason) from None
    if time.monotonic() > deadline:
        drop_session()
        raise _timeout(max_decode_seconds)
    return host


def _device_works(gpu: int) -> bool:
    """Whether this process's CUDA context on ``gpu`` still runs work, asked after an NVDEC failure. After a
    sticky CUDA error (an illegal address, an Xid) every later call on the context fails: a process that
    went on would refuse every clip it is given, as if each were corrupt, and never be replaced."""
    import torch

    try:
        with torch.cuda.device(gpu):
            torch.cuda.synchronize()
            return torch.ones(1, device="cuda").add_(1).item() == 2.0
    except torch.cuda.OutOfMemoryError:  # a full GPU, not a broken context: a new process would not help
        return True
    except Exception:  # the context's error, whichever it is
        return False


def _timeout(max_decode_seconds: float) -> DecodeTimeout:
    return DecodeTimeout(f"decoding the clip took more than {max_decode_seconds:g} s, over the limit of "
                         f"--max-video-decode-seconds {max_decode_seconds:g}")


def _decode_into(nvc, decoder, distinct: list[int], decoded: np.ndarray, total_frames: int, height: int,
                 width: int, color: tuple[int, int], deadline: float, max_decode_seconds: float) -> None:
    if len(decoder) != total_frames:
        raise InvalidInput(f"nvdec counts {len(decoder)} frames where the container holds {total_frames}; "
                           "serve this clip with --video-decode pyav")
    for start in range(0, len(distinct), _GROUP):
        interrupt.check()  # a cancelled clip stops between groups
        if time.monotonic() > deadline:
            raise _timeout(max_decode_seconds)
        group = distinct[start:start + _GROUP]
        frames = decoder.get_batch_frames_by_index(group)
        if len(frames) != len(group):
            raise InvalidInput(f"nvdec decoded {len(frames)} of the {len(group)} frames asked for")
        kind = getattr(frames[0], "format", None)
        if kind is not None and kind != nvc.Pixel_Format.NV12:
            raise InvalidInput(f"nvdec: {kind} frames are not converted (8-bit 4:2:0 only); "
                               "serve this clip with --video-decode pyav")
        for n, frame in enumerate(frames):
            luma, chroma = (plane.numpy() for plane in _planes(frame, height, width))
            decoded[start + n] = yuv420p_to_rgb(luma, chroma[..., 0], chroma[..., 1], *color)
        del frames
