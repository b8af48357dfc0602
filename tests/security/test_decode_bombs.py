"""Decode bombs: images whose decoding costs far more CPU time or memory than their bytes or pixel
counts suggest, and the limits that refuse them before the cost is paid (preprocess/decode.py).

- A progressive JPEG may hold any number of scans, and libjpeg makes a pass over every block of the
  image for each, even an empty one of a few bytes: an 8192x8192 one of 1.1 MB took 32 s of a core.
  Scans are counted from the bytes before decoding; more than any encoder writes is refused.
- WebP decodes through libwebp's animation decoder: two RGBA canvases plus two copies of the frame,
  about 17 bytes a pixel (a 38-byte lossless file of 8192x8192 peaks at 1.1 GB). Each image's decode
  memory is estimated from its header and refused over a budget before anything is allocated.
- The pixel limit defaults to a multiple of the model's own max_pixels, not 64 Mi pixels.
- Images that are expensive by their header decode in a pool of their own, so ordinary images never
  queue behind them; every decode has a time budget.
"""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from encoder_client.protocol import encoder_pb2 as pb
from encoder_client.protocol import encoder_pb2_grpc
from PIL import Image
from repo_paths import REPO_ROOT

from encoder_service.benchmarks.reliability.fuzz_inputs import jpeg_scan_bomb, jpeg_segments, png_chunk_bomb
from encoder_service.errors import ResourceExhausted
from encoder_service.preprocess.decode import decode_image

pytestmark = pytest.mark.timeout(300)

TINY_MAX_PIXELS = 448 * 448  # every tiny preset's max_pixels (Kimi: 1024 patches of 14x14)
QWEN25_7B_MAX_PIXELS = 28 * 28 * 1280


def save(image: Image.Image, fmt: str = "JPEG", **kw) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **kw)
    return out.getvalue()


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // width, y * 255 // height, (x + y) * 127 // (width + height)], -1)
    return Image.fromarray((base + rng.integers(-30, 30, base.shape)).clip(0, 255).astype(np.uint8))


# --- counting scans -------------------------------------------------------------------------------------


def test_scans_are_counted_from_the_bytes():
    from encoder_service.preprocess.decode import MAX_JPEG_SCANS, jpeg_scans

    image = photo(64, 48)
    assert jpeg_scans(save(image)) == 1
    assert jpeg_scans(save(image, progressive=True)) == 10  # libjpeg's default script for colour
    assert jpeg_scans(save(image.convert("L"), progressive=True)) == 6  # and for grayscale
    assert jpeg_scans(jpeg_scan_bomb(64, 50)) == 56
    # Counting stops past the limit: a bomb's hundred thousand scans cost no more than 101.
    assert jpeg_scans(jpeg_scan_bomb(64, 5000)) == MAX_JPEG_SCANS + 1
    assert jpeg_scans(save(image, "PNG")) == 0


def test_a_marker_without_a_length_cannot_hide_scans_behind_a_fake_header():
    """RST0 right after SOI has no length for libjpeg, which goes on to the COM segments; a walk
    that read a length after it landed inside a COM segment, on a fake one-scan sequential
    header, and counted 1 for a file of thousands of scans (seen against a real server: 5-10 s of
    decoding per such file, beside ordinary images)."""
    from encoder_service.preprocess.decode import MAX_JPEG_SCANS, jpeg_scans

    def segment(marker: int, payload: bytes) -> bytes:
        return bytes((0xFF, marker)) + (len(payload) + 2).to_bytes(2, "big") + payload

    bomb = jpeg_scan_bomb(64, 500)
    com1 = bytearray(65533)
    # After SOI (2) and RST0 (2), a walk that reads a length at offset 4 (COM's FF FE) jumps to
    # offset 4 + 2 + 0xFFFF: there, inside this COM, it finds FF E1 with a length of 0x01FF...
    com1[65538 - 8:65538 - 8 + 3] = b"\xff\xe1\x01"
    prefix = b"\xff\xd8\xff\xd0" + segment(0xFE, bytes(com1))
    fake = (segment(0xC0, bytes([8, 0, 64, 0, 64, 1, 1, 0x11, 0]))  # ...and lands on a one-component SOF0
            + segment(0xDA, bytes([1, 1, 0, 0, 63, 0])))  # whose first scan holds every component
    com2 = bytearray(4096)
    at = 65538 + 2 + 0x01FF - (len(prefix) + 4)
    com2[at:at + len(fake)] = fake
    disguised = prefix + segment(0xFE, bytes(com2)) + bomb[2:]
    assert jpeg_scans(bomb) == MAX_JPEG_SCANS + 1
    assert jpeg_scans(disguised) == MAX_JPEG_SCANS + 1
    with pytest.raises(ResourceExhausted, match="scans"):
        decode_image(disguised, None)


