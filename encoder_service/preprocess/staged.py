"""The two halves of preprocessing: what the CPU hands over, and what the device does with it.

The CPU half decodes (Pillow releases the GIL), applies EXIF orientation and alpha compositing, and
works out the grid; it ships **uint8** pixels. The device half (run by the model on its own device,
batched per forward, in the worker's stream) resizes where the mode says so, pads, rescales and
normalizes through a 256-entry table per channel, and patchifies. Patches sent by clients travel as
their wire bytes and are converted on the device too: no float32 array is built on the host.
"Staged" names only this split: a ``StagedInput`` is what the CPU half hands the device half.

Two modes, pinned by tests against transformers:
- ``pil``: the resize runs on the CPU exactly as transformers' PIL processor does it (Pillow for
  Qwen; PyTorch's fixed-point uint8 kernel on the CPU for Kimi), so the patches are bit-identical
  to that processor's.
- ``torch``: the resize runs on the device with ``F.interpolate(bicubic, antialias=True)``, as
  transformers' default (torchvision-backed) processor does: on the CPU on uint8 directly (PyTorch's
  uint8 kernel), elsewhere in float32, then clamped and rounded back to uint8.

Rescale and normalize are elementwise functions of (channel, byte), so a table of the 256 values
per channel, computed once on the CPU with the reference's exact operations, gives bit-identical
results on any device (a gather, no arithmetic on the device).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from encoder_client.protocol.dtypes import BY_NAME

from ..errors import InvalidInput
from ..torch_dtypes import torch_dtype
from . import interrupt
from .thread_hook import ThreadHook

Grid = tuple[int, int, int]
PREPROCESS_MODES = ("pil", "torch")
# The pinned buffer's offsets are aligned so every input can be viewed in its own dtype on the device.
_ALIGN = 64


def resolve_mode(mode: str, device: torch.device) -> str:
    """``auto`` -> ``torch`` on an accelerator, ``pil`` on the CPU."""
    if mode == "auto":
        return "pil" if device.type == "cpu" else "torch"
    if mode not in PREPROCESS_MODES:
        raise InvalidInput(f"unknown preprocess mode {mode!r}; valid: auto, {', '.join(PREPROCESS_MODES)}")
    return mode


@dataclass(frozen=True, eq=False)
class DecodedImage:
    """One decoded image as the CPU hands it to the device.

    ``pixels`` is uint8 [H, W, 3] RGB. The device resizes it to ``resize_to`` (a no-op when the
    CPU already did, or when the size is unchanged), zero-pads bottom/right to ``pad_to``, and
    patchifies into ``grid``.
    """

    pixels: np.ndarray
    resize_to: tuple[int, int]
    pad_to: tuple[int, int]
    grid: Grid

    @property
    def nbytes(self) -> int:
        return int(self.pixels.nbytes)

    def host_bytes(self) -> np.ndarray:
        return self.pixels.reshape(-1)


class BytesPayload:
    """An input that travels as the bytes it came in (``data``): client patches, a JPEG file."""

    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def host_bytes(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.uint8)


@dataclass(frozen=True, eq=False)
class RawPatches(BytesPayload):
    """Patches as a client sent them: raw little-endian [t*h*w, patch_dim] in ``dtype``."""

    data: bytes
    dtype: str
    grid: Grid


@dataclass(frozen=True, eq=False)
class DecodedClip:
    """A clip's sampled frames as the CPU hands them to the device: uint8 [T, H, W, 3] RGB, one row
    per frame the model sees (before the temporal padding).

    The device resizes every frame to ``resize_to`` (torch mode; in pil mode the CPU already did,
    with the reference's own CPU kernel), maps each byte through the model's video value table,
    repeats the last frame up to a multiple of the temporal patch size and patchifies into ``grid``
    (the model's ``_patchify_clip``). Shipping uint8 frames instead of float32 patches moves a
    quarter of the bytes, and the resize runs where the model does.
    """

    frames: np.ndarray
    resize_to: tuple[int, int]
    grid: Grid
    pad_to: tuple[int, int] | None = None  # zero-padded bottom/right to this after the resize (Kimi-K2.5)

    @property
    def nbytes(self) -> int:
        return int(self.frames.nbytes)

    def host_bytes(self) -> np.ndarray:
        return self.frames.reshape(-1)


StagedInput = DecodedImage | RawPatches | DecodedClip


def clip_part(payload: StagedInput, start: int, stop: int, frames_per_step: int, patch_dim: int) -> StagedInput:
    """Grid steps ``[start, stop)`` of a clip's payload, as a payload of their own (no copy): a
    ``DecodedClip``'s frames (``frames_per_step`` to a step; the last part keeps the frames the temporal
    padding repeats) or a ``RawPatches``' rows (``h * w`` patches of ``patch_dim`` values to a step)."""
    _, h, w = payload.grid
    grid = (stop - start, h, w)
    if isinstance(payload, DecodedClip):
        frames = payload.frames[start * frames_per_step:stop * frames_per_step]
        return DecodedClip(frames, payload.resize_to, grid, payload.pad_to)
    if isinstance(payload, RawPatches):
        step = h * w * patch_dim * BY_NAME[payload.dtype].itemsize
        return RawPatches(memoryview(payload.data)[start * step:stop * step], payload.dtype, grid)
    raise TypeError(f"a {type(payload).__name__} is not a clip's payload")


def check_frames(frames: np.ndarray) -> None:
    """A clip's decoded frames must be uint8 [T, H, W, 3], T >= 1."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or not len(frames):
        raise InvalidInput(f"video frames must be uint8 [T, H, W, 3], got {frames.dtype} {list(frames.shape)}")


# The bytes of frames one resize call on the host takes at once: between two such groups, a resize
# that is no longer wanted (cancelled, past its time bound) stops (``interrupt.check``).
_HOST_RESIZE_GROUP_BYTES = 32 << 20
_budget = ThreadHook()


def clip_budget(fits: Callable[[int, tuple[int, int], Grid], None]) -> AbstractContextManager[None]:
    """Within the block, on this thread, ``check_clip_fits`` calls ``fits(frames, size, grid)``, which
    raises (ResourceExhausted) for a clip over the server's budgets. The engine sets it around a
    family's ``VideoFront.resize``; the family calls ``check_clip_fits`` as soon as it knows the geometry."""
    return _budget.set(fits)


def check_clip_fits(frames: int, size: tuple[int, int], grid: Grid) -> None:
    """A family's ``resize`` calls this with the clip's geometry (its frames, their size after the resize,
    its grid) BEFORE it resizes anything: a clip over the budgets is refused before the memory is
    taken, whatever pixel bounds the caller asked for. A no-op outside ``clip_budget``."""
    _budget(frames, size, grid)


def resize_frames_on_host(frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """uint8 [T, H, W, 3] -> [T, h, w, 3] with ``resize_uint8``'s CPU kernel (the pil mode's resize of a
    clip, before its device half), in groups of frames (each frame is resized alone by the kernel, so the
    groups change nothing), stopping between groups where the thread's ``interrupt_when`` says so."""
    video = host_tensor(frames).permute(0, 3, 1, 2)
    height, width = int(frames.shape[1]), int(frames.shape[2])
    per_frame = 3 * max(height * width, size[0] * size[1])
    group = max(1, _HOST_RESIZE_GROUP_BYTES // per_frame)
    out = np.empty((frames.shape[0], size[0], size[1], 3), np.uint8)
    for start in range(0, len(video), group):
        interrupt.check()
        resized = resize_uint8(video[start:start + group], size)
        out[start:start + group] = resized.permute(0, 2, 3, 1).numpy()  # host: the CPU half, a CPU tensor
    return out


def check_patch_bytes(data: bytes, dtype: str, grid: Grid, patch_dim: int) -> RawPatches:
    """A client's patch bytes checked against their grid (cheap: lengths only, no conversion)."""
    if dtype not in BY_NAME:
        raise InvalidInput(f"unsupported patches dtype {dtype!r}")
    t, h, w = grid
    expected = t * h * w * patch_dim * BY_NAME[dtype].itemsize
    if len(data) != expected:
        raise InvalidInput(f"patches data has {len(data)} bytes; grid {[t, h, w]} x patch_dim {patch_dim} "
                           f"in {dtype} needs {expected}")
    return RawPatches(data, dtype, (t, h, w))


def torchvision_value_table(mean: tuple[float, ...], std: tuple[float, ...], rescale_factor: float,
                            do_rescale: bool, do_normalize: bool) -> torch.Tensor:
    """float32 [3, 256]: each channel's value for each byte, as transformers' torchvision backend
    computes it (``rescale_and_normalize``): with both steps on, mean and std are divided by the
    rescale factor first (``float32(mean) * (1 / rescale_factor)``), then ``(x - mean') / std'`` in
    float32; rescale alone is ``x * rescale_factor`` in float32.
    """
    x = torch.arange(256, dtype=torch.float32).expand(len(mean), 256)
    m = torch.tensor(mean, dtype=torch.float32)[:, None]
    s = torch.tensor(std, dtype=torch.float32)[:, None]
    if do_rescale and do_normalize:
        x = (x - m * (1.0 / rescale_factor)) / (s * (1.0 / rescale_factor))
    elif do_normalize:
        x = (x - m) / s
    elif do_rescale:
        x = x * rescale_factor
    return x.contiguous()


def resize_uint8(chw: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """uint8 [C, H, W] (or [N, C, H, W]) -> uint8 [C, h, w] ([N, C, h, w]), bicubic with antialias, as
    torchvision's ``resize`` does.

    On the CPU PyTorch has a native uint8 kernel (what torchvision uses there); on other devices
    torchvision computes in float32, then clamps and rounds back to uint8, and so do we.
    """
    if tuple(chw.shape[-2:]) == tuple(size):
        return chw
    batched = chw.dim() == 4  # [N, C, H, W]: frames of one clip, each resized alone by the same kernel
    x = chw if batched else chw.unsqueeze(0)
    if chw.device.type == "cpu":
        out = F.interpolate(x, size=list(size), mode="bicubic", antialias=True, align_corners=False)
    else:
        out = F.interpolate(x.float(), size=list(size), mode="bicubic", antialias=True, align_corners=False)
        out = out.clamp_(0, 255).round_().to(torch.uint8)
    return out if batched else out[0]


def host_tensor(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor over ``array`` (copied only when read-only: decoded images and request bytes
    are, and torch warns on a read-only view)."""
    array = np.ascontiguousarray(array)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def bytes_to_device(inputs: list[StagedInput], device: torch.device) -> list[torch.Tensor]:
    """Each input's host bytes as a uint8 tensor on ``device``.

    On an accelerator: one pinned buffer for the whole batch (each input at an aligned
    offset) and one asynchronous host-to-device copy; the caching host allocator keeps the buffer
    alive until the copy has run. On the CPU: zero-copy views.
    """
    if device.type == "cpu":
        return [host_tensor(item.host_bytes()) for item in inputs]
    offsets = []
    total = 0
    for item in inputs:
        offsets.append(total)
        total += (item.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    pinned = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=True)
    host = pinned.numpy()
    for item, offset in zip(inputs, offsets):
        host[offset:offset + item.nbytes] = item.host_bytes()
    on_device = pinned.to(device, non_blocking=True)
    return [on_device[offset:offset + item.nbytes] for item, offset in zip(inputs, offsets)]


def patches_from_bytes(raw: torch.Tensor, item: RawPatches, patch_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A client's patch bytes (a uint8 tensor on the device) -> [n, patch_dim] in ``dtype``."""
    values = raw.view(torch_dtype(item.dtype)) if item.dtype != "uint8" else raw
    # Through float32: the model's reference input dtype (a uint8 or bf16 patch widens exactly).
    return values.view(-1, patch_dim).to(torch.float32).to(dtype)


def image_tensor(raw: torch.Tensor, item: DecodedImage, mode: str) -> torch.Tensor:
    """A decoded image's bytes on the device -> uint8 [3, H, W], resized (torch mode) and padded."""
    height, width, channels = item.pixels.shape
    return fit_image(raw.view(height, width, channels).permute(2, 0, 1), item, mode)


def fit_image(chw: torch.Tensor, item, mode: str) -> torch.Tensor:
    """uint8 [3, H, W] on the device -> resized to ``item.resize_to`` (torch mode) and padded to
    ``item.pad_to``; a decoded image's pixels, or a JPEG's decoded on the device."""
    if mode == "torch":
        chw = resize_uint8(chw.contiguous(), item.resize_to)
    elif tuple(chw.shape[-2:]) != tuple(item.resize_to):
        raise InvalidInput(f"pil mode: image is {chw.shape[2]}x{chw.shape[1]} but should have been resized on "
                           f"the CPU to {item.resize_to[1]}x{item.resize_to[0]}")
    pad_h = item.pad_to[0] - chw.shape[1]
    pad_w = item.pad_to[1] - chw.shape[2]
    if pad_h or pad_w:
        chw = F.pad(chw, (0, pad_w, 0, pad_h))
    return chw


# Bytes of float32 temporaries one resize call of a clip's frames may take on the device (the frames
# are resized in groups of as many as fit).
_RESIZE_BYTES = 256 << 20


def clip_frames(raw: torch.Tensor, item: DecodedClip, mode: str) -> torch.Tensor:
    """A clip's frame bytes on the device -> uint8 [T, 3, h, w], resized to ``item.resize_to`` (torch
    mode: on the device, frames batched through the same kernel ``resize_uint8`` runs per image) and
    zero-padded to ``item.pad_to`` where it has one."""
    frames, height, width, channels = item.frames.shape
    video = raw.view(frames, height, width, channels).permute(0, 3, 1, 2)
    if (height, width) != tuple(item.resize_to):
        if mode != "torch":
            raise InvalidInput(f"pil mode: clip frames are {width}x{height} but should have been resized on the "
                               f"CPU to {item.resize_to[1]}x{item.resize_to[0]}")
        per_frame = 3 * 4 * max(height * width, item.resize_to[0] * item.resize_to[1])
        group = max(1, _RESIZE_BYTES // per_frame)
        video = torch.cat([resize_uint8(part.contiguous(), item.resize_to) for part in video.split(group)])
    if item.pad_to is not None and tuple(video.shape[-2:]) != tuple(item.pad_to):
        video = F.pad(video, (0, item.pad_to[1] - video.shape[-1], 0, item.pad_to[0] - video.shape[-2]))
    return video


def apply_table(chw: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """uint8 [C, H, W] (or [T, C, H, W]) -> float, same shape, through the per-channel value table
    (table's dtype)."""
    channels = chw.shape[-3]
    # Row offset of each channel in the flattened table; long indices never sync (a uint8 index
    # would be taken as a boolean mask).
    offsets = (torch.arange(channels, device=chw.device) * 256).view(channels, 1, 1)
    return table.view(-1)[chw.long() + offsets]
