"""``--decode-in workers`` (the default with ``--devices``): the worker processes decode the JPEGs and PNGs
of their own batches; the front end reads only their headers (preprocess/worker_decode.py).

Checked here: the header says what the decode gives (sizes after EXIF orientation, every limit and its
error), the hand-off carries the file and its limits, worker processes give the embeddings the
in-process path gives, the front end decodes no JPEG or PNG when workers exist (every PIL decode in
this process is counted; the workers are other processes), the formats and images that stay in the
front end, an image whose decode fails in a worker failing alone in its batch, and the worker's decode
bounded by --max-decode-seconds. Against a real server process: that bound, the worker serving on.
"""

from __future__ import annotations

import asyncio
import io

import grpc
import numpy as np
import pytest
import torch
from encoder_client import EncoderClient
from encoder_client.errors import EncoderClientError
from nvjpeg_stand_in import jpeg, photo
from PIL import Image, ImageFile, PngImagePlugin
from prometheus_client import CollectorRegistry

from encoder_service.config import ServiceConfig
from encoder_service.config_flags import parse_serve_args
from encoder_service.engine import Engine, ImageInput
from encoder_service.engine.handoff import copy_bytes, describe, rebuild
from encoder_service.engine.shared_buffer import SharedBuffer
from encoder_service.errors import InvalidInput, ResourceExhausted
from encoder_service.metrics import ServiceMetrics
from encoder_service.models import load_vision_model
from encoder_service.preprocess import decode, jpeg_direct
from encoder_service.preprocess.worker_decode import EncodedImage, decoding_in_workers

pytestmark = pytest.mark.timeout(240)


def encoded(image: Image.Image, fmt: str, **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save)
    return buffer.getvalue()