def test_start_of_scan_bytes_inside_metadata_are_not_scans():
    """0xFFDA inside an ICC profile, an EXIF thumbnail or a comment is skipped with its segment, as
    libjpeg skips it: such a file is neither refused nor sent the slow way."""
    from encoder_service.preprocess.decode import jpeg_scans

    thumbnail = save(photo(16, 16), progressive=True)
    data = save(photo(64, 48), progressive=True, icc_profile=b"\xff\xda" * 300 + thumbnail * 20)
    assert data.count(b"\xff\xda") > 300
    assert jpeg_scans(data) == 10
    assert decode_image(data, 10**6).size == (64, 48)


def test_counting_survives_truncated_and_damaged_bytes():
    from encoder_service.preprocess.decode import jpeg_scans

    bomb = jpeg_scan_bomb(32, 300)
    for cut in range(0, len(bomb), 41):
        assert 0 <= jpeg_scans(bomb[:cut]) <= 301
    assert jpeg_scans(b"\xff\xd8" + b"\xff" * 1000) == 0
    assert jpeg_scans(b"\xff\xd8" + b"\xff\xda\x00" * 1000) <= 101  # lengths that point nowhere


def test_counting_walks_scan_data_fill_and_segments_as_libjpeg_reads_them():
    """Past the cheap bound (FF DA inside a comment), the walk skips stuffed bytes, fill bytes and
    segments, windows at a time: a few MB of them are no scans and cost no memory to speak of."""
    from encoder_service.preprocess.decode import jpeg_scans

    data = save(Image.new("L", (64, 64)), progressive=True)
    sos = data.index(b"\xff\xda")
    comment = b"\xff\xfe" + (2 + 40).to_bytes(2, "big") + b"\xff\xda" * 20
    head = data[:2] + comment + data[2:sos]
    assert jpeg_scans(head + data[sos:sos + 10] + b"\xff\x00" * (2 << 20) + b"\xff\xd9") == 1
    assert jpeg_scans(head + b"\xff" * (4 << 20) + b"\xff\xd9") == 0
    assert jpeg_scans(head + b"\xff\xfe\x00\x02" * 1000 + data[sos:]) == 6
    # Past 4096 markers (a real file has about 40) the cheap bound stands in: 20 + 6.
    assert jpeg_scans(head + b"\xff\xfe\x00\x02" * 5000 + data[sos:]) == 26
    assert jpeg_scans(head + (data[sos:sos + 10] + b"\x01\xff\xd0" * 1000) * 101 + b"\xff\xd9") == 101


def test_the_bomb_helper_builds_what_it_says():
    bomb = jpeg_scan_bomb(64, 40)
    assert sum(1 for marker, _, _ in jpeg_segments(bomb) if marker == 0xDA) == 46
    assert Image.open(io.BytesIO(bomb)).size == (64, 64)


# --- refusing bombs -------------------------------------------------------------------------------------


def test_a_jpeg_with_more_scans_than_the_limit_is_refused_naming_the_limit():
    bomb = jpeg_scan_bomb(256, 500)  # 5 KB; decoding it would make 506 passes over the image
    with pytest.raises(ResourceExhausted, match=r"more than 100 scans.*limit"):
        decode_image(bomb, 10**7)


def test_ordinary_progressive_jpegs_and_odd_ones_under_the_limit_still_decode():
    image = photo(120, 90)
    assert decode_image(save(image, progressive=True), 10**6).size == (120, 90)
    assert decode_image(save(image.convert("L"), progressive=True), 10**6).size == (120, 90)
    assert decode_image(jpeg_scan_bomb(64, 80), 10**6).size == (64, 64)  # 86 scans: allowed


