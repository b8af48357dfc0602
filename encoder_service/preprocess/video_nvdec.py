"""``--video-decode nvdec``: a clip's sampled frames decoded by the GPU's video decoder (NVDEC, through
NVIDIA's PyNvVideoCodec) instead of FFmpeg on the CPU, in the same decoder processes (video_pool.py).

Everything before the decode is the CPU path's: the container is opened and checked by PyAV from its
header (``video_decode.probe``: the two demuxers, the codecs, every limit), the frames are counted and
sampled there. NVDEC then decodes the sampled frames (``SimpleDecoder.get_batch_frames_by_index``, one
decoder session a clip) into NV12 on the GPU, and this module converts them to RGB on the GPU and copies
the sampled frames, uint8 [T, H, W, 3], back to the host: from there a clip is the CPU path's.

Pixels: an H.264/H.265/VP9/AV1 decoder's YUV output is defined by the standard, so NVDEC's planes are
FFmpeg's; the YUV -> RGB step is not. FFmpeg (what PyAV's ``to_ndarray("rgb24")`` and transformers'
``read_video_pyav`` use) converts with the stream's matrix (BT.601 where the stream says none: NVDEC's
own RGB output picks BT.709 for HD frames instead, a shift of up to 33 levels at 720p) and its own fixed
point; ``nv12_to_rgb`` uses the same matrix and range and rounds to land within a level of FFmpeg's
x86 path (tests/video/test_video_nvdec.py measures it on the CPU against PyAV's conversion of the same planes).
Only 8-bit 4:2:0 (NV12) is converted; other formats are refused with a clear error. The pixels still
differ slightly, so the choice is part of the cache namespace.

Attack surface: NVDEC's bitstream parser (in the NVIDIA driver) reads caller bytes, in the decoder
process, which holds a CUDA context of its own on the GPU: a crash there costs the clip and the process
(replaced), as with FFmpeg; a driver fault that takes the GPU down is outside what a process can bound.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from ..errors import DecodeTimeout, EncoderError, InvalidInput
from . import interrupt

# The stream's matrix tag (AVColorSpace) -> the matrix swscale converts with, for the tags converted
# here: BT.709; BT.601 for BT.470BG, SMPTE 170M and an untagged stream (swscale's default). Other
# matrices (BT.2020, SMPTE 240M, FCC, ...) are refused rather than converted differently.
_MATRICES = {1: 709, 2: 601, 5: 601, 6: 601}
_KR_KB = {601: (0.299, 0.114), 709: (0.2126, 0.0722)}
# Sampled frames converted and copied to the host at a time: bounds the GPU memory a clip's decode
# takes in a decoder process (NV12 surfaces, RGB and float32 temporaries), which shares the GPU.
_GROUP = 8
# Added before flooring, per channel (R, G, B): lands within one level of swscale's x86 fixed point on
# 8-bit limited-range input (measured: tests/video/test_video_nvdec.py).
_BIAS = (-0.5, -1.0, -0.5)


def available() -> bool:
    try:
        import PyNvVideoCodec  # noqa: F401
    except Exception:  # ImportError, or its native module failing to load
        return False
    return True


def color_matrix(colorspace: int | None, color_range: int | None) -> tuple[int, bool]:
    """(601 or 709, full range?) from a stream's AVColorSpace and AVColorRange codes, as swscale reads them;
    InvalidInput for a matrix not converted here."""
    matrix = _MATRICES.get(2 if colorspace is None else int(colorspace))
    if matrix is None:
        raise InvalidInput(f"nvdec: the stream's color matrix (AVColorSpace {colorspace}) is not converted here; "
                           "serve this clip with --video-decode pyav")
    return matrix, color_range == 2  # AVCOL_RANGE_JPEG


def nv12_to_rgb(y, uv, matrix: int = 601, full_range: bool = False):
    """Luma uint8 [H, W] and interleaved chroma uint8 [ceil(H/2), ceil(W/2), 2] (torch tensors, any device)
    -> uint8 [H, W, 3] RGB: chroma repeated over its 2x2 block (swscale's unscaled path), the matrix's
    coefficients in float32, floored with a per-channel bias."""
    import torch

    height, width = y.shape
    kr, kb = _KR_KB[matrix]
    kg = 1.0 - kr - kb
    chroma = uv.float().repeat_interleave(2, 0).repeat_interleave(2, 1)[:height, :width]
    if full_range:
        luma, u, v = y.float(), chroma[..., 0] - 128.0, chroma[..., 1] - 128.0
    else:
        luma = (y.float() - 16.0) * (255.0 / 219.0)
        u, v = (chroma[..., 0] - 128.0) * (255.0 / 224.0), (chroma[..., 1] - 128.0) * (255.0 / 224.0)
    r = luma + 2.0 * (1.0 - kr) * v
    g = luma - (2.0 * kb * (1.0 - kb) / kg) * u - (2.0 * kr * (1.0 - kr) / kg) * v
    b = luma + 2.0 * (1.0 - kb) * u
    bias = torch.tensor(_BIAS, device=y.device)
    return (torch.stack((r, g, b), dim=-1) + bias).floor_().clamp_(0, 255).to(torch.uint8)


def _planes(frame, height: int, width: int):
    """An NV12 frame of PyNvVideoCodec (DLPack, [H * 3 / 2, W] bytes) -> (luma, chroma [.., .., 2])."""
    import torch

    plane = torch.from_dlpack(frame)
    if plane.dim() == 3:
        plane = plane[..., 0]
    rows, cols = (height + 1) // 2, (width + 1) // 2
    # The surface of a frame of the header's size (odd sides rounded up to whole chroma samples); any
    # other (a stream that changes size midway) is refused, as the CPU path refuses frames of other sizes.
    if plane.shape[0] not in (height + rows, 2 * rows + rows) or plane.shape[1] not in (width, 2 * cols):
        raise InvalidInput(f"nvdec returned a {list(plane.shape)} NV12 surface for the header's {width}x{height} "
                           "frames (a stream whose frame size changes?)")
    return plane[:height, :width], plane[height:height + rows, :2 * cols].reshape(rows, cols, 2)


def decode_frames(data: bytes, indices: Sequence[int], total_frames: int, height: int, width: int,
                  color: tuple[int, bool], gpu: int, deadline: float, max_decode_seconds: float) -> np.ndarray:
    """The frames at ``indices`` (checked by the caller: in the clip, limits applied), uint8
    [len(indices), H, W, 3], one row per entry in its order, decoded by NVDEC on GPU ``gpu``, a few
    frames at a time. ``total_frames``: PyAV's count, which NVDEC's must equal (else its frame ``i``
    might not be PyAV's)."""
    import PyNvVideoCodec as nvc
    import torch

    distinct = sorted(set(int(i) for i in indices))
    decoded = np.empty((len(distinct), height, width, 3), np.uint8)
    try:
        with torch.cuda.device(gpu):
            # max_width / max_height: the decoder is sized for the header's frames, never larger ones.
            decoder = nvc.SimpleDecoder(data, gpu_id=gpu, use_device_memory=True, decoder_cache_size=1,
                                        max_width=width, max_height=height,
                                        output_color_type=nvc.OutputColorType.NATIVE)
            if len(decoder) != total_frames:
                raise InvalidInput(f"nvdec counts {len(decoder)} frames where the container holds {total_frames}; "
                                   "serve this clip with --video-decode pyav")
            for start in range(0, len(distinct), _GROUP):
                interrupt.check()  # a cancelled clip stops between groups
                group = distinct[start:start + _GROUP]
                frames = decoder.get_batch_frames_by_index(group)
                if len(frames) != len(group):
                    raise InvalidInput(f"nvdec decoded {len(frames)} of the {len(group)} frames asked for")
                kind = getattr(frames[0], "format", None)
                if kind is not None and kind != nvc.Pixel_Format.NV12:
                    raise InvalidInput(f"nvdec: {kind} frames are not converted (8-bit 4:2:0 only); "
                                       "serve this clip with --video-decode pyav")
                rgb = torch.stack([nv12_to_rgb(*_planes(f, height, width), *color) for f in frames])
                decoded[start:start + len(group)] = rgb.cpu().numpy()
                del frames, rgb
            position = {index: n for n, index in enumerate(distinct)}
            host = decoded[[position[int(i)] for i in indices]]
    except EncoderError:
        raise
    except Exception as e:  # PyNvVideoCodec's errors: PyNvVCException, RuntimeError, a bare Exception
        raise InvalidInput(f"not decodable by nvdec: {type(e).__name__}: {e}") from None
    if time.monotonic() > deadline:
        raise DecodeTimeout(f"decoding the clip took more than {max_decode_seconds:g} s, over the limit of "
                                f"--max-video-decode-seconds {max_decode_seconds:g}")
    return host
