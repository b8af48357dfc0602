"""How a batch crosses between the front end and a worker process: its inputs laid out in a shared
buffer (described by plain tuples sent over the pipe), its embeddings packed into another.

Both ends copy through torch, which copies without holding the GIL (numpy holds it: megabytes per
image would stall the front end's event loop).
"""

from __future__ import annotations

import warnings

from ..torch_dtypes import torch_dtype
from .batch_queue import WorkItem
from .shared_buffer import SharedBuffer

# A worker process holds at most IN_FLIGHT batches: one on the device, the next launched behind it, and a
# third whose files decode meanwhile. With two (the in-process worker's depth), the batch after the running
# one could only come once the one before was answered, and its files then had that forward's remaining time
# to decode and launch: on four GPUs of one host the devices were 86-91% busy against 97-99% with one or two
# (bench/RESULTS.md). The third gets a whole forward more.
IN_FLIGHT = 3
LAUNCHED = 2  # of those, at most this many launched on the device at once (FlashInfer's PLANS_IN_FLIGHT counts on it)
SLOTS = IN_FLIGHT + 1  # shared buffers each way: one more for the batch being copied out
POLL_S = 0.0005  # while one batch runs: how often the worker looks for the next batch
ALIGN = 64


def copy_bytes(dst, src) -> None:
    """dst[:] = src for uint8 arrays."""
    import torch

    if not len(src):
        return
    with warnings.catch_warnings():  # a read-only source (request bytes) is only read here
        warnings.simplefilter("ignore", UserWarning)
        source = torch.from_numpy(src)
    torch.from_numpy(dst).copy_(source)


def describe(offset: int, payload) -> tuple:
    """One input (decoded image, a clip's frames, a JPEG file to decode on the device, an image file the
    worker decodes, or client patches) at ``offset`` of the input buffer, as a tuple."""
    from ..preprocess.nvjpeg import JpegImage
    from ..preprocess.staged import DecodedClip, DecodedImage
    from ..preprocess.worker_decode import EncodedImage

    if isinstance(payload, DecodedImage):
        return ("image", offset, payload.nbytes, payload.pixels.shape, payload.resize_to, payload.pad_to,
                payload.grid)
    if isinstance(payload, DecodedClip):
        return ("clip", offset, payload.nbytes, payload.frames.shape, payload.resize_to, payload.grid, payload.pad_to)
    if isinstance(payload, JpegImage):
        return ("jpeg", offset, payload.nbytes, payload.orientation, payload.size, payload.resize_to,
                payload.pad_to, payload.grid)
    if isinstance(payload, EncodedImage):
        return ("encoded", offset, payload.nbytes, payload.resize_to, payload.pad_to, payload.grid,
                payload.max_image_pixels, payload.decode_seconds)
    return ("patches", offset, payload.nbytes, payload.dtype, payload.grid)


def rebuild(buffer: SharedBuffer, described: tuple):
    """The worker's side of ``describe``: the input as a view of the shared buffer (no copy)."""
    from ..preprocess.nvjpeg import JpegImage
    from ..preprocess.staged import DecodedClip, DecodedImage, RawPatches
    from ..preprocess.worker_decode import EncodedImage

    if described[0] == "image":
        _, offset, nbytes, shape, resize_to, pad_to, grid = described
        return DecodedImage(buffer.view(offset, nbytes).reshape(shape), tuple(resize_to), tuple(pad_to), tuple(grid))
    if described[0] == "clip":
        _, offset, nbytes, shape, resize_to, grid, pad_to = described
        return DecodedClip(buffer.view(offset, nbytes).reshape(shape), tuple(resize_to), tuple(grid),
                           None if pad_to is None else tuple(pad_to))
    if described[0] == "jpeg":
        # The file's bytes stay in the shared buffer (a writable view: the device decoder reads it
        # in place, see nvjpeg.decode_on_device); the slot is not written again before the batch
        # after next, long after the decode.
        _, offset, nbytes, orientation, size, resize_to, pad_to, grid = described
        return JpegImage(memoryview(buffer.view(offset, nbytes)), orientation, tuple(size), tuple(resize_to),
                         tuple(pad_to), tuple(grid))
    if described[0] == "encoded":  # decoded by the worker before its batch launches (the slot is not reused)
        _, offset, nbytes, resize_to, pad_to, grid, max_image_pixels, seconds = described
        return EncodedImage(memoryview(buffer.view(offset, nbytes)), tuple(resize_to), tuple(pad_to), tuple(grid),
                            max_image_pixels, seconds)
    _, offset, nbytes, dtype, grid = described
    return RawPatches(memoryview(buffer.view(offset, nbytes)), dtype, tuple(grid))


def copy_out(buffer: SharedBuffer, batch: list[WorkItem], front) -> list:
    """Each image's embedding, copied out of the output buffer into a tensor of its own (the cache
    keeps it; the buffer is written again by a later batch), warm where it can (warm_memory.py)."""
    import torch

    from .warm_memory import HOST_COPIES

    dtype = torch_dtype(front.dtype)
    width = front.spec.row_width  # every feature level of a token travels in its row
    tokens = [front.num_tokens(item.grid) for item in batch]
    total = sum(tokens) * width
    packed = torch.frombuffer(buffer.array, dtype=dtype, count=total).view(-1, width)
    return HOST_COPIES.copies(packed.split(tokens))
