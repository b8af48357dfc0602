"""A plain JPEG decoded straight into its array (preprocess/jpeg_direct.py) gives Pillow's pixels, byte for
byte, and every other file still goes to Pillow: transformers decodes with Pillow, so anything else would
change the embeddings the service is proven equal on."""

from __future__ import annotations

import io
import struct
from fractions import Fraction

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from encoder_service.benchmarks.reliability.fuzz_inputs import jpeg_scan_bomb, jpeg_segments
from encoder_service.benchmarks.service_clients import photo_pixels
from encoder_service.errors import InvalidInput
from encoder_service.preprocess import decode, jpeg_direct


def pillow_pixels(data: bytes) -> np.ndarray:
    """What the model's processor gets: Pillow's decode, EXIF-oriented, as transformers' RGB array."""
    return np.asarray(decode.decode_image(data, None))


@pytest.fixture
def direct(monkeypatch) -> list[bool]:
    """Each call of the direct path, as whether it gave pixels (False: it handed the file to Pillow)."""
    calls: list[bool] = []
    real = jpeg_direct.decode

    def spy(data, size, orientation, into=None):
        pixels = real(data, size, orientation, into)
        calls.append(pixels is not None)
        return pixels

    monkeypatch.setattr(jpeg_direct, "decode", spy)
    return calls


def save(image: Image.Image, **kw) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", **kw)
    return out.getvalue()


def assert_same_as_pillow(data: bytes, direct: list[bool], taken: bool = True) -> None:
    got = decode.decode_rgb(data, None)
    want = pillow_pixels(data)
    assert got.dtype == np.uint8 and got.flags.c_contiguous
    assert got.shape == want.shape
    assert np.array_equal(got, want), f"{np.count_nonzero(got != want)} bytes differ from Pillow's"
    if taken:
        assert direct and direct[-1], "the direct path did not give this file's pixels"
    else:
        assert not any(direct), "the direct path gave pixels for a file it must leave to Pillow"


SIZES = [(1, 1), (7, 13), (17, 9), (64, 48), (333, 201), (1008, 1008)]


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("subsampling", [0, 1, 2], ids=["444", "422", "420"])
@pytest.mark.parametrize("progressive", [False, True], ids=["sequential", "progressive"])
def test_pillow_written_jpegs_decode_to_pillows_pixels(size, subsampling, progressive, direct):
    for quality in (5, 75, 95, 100):
        image = Image.fromarray(photo_pixels(sum(size) + quality, *size))
        data = save(image, quality=quality, subsampling=subsampling, progressive=progressive)
        assert_same_as_pillow(data, direct)


@pytest.mark.parametrize("sampling", ["444", "422", "420", "440", "411"])
def test_libjpeg_turbo_written_subsamplings_decode_to_pillows_pixels(sampling, direct):
    # 4:4:0 and 4:1:1 are written by libjpeg-turbo's own encoder (Pillow writes neither), with odd sides that
    # leave partial chroma blocks at both edges.
    for width, height in ((333, 201), (64, 48), (5, 3)):
        data = simplejpeg.encode_jpeg(photo_pixels(width, width, height), quality=85, colorsubsampling=sampling)
        assert_same_as_pillow(data, direct)


@pytest.mark.parametrize("pix_fmt", ["yuvj420p", "yuvj422p", "yuvj444p"])
def test_ffmpeg_written_jpegs_decode_to_pillows_pixels(pix_fmt, direct):
    # Another encoder's headers and tables (FFmpeg's MJPEG, as a camera or a frame grabber writes them).
    import av  # here, not above: the GPU machine runs this file without PyAV

    codec = av.CodecContext.create("mjpeg", "w")
    codec.width, codec.height, codec.pix_fmt = 250, 142, pix_fmt
    codec.time_base = Fraction(1, 25)
    frame = av.VideoFrame.from_ndarray(photo_pixels(3, 250, 142), format="rgb24").reformat(format=pix_fmt)
    data = b"".join(bytes(packet) for packet in codec.encode(frame)) + b"".join(
        bytes(packet) for packet in codec.encode(None))
    assert data[:2] == b"\xff\xd8"
    assert_same_as_pillow(data, direct)


def test_grayscale_jpegs_decode_to_pillows_rgb(direct):
    grey = Image.fromarray(photo_pixels(5, 97, 61)[..., 1])
    for progressive in (False, True):
        assert_same_as_pillow(save(grey, quality=80, progressive=progressive), direct)