def test_a_decode_over_its_time_budget_is_stopped():
    from encoder_service.preprocess.decode import decode_budget

    # ~5 MB of entropy-coded data: libjpeg reads it 64 KB at a time, and the budget is checked at each.
    slow = save(Image.fromarray(np.random.default_rng(1).integers(0, 256, (2048, 2048, 3), dtype=np.uint8)),
                quality=95, progressive=True)
    with decode_budget(0.02), pytest.raises(ResourceExhausted, match=r"--max-decode-seconds 0.02"):
        decode_image(slow, None)
    # Pillow parses each PNG chunk in Python, holding the GIL: 100,000 tiny ones take ~0.3 s.
    with decode_budget(0.02), pytest.raises(ResourceExhausted, match=r"decod.*--max-decode-seconds"):
        decode_image(png_chunk_bomb(100_000), None)
    with decode_budget(120):
        assert decode_image(slow, None).size == (2048, 2048)
    assert decode_image(slow, None).size == (2048, 2048)  # no budget outside the context


# --- memory ---------------------------------------------------------------------------------------------

# Decodes a one-colour lossless WebP of side x side pixels under a pixel limit in a fresh process and
# prints the outcome and the peak of its resident memory over what it held before the decode.
_MEMORY_CHILD = r"""
import io, os, sys
from PIL import Image
from encoder_service.errors import ResourceExhausted
from encoder_service.preprocess.decode import decode_image

side, limit = int(sys.argv[1]), int(sys.argv[2])
out = io.BytesIO()
Image.new("RGB", (side, side), (10, 20, 30)).save(out, "WEBP", lossless=True, method=0)
data = out.getvalue()

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from what is resident now
before = status("VmRSS")
try:
    decode_image(data, limit)
    print("decoded")
except ResourceExhausted as e:
    print("refused:", e)
print(status("VmHWM") - before)
"""


def peak_decode_memory(side: int, limit: int) -> tuple[str, int]:
    done = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, str(side), str(limit)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    outcome, peak = done.stdout.strip().splitlines()
    return outcome, int(peak)


def test_a_webp_whose_decode_needs_more_than_the_memory_budget_is_refused_before_allocating():
    """4096x4096 is within a limit of 4096x4096 pixels, but libwebp and Pillow would hold ~17 bytes a
    pixel (270 MB) where the budget is 12 bytes a pixel of the limit."""
    outcome, peak = peak_decode_memory(4096, 4096 * 4096)
    assert outcome.startswith("refused:"), outcome
    assert "memory" in outcome and "WEBP" in outcome, outcome
    assert peak < 32 << 20, f"{peak / 2**20:.0f} MB allocated before refusing"


def test_a_webp_within_the_budget_decodes_within_it():
    limit = 2 * 2048 * 2048
    outcome, peak = peak_decode_memory(2048, limit)
    assert outcome == "decoded"
    assert peak <= 12 * limit, f"{peak / 2**20:.0f} MB at the peak, over the budget of {12 * limit / 2**20:.0f} MB"


# --- the pixel limit derived from the model -------------------------------------------------------------


def test_the_default_pixel_limit_is_derived_from_the_models_max_pixels():
    from encoder_service.config import ServiceConfig
    from encoder_service.preprocess.decode import derived_pixel_limit

    assert ServiceConfig().max_image_pixels == -1  # -1: derived once the model is known
    assert derived_pixel_limit(QWEN25_7B_MAX_PIXELS) == 16 * QWEN25_7B_MAX_PIXELS
    assert derived_pixel_limit(QWEN25_7B_MAX_PIXELS) >= 4000 * 3000  # a 12 MP phone photo passes
    assert derived_pixel_limit(TINY_MAX_PIXELS) == 16 * TINY_MAX_PIXELS
    assert derived_pixel_limit(16_777_216) == 64 << 20  # Qwen3-VL's: capped at the old default
    assert derived_pixel_limit(None) == 64 << 20


