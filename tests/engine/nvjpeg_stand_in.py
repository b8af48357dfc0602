"""``--decode nvjpeg`` without a GPU (tests/engine/test_nvjpeg_decode.py, test_nvjpeg_devices.py): test
JPEGs, a Pillow-backed stand-in for the device decoder (the ``stand_in`` fixture of tests/engine/conftest.py
installs it; a worker process imports it from here), the same weights decoding both ways, and the forward
figures."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from encoder_service.metrics import ServiceMetrics
from encoder_service.models import load_vision_model


def photo(width: int = 90, height: int = 60, seed: int = 0) -> Image.Image:
    """Smooth colours with some edges: JPEG-friendly, and not symmetric under any flip."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // width, y * 255 // height, (x + 2 * y) % 256], axis=-1).astype(np.int16)
    rgb += rng.integers(-20, 20, rgb.shape, dtype=np.int16)
    return Image.fromarray(rgb.clip(0, 255).astype(np.uint8))


def jpeg(image: Image.Image, orientation: int = 1, **save) -> bytes:
    buffer = io.BytesIO()
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    image.save(buffer, "JPEG", quality=90, exif=exif.tobytes(), **save)
    return buffer.getvalue()


def stored_pixels(data: bytes) -> torch.Tensor:
    """uint8 [3, H, W] as stored in the file (no EXIF orientation): what nvJPEG returns."""
    return torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB"))).permute(2, 0, 1).contiguous()


class PillowStandIn:
    """Stands in for ``torchvision.io.decode_jpeg`` on CUDA: Pillow's pixels, as stored; files in
    ``bad`` fail as nvJPEG fails (RuntimeError), so does any batch call that holds one."""

    def __init__(self, bad: tuple[bytes, ...] = ()) -> None:
        self.bad = set(bad)
        self.calls: list[int] = []  # files per call

    def __call__(self, files, device):
        batch = files if isinstance(files, list) else [files]
        self.calls.append(len(batch))
        datas = [file.numpy().tobytes() for file in batch]
        if any(data in self.bad for data in datas):
            raise RuntimeError("nvjpeg: the bitstream is corrupt")
        out = [stored_pixels(data) for data in datas]
        return out if isinstance(files, list) else out[0]


def models(family: str = "tiny-qwen2.5-vl"):
    """The same weights twice in torch preprocessing: decoding with Pillow, and with 'nvjpeg'."""
    pillow = load_vision_model(family, preprocess="torch")
    gpu = load_vision_model(family, preprocess="torch")
    gpu.set_decode("nvjpeg")
    return pillow, gpu


def forward_figures(metrics: ServiceMetrics) -> dict[str, float]:
    """Forward passes and the images through them, over every device."""
    samples = [s for family in metrics.registry.collect() for s in family.samples]

    def total(name: str) -> float:
        return sum(s.value for s in samples if s.name == name)
    return {"batches": total("encoder_service_forward_batches_total"),
            "images": total("encoder_service_batch_images_sum")}
