"""``--decode nvjpeg`` on the GPU machine (pytest -m gpu; needs torchvision): the real nvJPEG
against Pillow's pixels, a corrupt JPEG failing alone, and a real server process that decodes on
the GPU, against one that decodes with Pillow.

The CPU tests (tests/engine/test_nvjpeg_decode.py) pin everything around the decoder with a Pillow stand-in;
these check the decoder itself. nvJPEG calls that might fault run in a subprocess: an illegal memory
access would poison this process's CUDA context for every later test."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from encoder_service.benchmarks.service_clients import photo_jpeg
from encoder_service.preprocess import nvjpeg

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.allow_skip_on_cpu("needs a CUDA GPU and torchvision's nvJPEG decoder")]


def _photo(height: int, width: int, seed: int = 0, orientation: int = 1) -> bytes:
    """Photo-like content (the service bench's: smooth shapes, texture, sensor noise), resized."""
    image = Image.open(io.BytesIO(photo_jpeg(seed, size=max(height, width)))).crop((0, 0, width, height))
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90, exif=exif.tobytes())
    return buffer.getvalue()


def _edges(height: int, width: int) -> bytes:
    """Hard colour edges everywhere: the worst case for nvJPEG's nearest-neighbour chroma."""
    yy, xx = np.mgrid[0:height, 0:width]
    pixels = np.stack([xx * 255 // width, yy * 255 // height, (xx * yy) % 255], axis=-1).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def _corrupt(data: bytes) -> bytes:
    """The header intact, the entropy-coded data after the start of scan overwritten."""
    sos = data.index(b"\xff\xda")
    body = bytearray(data)
    rng = np.random.default_rng(7)
    body[sos + 40:len(body) - 2] = rng.integers(0, 256, len(body) - sos - 42, dtype=np.uint8).tobytes()
    return bytes(body)


def _sizes_as_is(height, width, config):
    return (height, width), (height, width), (1, height, width)


def _decode(files: list[bytes]) -> list[np.ndarray]:
    items = [nvjpeg.NvjpegDecoder(None, _sizes_as_is, None)(f) for f in files]
    return [t.permute(1, 2, 0).cpu().numpy() for t in nvjpeg.decode_on_device(items, torch.device("cuda"))]


def _pillow(data: bytes) -> np.ndarray:
    return np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data)).convert("RGB")))


def test_nvjpeg_pixels_are_within_a_few_levels_of_pillows_on_photos_and_further_at_hard_edges():
    pytest.importorskip("torchvision")
    photos = [_photo(1008, 1008, seed=1), _photo(333, 500, seed=2)]
    for data, got in zip(photos, _decode(photos)):
        diff = np.abs(got.astype(int) - _pillow(data).astype(int))
        print(f"nvJPEG vs Pillow, photo {got.shape}: max {diff.max()}, mean {diff.mean():.3f}")
        # nvJPEG upsamples 4:2:0 chroma by nearest neighbour, libjpeg interpolates: a few levels on
        # photo-like content (7 measured, bench/RESULTS.md).
        assert diff.max() <= 16 and diff.mean() < 1.0
    edges = _edges(1008, 1008)
    diff = np.abs(_decode([edges])[0].astype(int) - _pillow(edges).astype(int))
    print(f"nvJPEG vs Pillow, hard edges: max {diff.max()}, mean {diff.mean():.3f}")  # ~93 max: the worst case


@pytest.mark.parametrize("orientation", [2, 3, 4, 5, 6, 7, 8])
def test_nvjpeg_images_are_oriented_as_pillow_orients_them(orientation):
    pytest.importorskip("torchvision")
    plain, tagged = _photo(200, 300, seed=3), _photo(200, 300, seed=3, orientation=orientation)
    stored, oriented = _decode([plain, tagged])  # the same scan; only the EXIF tag differs
    # What exif_transpose does to Pillow's pixels, done to nvJPEG's: exact.
    expected = np.asarray(ImageOps.exif_transpose(_with_orientation(Image.fromarray(stored), orientation)))
    assert np.array_equal(oriented, expected)


def _with_orientation(image: Image.Image, orientation: int) -> Image.Image:
    exif = Image.Exif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    image.save(buffer, "PNG", exif=exif.tobytes())  # lossless: the pixels stay nvJPEG's
    return Image.open(io.BytesIO(buffer.getvalue()))