def test_every_family_reports_its_max_pixels():
    from encoder_service.models.kimi_k25.preprocess import KimiK25PreprocessConfig
    from encoder_service.models.qwen2_5_vl.preprocess import Qwen2VLPreprocessConfig
    from encoder_service.preprocess.decode import model_max_pixels

    assert model_max_pixels(Qwen2VLPreprocessConfig()) == QWEN25_7B_MAX_PIXELS
    assert model_max_pixels(KimiK25PreprocessConfig()) == 16384 * 14 * 14
    assert model_max_pixels(None) is None


# --- expensive images decode apart from ordinary ones (an engine in this process) -----------------------


def test_an_ordinary_image_never_waits_behind_images_that_are_expensive_by_their_header(fake_model):
    """Two progressive JPEGs with 86 scans (allowed, but expensive) hold their decodes until released:
    with two decode threads, an ordinary image sent after them must still be encoded meanwhile."""
    from engine_helpers import encode_all, encoded, running_engine
    from fake_model import _decode_fake

    from encoder_service.engine.types import ImageInput
    from encoder_service.models.base import Decoder
    from encoder_service.preprocess.decode import open_image
    from encoder_service.preprocess.staged import RawPatches

    release, entered = threading.Event(), threading.Semaphore(0)

    def decode(data, config, mode, max_image_pixels=None):
        if data.startswith(b"\xff\xd8"):
            open_image(data, max_image_pixels)  # where the engine learns that it is expensive
            entered.release()
            assert release.wait(60)
            return RawPatches(fake_model.patches((1, 4, 4), len(data)).tobytes(), "float32", (1, 4, 4))
        return _decode_fake(data, config, mode, max_image_pixels)

    fake_model.decoder = lambda: Decoder(decode, None, "pil")
    bombs = [ImageInput(index=0, kind="encoded", data=jpeg_scan_bomb(64 + 16 * i, 80)) for i in range(2)]

    async def main():
        async with running_engine(fake_model, preprocess_threads=2) as engine:
            slow = [asyncio.create_task(encode_all(engine, [bomb])) for bomb in bombs]
            try:
                assert await asyncio.to_thread(entered.acquire, True, 30)  # one is decoding
                ordinary = await asyncio.wait_for(encode_all(engine, [encoded(0, seed=5)]), 30)
                assert len(ordinary) == 1 and not any(task.done() for task in slow)
            finally:
                release.set()
            assert [len(r) for r in await asyncio.gather(*slow)] == [1, 1]

    asyncio.run(main())


# --- against a real server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(start_encoder_server):
    """Default limits: the pixel limit derived from the tiny preset's max_pixels."""
    server = start_encoder_server()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield encoder_pb2_grpc.VisionEncoderStub(channel)


def encode(stub, data: bytes, timeout: float = 120) -> list[pb.EmbeddingChunk]:
    return list(stub.Encode(pb.EncodeRequest(images=[pb.Image(encoded=data)]), timeout=timeout))