def png_with_exif(image: Image.Image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encoded(image, "PNG", exif=exif.tobytes())


@pytest.fixture(scope="module")
def model():
    return load_vision_model("tiny-qwen2.5-vl", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def front(model):
    return decoding_in_workers(model.front(), 5.0)


def ordinary(fn, *args):
    """``fn(*args)`` on an ordinary decode thread (the engine's budget: expensive images go elsewhere)."""
    with decode.decode_budget(5.0, expensive_pixels=1 << 22):
        return fn(*args)


# --- the header -----------------------------------------------------------------------------------
@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_a_jpegs_header_gives_the_size_its_decode_displays(orientation):
    data = jpeg(photo(150, 70, seed=1), orientation)
    header = decode.read_header(data, None)
    shown = decode.open_image(data, None)
    assert (header.format, header.height, header.width) == ("JPEG", shown.height, shown.width)


def png_with_xmp(image: Image.Image, orientation: int) -> bytes:
    """A PNG whose orientation is only in its XMP (what exiftool and Adobe write), which Pillow applies too."""
    info = PngImagePlugin.PngInfo()
    info.add_itxt("XML:com.adobe.xmp", '<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf='
                  '"http://www.w3.org/1999/02/22-rdf-syntax-ns#"><rdf:Description xmlns:tiff='
                  f'"http://ns.adobe.com/tiff/1.0/" tiff:Orientation="{orientation}"/></rdf:RDF></x:xmpmeta>')
    return encoded(image, "PNG", pnginfo=info)


def exif_after_pixels(png: bytes, kind: bytes = b"eXIf") -> bytes:
    """The PNG with its ``kind`` chunk moved after its image data (before IEND), as PNG allows."""
    chunks, offset = [], 8
    while offset < len(png):
        length = int.from_bytes(png[offset:offset + 4], "big")
        chunks.append(png[offset:offset + 12 + length])
        offset += 12 + length
    moved = [c for c in chunks if c[4:8] == kind]
    rest = [c for c in chunks if c[4:8] != kind]
    assert len(moved) == 1 and rest[-1][4:8] == b"IEND"
    return png[:8] + b"".join(rest[:-1] + moved + rest[-1:])


def test_a_png_header_is_read_with_its_orientation_and_others_are_left_to_the_decode():
    image = photo(90, 60, seed=2)
    for data in (encoded(image, "PNG"), png_with_exif(image, 6), png_with_xmp(image, 8)):
        header = decode.read_header(data, None)
        shown = decode.open_image(data, None)
        assert (header.format, header.height, header.width) == ("PNG", shown.height, shown.width)
    for data in (png_with_exif(image, 6), png_with_xmp(image, 8)):
        assert decode.open_image(data, None).size == (60, 90)  # the orientation was applied
    # Pillow reads an eXIf or text chunk after the pixels only while decoding: only the decode can tell the size.
    for late in (exif_after_pixels(png_with_exif(image, 6)), exif_after_pixels(png_with_xmp(image, 6), b"iTXt")):
        assert decode.open_image(late, None).size == (60, 90)
        assert decode.read_header(late, None) is None
    for fmt in ("WEBP", "GIF"):
        assert decode.read_header(encoded(image, fmt), None) is None


def test_the_header_refuses_what_the_decode_refuses_with_the_same_words():
    big = jpeg(photo(400, 300, seed=3))
    for data, limit in ((big, 400 * 300 - 1), (jpeg(photo(2000, 8, seed=4)), None), (b"\xff\xd8garbage", None)):
        with pytest.raises((InvalidInput, ResourceExhausted)) as want:
            decode.open_image(data, limit)
        with pytest.raises(type(want.value)) as got:
            decode.read_header(data, limit)
        assert str(got.value) == str(want.value)


def test_the_header_sends_an_expensive_image_to_the_expensive_pool():
    with decode.decode_budget(5.0, expensive_pixels=100 * 100), pytest.raises(decode.ExpensiveImage):
        decode.read_header(jpeg(photo(200, 100, seed=5)), None)


# --- the front end's half and the hand-off ---------------------------------------------------------
def test_ordinary_jpegs_and_pngs_cross_as_their_bytes_with_the_grid_the_decode_gives(model, front):
    for data in (jpeg(photo(150, 70, seed=1), 6), encoded(photo(90, 60, seed=2), "PNG")):
        item = ordinary(front.decode_image, data, None)
        assert isinstance(item, EncodedImage) and bytes(item.data) == data
        want = model.decode(data)
        assert (item.grid, item.resize_to, item.pad_to) == (want.grid, want.resize_to, want.pad_to)
        assert (item.max_image_pixels, item.decode_seconds) == (None, 5.0)


def test_other_formats_and_the_expensive_pool_decode_in_the_front_end(model, front):
    gif = encoded(photo(90, 60, seed=2), "GIF")
    assert not isinstance(ordinary(front.decode_image, gif, None), EncodedImage)
    # The expensive pool's decodes (no routing budget) run here, as before: a worker holds batch mates.
    data = jpeg(photo(150, 70, seed=1))
    with decode.decode_budget(5.0):
        item = front.decode_image(data, None)
    assert not isinstance(item, EncodedImage)
    assert np.array_equal(item.pixels, model.decode(data).pixels)


def test_an_encoded_image_crosses_the_hand_off_with_its_limits(front):
    item = ordinary(front.decode_image, jpeg(photo(150, 70, seed=1)), 12345)
    buffer = SharedBuffer.create(64 + item.nbytes)
    try:
        copy_bytes(buffer.view(64, item.nbytes), item.host_bytes())
        rebuilt = rebuild(buffer, describe(64, item))
        assert isinstance(rebuilt, EncodedImage) and bytes(rebuilt.data) == item.data
        assert (rebuilt.resize_to, rebuilt.pad_to, rebuilt.grid, rebuilt.max_image_pixels, rebuilt.decode_seconds) \
            == (item.resize_to, item.pad_to, item.grid, 12345, 5.0)
        del rebuilt
    finally:
        buffer.close()


# --- worker processes -------------------------------------------------------------------------------
class CountedLoads:
    """Every pixel decode run in this process, by format: Pillow's (``ImageFile.load``) and a plain JPEG's
    straight into its array (``jpeg_direct.decode``)."""

    def __init__(self, monkeypatch) -> None:
        self.formats: list[str] = []
        load, direct = ImageFile.ImageFile.load, jpeg_direct.decode

        def counted(image):
            self.formats.append(image.format)
            return load(image)

        def counted_direct(data, size, orientation, into=None):
            pixels = direct(data, size, orientation, into)
            if pixels is not None:
                self.formats.append("JPEG")
            return pixels

        monkeypatch.setattr(ImageFile.ImageFile, "load", counted)
        monkeypatch.setattr(jpeg_direct, "decode", counted_direct)


def run_engine(config: ServiceConfig, images: list[bytes], metrics: ServiceMetrics | None = None) -> list:
    """The images as concurrent one-image requests (a long batch wait puts them in one forward)."""
    async def main():
        engine = Engine(config, metrics=metrics or ServiceMetrics(CollectorRegistry()))
        await engine.start()
        try:
            async def encode(data):
                (result,) = [r async for r in engine.encode([ImageInput(index=0, kind="encoded", data=data)])]
                return result
            return await asyncio.gather(*map(encode, images), return_exceptions=True)
        finally:
            await engine.stop()

    return asyncio.run(main())


IMAGES = (jpeg(photo(150, 70, seed=1), 6), encoded(photo(90, 60, seed=2), "PNG"), encoded(photo(64, 50, seed=3), "GIF"))


@pytest.mark.parametrize("decode_in, front_end_decodes", [("auto", ["GIF"]), ("front-end", ["JPEG", "PNG", "GIF"])])
def test_with_workers_the_front_end_decodes_no_jpeg_or_png_and_the_embeddings_do_not_change(
        model, monkeypatch, decode_in, front_end_decodes):
    loads = CountedLoads(monkeypatch)
    config = ServiceConfig(devices="cpu,cpu", batch_wait_ms=300.0, decode_in=decode_in)
    results = run_engine(config, list(IMAGES))
    assert set(loads.formats) == set(front_end_decodes)  # (Pillow may load a GIF more than once)
    for data, result in zip(IMAGES, results, strict=True):
        assert not isinstance(result, BaseException), result
        item = model.decode(data)
        with torch.inference_mode():
            want = model.encode_packed(model.pixel_values([item]), [item.grid])[0]
        assert result.grid == item.grid and result.timing.preprocess_ms > 0
        # float32 on the CPU in other processes and batches: equal up to summation order.
        assert np.linalg.norm(result.embedding.numpy() - want.numpy()) <= 1e-5 * np.linalg.norm(want.numpy())


def forwards(metrics: ServiceMetrics) -> tuple[float, float]:
    """(forwards run, images in them) as the engine counted them."""
    registry = metrics.registry
    return (registry.get_sample_value("encoder_service_batch_images_count", {"device": "cpu:0"}),
            registry.get_sample_value("encoder_service_batch_images_sum", {"device": "cpu:0"}))


def test_an_image_whose_decode_fails_in_a_worker_fails_alone_in_its_batch(monkeypatch):
    loads = CountedLoads(monkeypatch)
    good = jpeg(photo(150, 70, seed=1))
    truncated = good[: len(good) // 2]  # the header reads; the scan data ends early
    metrics = ServiceMetrics(CollectorRegistry())
    results = run_engine(ServiceConfig(devices="cpu", batch_wait_ms=300.0),
                         [truncated, good, jpeg(photo(90, 60, seed=2))], metrics)
    assert isinstance(results[0], InvalidInput) and "truncated or corrupt" in str(results[0])
    assert not isinstance(results[1], BaseException) and not isinstance(results[2], BaseException)
    assert loads.formats == []  # the worker decoded all three
    assert forwards(metrics) == (1, 2)  # one batch of the three: its two good images ran without the bad one


def test_the_workers_decode_is_bounded_by_max_decode_seconds(monkeypatch):
    loads = CountedLoads(monkeypatch)
    rng = np.random.default_rng(0)
    slow = encoded(Image.fromarray(rng.integers(0, 256, (1780, 1780, 3), dtype=np.uint8)), "PNG", compress_level=6)
    (result,) = run_engine(ServiceConfig(devices="cpu", max_decode_seconds=0.02), [slow])
    assert isinstance(result, ResourceExhausted) and "--max-decode-seconds" in str(result), result
    assert loads.formats == []  # refused in the worker: the front end read the header only


def test_decode_in_workers_needs_worker_processes_and_a_cpu_decoder():
    assert ServiceConfig(devices="cpu,cpu").decode_in_workers
    assert not ServiceConfig().decode_in_workers
    assert not ServiceConfig(devices="cpu,cpu", decode_in="front-end").decode_in_workers
    with pytest.raises(ValueError, match="decode-in workers needs --devices"):
        parse_serve_args(["--decode-in", "workers"], environ={})
    with pytest.raises(ValueError, match="--decode nvjpeg decodes on the device"):
        parse_serve_args(["--decode-in", "workers", "--decode", "nvjpeg", "--devices", "0"], environ={})


# --- a real server process -----------------------------------------------------------------------------
def test_a_workers_decode_is_bounded_by_max_decode_seconds_and_the_worker_serves_on(start_encoder_server):
    # A large PNG of noise, under the size the expensive-decode pool takes (16 x the tiny model's
    # max_pixels): its header reads in well under a millisecond in the front end; its decode, in the
    # worker, takes ~30-70 ms of a core, over the bound.
    rng = np.random.default_rng(0)
    slow = encoded(Image.fromarray(rng.integers(0, 256, (1780, 1780, 3), dtype=np.uint8)), "PNG", compress_level=6)
    quick = encoded(photo(90, 60, seed=2), "PNG")
    server = start_encoder_server("--devices", "cpu", "--max-decode-seconds", "0.02")
    with EncoderClient(server.target, timeout_s=60) as client:
        with pytest.raises(EncoderClientError) as refused:
            client.encode([slow])
        (ok,) = client.encode([quick])
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-decode-seconds" in refused.value.details, refused.value.details
    assert tuple(ok.grid_thw) == (1, 4, 6)
