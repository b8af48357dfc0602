"""``--decode nvjpeg`` without a GPU: what the CPU half hands over, the orientation, the batch path
with a Pillow-backed stand-in for the device decoder, one undecodable JPEG failing alone, and the
start-up errors. The real nvJPEG is tested on the GPU machine (tests/gpu/test_gpu_nvjpeg.py)."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
import torch
from nvjpeg_stand_in import forward_figures, jpeg, models, photo, stored_pixels
from PIL import Image, ImageOps
from prometheus_client import CollectorRegistry

from encoder_service.config import ServiceConfig
from encoder_service.config_flags import parse_serve_args
from encoder_service.engine import Engine, ImageInput
from encoder_service.errors import BackendUnavailable, InvalidInput, ResourceExhausted
from encoder_service.metrics import ServiceMetrics
from encoder_service.models import load_vision_model
from encoder_service.preprocess import nvjpeg
from encoder_service.preprocess.staged import DecodedImage, RawPatches

pytestmark = pytest.mark.timeout(120)


# --- the CPU half ---------------------------------------------------------------------------------
def test_a_baseline_colour_jpeg_goes_to_the_device_with_its_stored_size_and_orientation():
    assert nvjpeg.jpeg_header(jpeg(photo(90, 60)), None) == (60, 90, 1)
    assert nvjpeg.jpeg_header(jpeg(photo(90, 60), orientation=6), None) == (60, 90, 6)


def damaged(data: bytes, start: int = 40) -> bytes:
    """The header intact, random bytes over the scan data from ``start`` bytes after its marker."""
    sos = data.index(b"\xff\xda")
    rng = np.random.default_rng(7)
    return data[:sos + start] + rng.integers(0, 256, len(data) - sos - start - 2, dtype=np.uint8).tobytes() + data[-2:]


@pytest.mark.parametrize("kind", ["png", "progressive", "grayscale", "cmyk", "truncated", "trailing bytes", "empty",
                                  "damaged scan"])
def test_files_nvjpeg_is_not_given_are_left_to_pillow(kind):
    image = photo()
    data = {
        "png": lambda: (lambda b: (image.save(b, "PNG"), b.getvalue())[1])(io.BytesIO()),
        "progressive": lambda: jpeg(image, progressive=True),
        "grayscale": lambda: jpeg(image.convert("L")),
        "cmyk": lambda: jpeg(image.convert("CMYK")),
        "truncated": lambda: jpeg(image)[:-100],
        "trailing bytes": lambda: jpeg(image) + b"\x00\x00",
        "empty": lambda: b"",
        "damaged scan": lambda: damaged(jpeg(photo(300, 200))),
    }[kind]()
    assert nvjpeg.jpeg_header(data, None) is None


def test_the_scan_check_passes_real_jpegs_with_and_without_restart_markers_and_an_exif_thumbnail():
    image = photo(300, 200)
    thumbnail = io.BytesIO()
    photo(40, 30).save(thumbnail, "JPEG")  # an EXIF thumbnail is a whole JPEG, with a scan of its own
    exif = Image.Exif()
    exif[0x0112] = 3
    with_thumbnail = io.BytesIO()
    image.save(with_thumbnail, "JPEG", exif=exif.tobytes() + thumbnail.getvalue())
    for data in (jpeg(image), jpeg(image, restart_marker_blocks=4), jpeg(image, subsampling=0),
                 with_thumbnail.getvalue()):
        assert nvjpeg.scan_is_clean(data)
    # Damage even deep into the scan is seen; Pillow refuses such a file too.
    assert not nvjpeg.scan_is_clean(damaged(jpeg(image), start=2000))


def test_a_jpeg_header_over_the_limits_is_refused_before_any_decode():
    with pytest.raises(ResourceExhausted, match="over the limit"):
        nvjpeg.jpeg_header(jpeg(photo(90, 60)), max_image_pixels=90 * 60 - 1)
    with pytest.raises(InvalidInput, match="aspect ratio"):
        nvjpeg.jpeg_header(jpeg(photo(402, 2)), None)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orientation_on_the_device_is_what_pillow_exif_transpose_does(orientation):
    data = jpeg(photo(), orientation)
    expected = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data)).convert("RGB")))
    oriented = nvjpeg.orient(stored_pixels(data), orientation).permute(1, 2, 0).numpy()
    assert np.array_equal(oriented, expected)


@pytest.mark.parametrize("family", ["tiny-qwen2.5-vl", "tiny-kimi-k2.5"])
@pytest.mark.parametrize("orientation", [1, 6, 8])
def test_the_header_only_decoder_plans_the_sizes_pillow_decoding_would(family, orientation, stand_in):
    pillow, gpu = models(family)
    data = jpeg(photo(150, 70), orientation)
    planned, decoded = gpu.decode(data), pillow.decode(data)
    assert isinstance(planned, nvjpeg.JpegImage) and isinstance(decoded, DecodedImage)
    assert (planned.resize_to, planned.pad_to, planned.grid) == (decoded.resize_to, decoded.pad_to, decoded.grid)
    assert planned.size == decoded.pixels.shape[:2]


# --- the device half, with the stand-in ---------------------------------------------------------
@pytest.mark.parametrize("family", ["tiny-qwen2.5-vl", "tiny-kimi-k2.5"])
def test_a_mixed_batch_gives_the_same_pixel_values_as_pillow_decoding(family, stand_in):
    pillow, gpu = models(family)
    png = io.BytesIO()
    photo(64, 50, seed=3).save(png, "PNG")
    files = [jpeg(photo(150, 70, seed=1), 6), png.getvalue(), jpeg(photo(80, 120, seed=2))]
    grid = pillow.decode(files[1]).grid
    raw = RawPatches(bytes(pillow.num_patches(grid) * pillow.spec.patch_dim * 4), "float32", grid)
    with torch.inference_mode():
        got = gpu.pixel_values([gpu.decode(files[0]), raw, gpu.decode(files[1]), gpu.decode(files[2])])
        want = pillow.pixel_values([pillow.decode(files[0]), raw, pillow.decode(files[1]), pillow.decode(files[2])])
    assert torch.equal(got, want)
    assert stand_in.calls == [2]  # the batch's two JPEGs in one call; the PNG went through Pillow


def test_an_undecodable_jpeg_is_named_by_its_index_in_the_batch(stand_in):
    _, gpu = models()
    good, bad = jpeg(photo(seed=1)), jpeg(photo(seed=2))
    stand_in.bad.add(bad)
    png = io.BytesIO()
    photo().save(png, "PNG")
    batch = [gpu.decode(png.getvalue()), gpu.decode(good), gpu.decode(bad)]
    with pytest.raises(nvjpeg.UndecodableInputs) as caught:
        gpu.pixel_values(batch)
    assert list(caught.value.errors) == [2]
    assert "nvJPEG" in str(caught.value.errors[2])
    assert stand_in.calls == [2, 1, 1]  # the batch call, then each file alone


def test_a_decoded_size_that_differs_from_the_header_fails_that_image(stand_in, monkeypatch):
    _, gpu = models()
    item = gpu.decode(jpeg(photo(90, 60)))
    monkeypatch.setattr(nvjpeg, "device_decode", lambda files, device: [torch.zeros(3, 60, 91, dtype=torch.uint8)])
    with pytest.raises(nvjpeg.UndecodableInputs) as caught:
        nvjpeg.decode_on_device([item], torch.device("cpu"))
    assert "(3, 60, 91)" in str(caught.value.errors[0])


def test_one_undecodable_jpeg_fails_alone_and_its_batch_mates_are_encoded(stand_in):
    pillow, gpu = models()
    good, bad = jpeg(photo(seed=1)), jpeg(photo(seed=2))
    stand_in.bad.add(bad)

    metrics = ServiceMetrics(CollectorRegistry())

    async def main():
        # A long batch wait puts both requests in one batch.
        engine = Engine(ServiceConfig(batch_wait_ms=300.0), gpu, metrics=metrics)
        await engine.start()
        try:
            async def encode(data):
                return [r async for r in engine.encode([ImageInput(index=0, kind="encoded", data=data)])]
            return await asyncio.gather(encode(good), encode(bad), return_exceptions=True)
        finally:
            await engine.stop()

    ok, failed = asyncio.run(main())
    assert isinstance(failed, InvalidInput) and "could not be decoded on the device" in str(failed)
    with torch.inference_mode():
        want, _ = pillow.encode_packed(pillow.pixel_values([pillow.decode(good)]), [pillow.decode(good).grid])
    assert torch.equal(ok[0].embedding, want)
    # One forward, of the one image that ran: the bad one is no 0-s forward batch of its own.
    assert forward_figures(metrics) == {"batches": 1, "images": 1}


# --- choosing it ----------------------------------------------------------------------------------
def test_nvjpeg_has_a_cache_namespace_of_its_own_and_pillow_keeps_its_old_one(stand_in):
    pillow, gpu = models()
    assert pillow.cache_namespace != gpu.cache_namespace
    assert gpu.front().decode == "nvjpeg" and pillow.front().decode == "pillow"
    again = load_vision_model("tiny-qwen2.5-vl", preprocess="torch")
    again.set_decode("pillow")
    assert again.cache_namespace == pillow.cache_namespace


def test_nvjpeg_is_refused_where_it_cannot_run():
    model = load_vision_model("tiny-qwen2.5-vl", preprocess="torch")
    with pytest.raises(BackendUnavailable, match="needs a CUDA device"):
        model.set_decode("nvjpeg")
    with pytest.raises(InvalidInput, match="needs preprocess torch"):
        load_vision_model("tiny-qwen2.5-vl", preprocess="pil").set_decode("nvjpeg")
    with pytest.raises(InvalidInput, match="unknown decode"):
        model.set_decode("libjpeg")
    assert parse_serve_args(["--decode", "nvjpeg"], environ={}).decode == "nvjpeg"