def test_the_server_reports_and_logs_the_derived_pixel_limit(server, stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert info.max_image_pixels == 16 * TINY_MAX_PIXELS
    assert f"max-image-pixels {16 * TINY_MAX_PIXELS} (16 x the model's max_pixels {TINY_MAX_PIXELS})" \
        in server.log_text()
    # Over it: refused from the header, naming the limit.
    with pytest.raises(grpc.RpcError) as info:
        encode(stub, save(Image.new("RGB", (1800, 1800)), "PNG"))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"over the limit of {16 * TINY_MAX_PIXELS} pixels" in info.value.details()


def test_a_scan_bomb_is_refused_and_an_ordinary_image_is_not_held_up_by_bombs(stub):
    """Two 1024x1024 JPEGs of 12,000 empty scans each (165 KB) would hold both decode threads for as
    long as each takes to decode (~10 s here). Compared with that time, measured on a tenth of the
    bomb in this process, with a wide margin: no absolute timing."""
    bombs = [jpeg_scan_bomb(1024, 12_000 + i) for i in range(2)]  # not the same bytes: no in-flight join
    tenth = jpeg_scan_bomb(1024, 1_200)
    tenth_s = []
    for _ in range(3):  # the median: one timing on a busy 2-core host can be far off either way
        started = time.perf_counter()
        Image.open(io.BytesIO(tenth)).load()
        tenth_s.append(time.perf_counter() - started)
    bomb_decode_s = 10 * sorted(tenth_s)[1]

    ordinary = save(photo(448, 448, seed=3), "PNG")
    with ThreadPoolExecutor(2) as pool:
        bombs = [pool.submit(encode, stub, bomb) for bomb in bombs]
        time.sleep(0.5)  # the bombs reach the decode threads first
        started = time.perf_counter()
        chunks = encode(stub, ordinary)
        ordinary_s = time.perf_counter() - started
        outcomes = [future.exception() for future in bombs]
    assert chunks[-1].last and chunks[-1].num_tokens == 256
    assert ordinary_s < bomb_decode_s / 3, f"the ordinary image took {ordinary_s:.1f} s, a bomb decodes in " \
                                           f"~{bomb_decode_s:.1f} s"
    for error in outcomes:
        assert isinstance(error, grpc.RpcError), "a bomb was decoded"
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        assert "more than 100 scans" in error.details() and "limit" in error.details(), error.details()


def test_progressive_jpegs_the_server_decodes(stub):
    """A standard progressive JPEG, and one of 86 scans (expensive: decoded in the pool of its own)."""
    assert encode(stub, save(photo(448, 448, seed=4), progressive=True))[-1].num_tokens == 256
    assert encode(stub, jpeg_scan_bomb(448, 80))[-1].num_tokens == 256


def _behind_fill_bytes(data: bytes, total: int) -> bytes:
    """``data`` (a JPEG) with fill bytes before its first marker up to ``total`` bytes: a valid file whose
    header Pillow reads a byte at a time in Python."""
    return data[:2] + b"\xff" * (total - len(data)) + data[2:]


@pytest.mark.parametrize("case", ["96 scans over 3.1 Mpx", "a header of 500 KB of fill bytes"])
def test_a_lone_request_never_decodes_an_expensive_jpeg_on_the_event_loop(stub, case):
    """A lone request's small JPEG decodes on the event loop (engine/preparation.py), which then serves
    no other call until it is done. A hostile caller's lone JPEG past those bounds (allowed but expensive:
    ~0.15-0.25 s of decode here, within the inline bytes bound) must still go to the threads: calls made
    during its decode are answered meanwhile. Compared with its own decode time in this process, no
    absolute timing. On the loop, a call made during the decode waits for all of it, every time; in a
    thread, a busy 2-core host (a CI run: one call in ~40 waited 138 ms of a 166 ms decode, the rest
    1-35 ms) can hold a call up once in a while, so three such images (distinct bytes: no cache hit)
    are sent and the test fails only if every one held a call for half its decode."""
    from encoder_service.engine.preparation import ALONE_INLINE_BYTES
    from encoder_service.preprocess.decode import jpeg_scans

    if case.startswith("96 scans"):
        hostiles = [jpeg_scan_bomb(1760 - 16 * i, 90) for i in range(3)]
        assert {jpeg_scans(hostile) for hostile in hostiles} == {96}
    else:
        hostiles = [_behind_fill_bytes(save(photo(64, 64, seed=11 + i), quality=90), 500_000) for i in range(3)]
    assert len(set(hostiles)) == 3 and max(map(len, hostiles)) <= ALONE_INLINE_BYTES
    decode_s = []
    for hostile in hostiles:
        started = time.perf_counter()
        decode_image(hostile, None).load()
        decode_s.append(time.perf_counter() - started)

    waits: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            waits.append(time.perf_counter() - started)

    thread = threading.Thread(target=probe)
    thread.start()
    held = []
    try:
        for hostile, seconds in zip(hostiles, decode_s):
            time.sleep(0.2)
            before = len(waits)
            assert encode(stub, hostile)[-1].num_tokens > 0
            during = waits[before:]
            held.append((len(during), max(during, default=0.0), seconds))
    finally:
        stop.set()
        thread.join()
    # Held: fewer than 3 calls answered during the image's call, or one of them waiting half its decode.
    assert not all(answered < 3 or wait >= seconds / 2 for answered, wait, seconds in held), "; ".join(
        f"{answered} calls answered, one waiting {wait * 1000:.0f} ms, during a {seconds * 1000:.0f} ms decode"
        for answered, wait, seconds in held)


# --- what the counting and the routing rest on ----------------------------------------------------------


def test_a_sequential_jpeg_with_one_scan_of_every_component_is_counted_from_its_header():
    """libjpeg refuses any scan after such a first one, so its scan data need not be searched; copies
    of its scan appended make it a broken file, refused at once, not a bomb."""
    from encoder_service.benchmarks.reliability.fuzz_inputs import jpeg_segments
    from encoder_service.errors import InvalidInput
    from encoder_service.preprocess.decode import jpeg_scans

    data = save(Image.new("RGB", (512, 512), (1, 2, 3)))
    segments = jpeg_segments(data)
    scan = [data[start:end] for marker, start, end in segments if marker == 0xDA][-1]
    appended = data[:segments[-1][1]] + scan * 3000 + data[segments[-1][1]:]
    assert jpeg_scans(appended) == 1
    with pytest.raises(InvalidInput, match="broken data stream"):
        decode_image(appended, 10**6)


def test_expensive_images_are_handed_back_before_any_pixel_is_decoded_where_the_budget_says_so():
    from encoder_service.preprocess.decode import ExpensiveImage, decode_budget, open_image

    odd = jpeg_scan_bomb(64, 80)  # 86 scans: allowed, expensive
    large = save(photo(300, 200), "PNG")  # 60,000 pixels
    with decode_budget(5, expensive_pixels=50_000):
        for data in (odd, large):
            with pytest.raises(ExpensiveImage):
                open_image(data, 10**6)
        assert open_image(save(photo(200, 200), "PNG"), 10**6).size == (200, 200)
        with pytest.raises(ResourceExhausted, match="more than 100 scans"):  # refused, not handed back
            open_image(jpeg_scan_bomb(64, 200), 10**6)
    for data in (odd, large):  # where expensive images are decoded
        with decode_budget(5):
            open_image(data, 10**6).load()


@pytest.mark.parametrize("mode", ["in-process", "workers"])
def test_hostile_jpegs_on_the_direct_decode_path_get_pillows_answers_and_the_server_serves_on(
        start_encoder_server, mode):
    """With --preprocess torch (a GPU's default) a plain JPEG decodes through libjpeg-turbo directly
    (preprocess/jpeg_direct.py), with --devices in the workers, into their warm decode buffers. Damaged
    files get the answer Pillow's decode gives them (worked out here), and the server serves on."""
    import struct

    flags = ("--preprocess", "torch") + (("--devices", "cpu,cpu") if mode == "workers" else ())
    server = start_encoder_server(*flags)
    good = save(photo(224, 224, seed=7), quality=90)
    eoi = jpeg_segments(good)[-1][1]
    ifd = (struct.pack(">H", 2) + struct.pack(">HHIHH", 0x0112, 3, 1, 6, 0)
           + struct.pack(">HHI", 0x0128, 2, 4) + b"abc\0" + b"\0\0\0\0")  # turned, with an unwritable EXIF
    hostile = {
        "stray bytes before EOI": good[:eoi] + b"\x12\x34\x56" + good[eoi:],
        "truncated": good[: len(good) // 2],
        "EXIF that cannot be written back": save(photo(224, 224, seed=8), quality=90,
                                                 exif=b"Exif\0\0MM\0*\0\0\0\x08" + ifd),
        "86 scans": jpeg_scan_bomb(224, 80),
    }
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = encoder_pb2_grpc.VisionEncoderStub(channel)
            for name, data in hostile.items():
                try:
                    want = np.asarray(decode_image(data, None)).shape
                except Exception:
                    want = None
                if want is None:
                    with pytest.raises(grpc.RpcError) as refused:
                        encode(stub, data)
                    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, refused.value.details())
                else:
                    assert encode(stub, data)[-1].num_tokens == want[0] * want[1] // 28 // 28, name
            for seed in (9, 10):  # the second of a size decodes into a warm buffer
                assert encode(stub, save(photo(224, 224, seed=seed), quality=90))[-1].num_tokens == 64
    finally:
        server.stop()
    assert "decodes JPEGs otherwise than Pillow" not in server.log_text()
