"""The device half of preprocessing for a whole batch: what a model's ``pixel_values`` runs.

Inputs arrive from the CPU half in four kinds: decoded uint8 images, a clip's sampled uint8 frames,
client patch bytes, and, with ``--decode nvjpeg``, JPEG files to decode on the device. The first three
go to the device in one pinned copy (``bytes_to_device``); the JPEGs in one batched nvJPEG
call. Each image (each clip's frames) is then resized / padded, normalized through the value table
and patchified, in the batch's order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .nvjpeg import JpegImage, UndecodableInputs, decode_on_device
from .staged import (
    DecodedClip,
    RawPatches,
    StagedInput,
    apply_table,
    bytes_to_device,
    clip_frames,
    fit_image,
    image_tensor,
    patches_from_bytes,
)


def batch_pixel_values(inputs: Sequence[StagedInput | JpegImage], device: torch.device, dtype: torch.dtype, *,
                       mode: str, patch_dim: int, table: Callable[[], torch.Tensor],
                       patchify: Callable[[torch.Tensor], torch.Tensor],
                       clip_table: Callable[[], torch.Tensor] | None = None,
                       patchify_clip: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """[sum(patches), patch_dim] on ``device`` in ``dtype``. ``table()`` gives the value table on
    ``device`` in ``dtype``; ``patchify`` puts a normalized [C, H, W] image in the model's patch order;
    ``clip_table()`` and ``patchify_clip`` do the same for a clip's frames [T, C, H, W] (models that
    take clips as frames). Raises ``UndecodableInputs`` (indices into ``inputs``) where JPEGs fail to
    decode."""
    jpegs = [index for index, item in enumerate(inputs) if isinstance(item, JpegImage)]
    decoded: dict[int, torch.Tensor] = {}
    if jpegs:
        try:
            decoded = dict(zip(jpegs, decode_on_device([inputs[i] for i in jpegs], device)))
        except UndecodableInputs as exc:
            raise UndecodableInputs({jpegs[i]: error for i, error in exc.errors.items()}) from None
    rest = [item for item in inputs if not isinstance(item, JpegImage)]
    on_device = iter(bytes_to_device(rest, device)) if rest else iter(())
    parts = []
    for index, item in enumerate(inputs):
        if isinstance(item, JpegImage):
            image = fit_image(decoded[index], item, "torch")  # only the torch mode resizes on the device
        elif isinstance(item, RawPatches):
            parts.append(patches_from_bytes(next(on_device), item, patch_dim, dtype))
            continue
        elif isinstance(item, DecodedClip):
            if clip_table is None or patchify_clip is None:
                raise TypeError("a clip's frames reached a model that takes no clips as frames")
            parts.append(patchify_clip(apply_table(clip_frames(next(on_device), item, mode), clip_table())))
            continue
        else:
            image = image_tensor(next(on_device), item, mode)
        parts.append(patchify(apply_table(image, table())))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