def test_a_corrupt_jpeg_fails_alone_and_its_batch_mates_decode():
    pytest.importorskip("torchvision")
    script = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, sys.argv[1])
        from test_gpu_nvjpeg import _corrupt, _photo
        from encoder_service.preprocess import nvjpeg
        # Built by hand: the header check would send the damaged file to Pillow (scan_is_clean).
        items = [nvjpeg.JpegImage(data, 1, (200, 300), (200, 300), (200, 300), (1, 200, 300))
                 for data in (_photo(200, 300, seed=1), _corrupt(_photo(200, 300, seed=2)))]
        try:
            nvjpeg.decode_on_device(items, torch.device("cuda"))
            print("NO ERROR")
        except nvjpeg.UndecodableInputs as exc:
            print("FAILED", sorted(exc.errors), exc.errors)
        good = nvjpeg.decode_on_device(items[:1], torch.device("cuda"))
        print("AFTER", tuple(good[0].shape))
    """)
    run = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent)], capture_output=True, text=True,
                         timeout=120)
    print(run.stdout, run.stderr[-2000:])
    assert run.returncode == 0, run.stderr[-2000:]
    assert "AFTER (3, 200, 300)" in run.stdout  # the decoder still works after the bad file
    # nvJPEG decoded this damaged scan without an error (H100, torchvision 0.26): then there is
    # nothing to fail, and scan_is_clean keeps such files from it. What must never happen is the good
    # file failing with a bad one.
    assert "FAILED [1]" in run.stdout or "NO ERROR" in run.stdout


def test_a_server_decoding_on_the_gpu_serves_what_a_pillow_server_does_within_decode_noise(start_encoder_server):
    pytest.importorskip("torchvision")
    from encoder_client import EncoderClient, EncoderClientError

    flags = ("--device", "cuda", "--dtype", "float32", "--preprocess", "torch")
    gpu = start_encoder_server(*flags, "--decode", "nvjpeg")
    cpu = start_encoder_server(*flags)
    images = [_photo(1008, 1008, seed=3), _photo(333, 500, seed=4, orientation=6), _photo(61, 97, seed=5)]
    png = io.BytesIO()
    Image.open(io.BytesIO(images[2])).save(png, "PNG")
    images.append(png.getvalue())  # not a JPEG: Pillow on both servers, equal embeddings
    with EncoderClient(gpu.target) as a, EncoderClient(cpu.target) as b:
        info_a, info_b = a.model_info(), b.model_info()
        assert (info_a.decode, info_b.decode) == ("nvjpeg", "pillow")
        assert info_a.cache_namespace != info_b.cache_namespace
        got, want = a.encode(images), b.encode(images)
        for i, (x, y) in enumerate(zip(got, want)):
            assert list(x.grid_thw) == list(y.grid_thw)
            x, y = np.asarray(x.embedding, dtype=np.float64), np.asarray(y.embedding, dtype=np.float64)
            rel = np.linalg.norm(x - y) / np.linalg.norm(y)
            print(f"image {i}: nvjpeg vs pillow server, rel err {rel:.2e}")
            # Random weights of the tiny preset. On photo-like pixels bf16 against float32 moves the
            # 7B tower's embedding ~2% (bench/RESULTS.md); nvJPEG's pixels moved these 1.0% (1008^2)
            # and 2.8% (333x500) on the H100. The 61x97 image is upscaled to a few tokens, where the
            # pixel differences do not average out: 9.8% there.
            assert rel == 0.0 if i == 3 else rel < (0.05 if i < 2 else 0.15)
        # A damaged scan goes to Pillow, which refuses it: nvJPEG alone would encode the garbage.
        with pytest.raises(EncoderClientError) as refused:
            a.encode([_corrupt(images[0])])
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "corrupt" in refused.value.details
        assert len(a.encode([images[1]])) == 1  # and the server goes on serving


def test_a_server_with_worker_processes_decodes_on_its_gpu_as_the_in_process_nvjpeg_server(start_encoder_server):
    # --devices 0: the front end reads only the headers and never opens a CUDA context; the JPEG's
    # bytes cross the shared-memory hand-off and the worker process decodes them with nvJPEG.
    pytest.importorskip("torchvision")
    from encoder_client import EncoderClient
    from repo_paths import import_script

    gpu_processes = import_script("bench/multi_gpu_scaling.py").gpu_processes

    flags = ("--dtype", "float32", "--preprocess", "torch", "--decode", "nvjpeg", "--batch-wait-ms", "0")
    workers = start_encoder_server("--devices", "0", *flags)
    in_process = start_encoder_server("--device", "cuda", *flags)
    images = [_photo(1008, 1008, seed=6), _photo(333, 500, seed=7, orientation=6), _photo(61, 97, seed=8),
              _edges(224, 320)]
    png = io.BytesIO()
    Image.open(io.BytesIO(images[2])).save(png, "PNG")
    images.append(png.getvalue())  # not a JPEG: Pillow on the front end of both servers
    with EncoderClient(workers.target) as a, EncoderClient(in_process.target) as b:
        info_a, info_b = a.model_info(), b.model_info()
        assert (info_a.decode, info_b.decode) == ("nvjpeg", "nvjpeg")
        assert info_a.cache_namespace == info_b.cache_namespace
        got, want = a.encode(images), b.encode(images)
    for i, (x, y) in enumerate(zip(got, want)):
        assert x.content_hash == y.content_hash and list(x.grid_thw) == list(y.grid_thw)
        x, y = np.asarray(x.embedding, dtype=np.float64), np.asarray(y.embedding, dtype=np.float64)
        rel = np.linalg.norm(x - y) / np.linalg.norm(y)
        print(f"image {i}: nvjpeg through a worker process vs in-process, rel err {rel:.2e}")
        # The same decoder and the same tower on the same GPU: equal up to float32 rounding (the
        # two servers may batch the request differently, and GEMM kernels differ by row count).
        assert rel < 1e-4
    seen = gpu_processes(workers.pid, workers.log_text())
    assert seen["front_end_gpus"] == [], seen  # the header-only CPU half never touched the GPU