def test_restart_markers_and_optimised_tables_decode_to_pillows_pixels(direct):
    image = Image.fromarray(photo_pixels(6, 300, 170))
    assert_same_as_pillow(save(image, quality=90, restart_marker_blocks=3), direct)
    assert_same_as_pillow(save(image, quality=90, restart_marker_rows=1, optimize=True), direct)
    assert b"\xff\xdd" in save(image, restart_marker_blocks=3)  # the DRI segment is really there


@pytest.mark.parametrize("orientation", range(1, 10))
def test_every_exif_orientation_turns_as_pillow_turns(orientation, direct):
    # 9 is no orientation EXIF knows: left as it is, as exif_transpose leaves it.
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = save(Image.fromarray(photo_pixels(orientation, 45, 30)), quality=90, exif=exif)
    assert_same_as_pillow(data, direct)
    turned = decode.decode_rgb(data, None)
    assert turned.shape[:2] == ((45, 30) if orientation in (5, 6, 7, 8) else (30, 45))


def test_an_orientation_in_xmp_turns_as_pillow_turns(direct):
    xmp = (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
           b'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>')
    data = save(Image.fromarray(photo_pixels(8, 40, 24)), quality=90, xmp=xmp)
    assert_same_as_pillow(data, direct)
    assert decode.decode_rgb(data, None).shape[:2] == (40, 24)


def test_cmyk_jpegs_are_left_to_pillow(direct):
    cmyk = Image.fromarray(photo_pixels(9, 64, 40)).convert("CMYK")
    assert_same_as_pillow(save(cmyk, quality=90), direct, taken=False)
    assert direct == []  # not even asked: Pillow reads its mode from the header


def test_jpegs_of_more_scans_than_ordinary_are_left_to_pillow(direct):
    # Pillow's decode reads them a piece at a time, each piece checked against the decode's time budget.
    data = jpeg_scan_bomb(64, decode.ORDINARY_JPEG_SCANS)
    assert decode.jpeg_scans(data) > decode.ORDINARY_JPEG_SCANS
    assert_same_as_pillow(data, direct, taken=False)
    assert direct == []


def test_a_jpeg_libjpeg_warns_about_gets_pillows_answer(direct):
    # Stray bytes between the scan and EOI: libjpeg warns ("extraneous bytes before marker") and decodes;
    # the direct path is strict and hands the file to Pillow, which gives the pixels it always gave.
    data = save(Image.fromarray(photo_pixels(10, 64, 40)), quality=90)
    eoi = jpeg_segments(data)[-1][1]
    damaged = data[:eoi] + b"\x12\x34\x56" + data[eoi:]
    assert_same_as_pillow(damaged, direct, taken=False)
    assert direct == [False]


def test_a_truncated_jpeg_is_refused_as_before(direct):
    data = save(Image.fromarray(photo_pixels(11, 200, 120)), quality=90)
    with pytest.raises(InvalidInput, match="truncated or corrupt"):
        decode.decode_image(data[: len(data) // 2], None)
    with pytest.raises(InvalidInput, match="truncated or corrupt"):
        decode.decode_rgb(data[: len(data) // 2], None)
    assert direct == [False]


def test_the_pixel_limit_is_checked_before_the_direct_path(direct):
    data = save(Image.fromarray(photo_pixels(12, 100, 100)), quality=90)
    with pytest.raises(Exception, match="over the limit of 9999 pixels"):
        decode.decode_rgb(data, 9999)
    assert direct == []


def test_orientations_of_other_arrays_match_pillows_transposes():
    pixels = photo_pixels(13, 7, 5)
    methods = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
               5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
               8: Image.Transpose.ROTATE_90}
    for orientation, method in methods.items():
        want = np.asarray(Image.fromarray(pixels).transpose(method))
        assert np.array_equal(jpeg_direct.oriented(pixels, orientation), want), orientation


def test_a_decode_lands_in_the_memory_its_thread_was_given(direct):
    # decode.decode_into: the engine's decode threads hand out memory already mapped (engine/warm_memory.py).
    data = save(Image.fromarray(photo_pixels(14, 90, 60)), quality=90)
    given: list[np.ndarray] = []

    def take(nbytes: int) -> np.ndarray:
        given.append(np.full(nbytes, 0xAB, np.uint8))  # a byte left unwritten would show
        return given[-1]

    with decode.decode_into(take):
        pixels = decode.decode_rgb(data, None)
    assert [g.nbytes for g in given] == [90 * 60 * 3]
    assert np.shares_memory(pixels, given[0])
    assert np.array_equal(pixels, pillow_pixels(data))
    assert not np.shares_memory(decode.decode_rgb(data, None), given[0])  # outside the block: new memory
    # A turned image is a copy: the buffer given is not what comes back.
    exif = Image.Exif()
    exif[0x0112] = 6
    turned = save(Image.fromarray(photo_pixels(14, 90, 60)), quality=90, exif=exif)
    with decode.decode_into(take):
        pixels = decode.decode_rgb(turned, None)
    assert not np.shares_memory(pixels, given[-1]) and np.array_equal(pixels, pillow_pixels(turned))


def test_a_header_libjpeg_reads_otherwise_than_pillow_is_left_to_pillow():
    # Every limit was checked against the size Pillow's parser read: a file libjpeg-turbo sizes otherwise
    # must not be decoded (nor its memory allocated) by the direct path.
    data = save(Image.fromarray(photo_pixels(15, 40, 30)), quality=90)
    assert jpeg_direct.decode(data, (30, 40), 1) is not None
    assert jpeg_direct.decode(data, (30, 41), 1) is None
    assert jpeg_direct.decode(data, (31, 40), 1, into=lambda nbytes: pytest.fail("memory asked for")) is None


def exif_with(orientation: int, *entries: bytes) -> bytes:
    """Big-endian EXIF of the orientation tag and ``entries`` (12 bytes each, values inline or after the IFD)."""
    count = 1 + len(entries)
    ifd = struct.pack(">H", count) + struct.pack(">HHIHH", 0x0112, 3, 1, orientation, 0) + b"".join(entries)
    return b"Exif\0\0MM\0*\0\0\0\x08" + ifd + b"\0\0\0\0"


@pytest.mark.parametrize("orientation", [1, 6])
def test_an_exif_pillow_cannot_write_back_is_refused_as_pillow_refuses_it(orientation, direct):
    # exif_transpose writes a turned image's EXIF back without its orientation tag, and a ResolutionUnit
    # stored as ASCII fails there (a struct.error, Pillow issues 6882 and 7839): transformers' load_image would
    # fail on such a file, and so does the service, whichever path decodes it. Unturned, nothing is written.
    unit_as_text = struct.pack(">HHI", 0x0128, 2, 4) + b"abc\0"
    data = save(Image.fromarray(photo_pixels(16, 40, 24)), quality=90, exif=exif_with(orientation, unit_as_text))
    if orientation == 1:
        assert_same_as_pillow(data, direct)
        return
    with pytest.raises(InvalidInput, match="malformed EXIF"):
        decode.decode_image(data, None)
    with pytest.raises(InvalidInput, match="malformed EXIF"):
        decode.decode_rgb(data, None)


def test_an_exif_tag_of_the_wrong_type_is_an_invalid_image_not_a_server_error():
    # An XResolution stored as ASCII makes Pillow's EXIF writer raise TypeError: the file's fault.
    resolution_as_text = struct.pack(">HHI", 0x011A, 2, 4) + b"abc\0"
    data = save(Image.fromarray(photo_pixels(17, 40, 24)), quality=90, exif=exif_with(6, resolution_as_text))
    for decoder in (decode.decode_image, decode.decode_rgb):
        with pytest.raises(InvalidInput, match="malformed EXIF"):
            decoder(data, None)


def test_where_the_two_libjpeg_builds_disagree_pillow_decodes_everything(monkeypatch, direct):
    # An upgrade of simplejpeg or Pillow that changes one build's pixels turns the direct path off.
    real = simplejpeg.decode_jpeg
    monkeypatch.setattr(simplejpeg, "decode_jpeg", lambda *a, **kw: real(*a, **kw) ^ np.uint8(1))
    jpeg_direct.agrees_with_pillow.cache_clear()
    try:
        assert not jpeg_direct.agrees_with_pillow()
        direct.clear()  # the check's own decodes
        data = save(Image.fromarray(photo_pixels(18, 64, 40)), quality=90)
        assert_same_as_pillow(data, direct, taken=False)
        assert direct == []
    finally:
        jpeg_direct.agrees_with_pillow.cache_clear()
    monkeypatch.undo()
    assert jpeg_direct.agrees_with_pillow()
