"""Idle RSS returns near its start after a burst: freed memory goes back to the kernel."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np

from encoder_service import memory


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def test_release_free_memory_hands_freed_heap_back_to_the_kernel():
    assert memory.release_free_memory()  # glibc on Linux: CI's and the images'
    before = rss_mib()
    # Many medium blocks (below the mmap threshold, so they come from the heap), every other one
    # kept alive: what is freed stays fragmented in the arena until trimmed.
    blocks = [np.ones(100_000, dtype=np.uint8) for _ in range(4000)]
    del blocks[::2]
    del blocks[: len(blocks) // 2]
    held = rss_mib()
    assert memory.release_free_memory()
    after = rss_mib()
    print(f"RSS {before:.0f} MiB at start, {held:.0f} MiB holding, {after:.0f} MiB after trim")
    assert after < held - 100


_FAULTS_SCRIPT = """
import resource, sys
from encoder_service import memory
if sys.argv[1] == "keep":
    assert memory.keep_large_blocks_in_heap()
def rounds(n):  # a response's buffers: several MiB-sized blocks in flight, then all freed
    for _ in range(n):
        blocks = [bytearray(4 << 20) for _ in range(8)]
        for b in blocks:
            b[::4096] = b"x" * len(b[::4096])
        del blocks
rounds(3)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds(20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_kept_heap_serves_megabyte_buffers_again_without_mapping_new_pages():
    # In a child: mallopt is process-wide. Default glibc maps such blocks afresh (or trims them
    # away) each round, so the kernel faults their pages in again every time.
    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, mode], capture_output=True, text=True,
                             check=True)
        return int(out.stdout)

    default, kept = faults("default"), faults("keep")
    print(f"page faults over 20 rounds: {default} by default, {kept} with the heap kept")
    assert default > 2000  # 160 blocks of 1024 pages: the pattern faults without the setting
    assert kept < default / 20



def test_decoded_images_reuse_pillows_freed_blocks_zeroed_and_a_trim_keeps_a_few():
    # In a process of its own: Pillow's block cache is process-wide.
    code = """
import io, json
import numpy as np
from PIL import Image
from encoder_service import memory
assert memory.keep_image_blocks()
jpeg = io.BytesIO()
Image.fromarray(np.full((300, 400, 3), 7, np.uint8)).save(jpeg, "JPEG")
images = [Image.open(io.BytesIO(jpeg.getvalue())) for _ in range(12)]
for image in images:
    image.load()
del images, image  # twelve blocks freed at once: the cache keeps its bound
held = Image.core.get_stats()["blocks_cached"]
for _ in range(5):
    Image.open(io.BytesIO(jpeg.getvalue())).load()
reused = Image.core.get_stats()["reused_blocks"]
# What a decoder writes into (ImageFile.load_prepare): a cached block comes back zeroed, never
# holding the last image's pixels.
stale = int(np.asarray(Image.Image()._new(Image.core.new("RGB", (400, 300)))).max())
memory.release_free_memory()
print(json.dumps({"held": held, "reused": reused, "stale": stale,
                  "after_trim": Image.core.get_stats()["blocks_cached"]}))
"""
    env = {k: v for k, v in os.environ.items() if k != "PILLOW_BLOCKS_MAX"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["held"] == memory.IMAGE_BLOCKS_KEPT
    assert result["reused"] >= 5  # every later decode took a cached block
    assert result["stale"] == 0
    assert result["after_trim"] == memory.IMAGE_BLOCKS_KEPT_IDLE


def test_an_operators_pillow_blocks_max_is_left_alone():
    code = """
import io, json
import numpy as np
from PIL import Image
from encoder_service import memory
ours = memory.keep_image_blocks()
jpeg = io.BytesIO()
Image.fromarray(np.full((300, 400, 3), 7, np.uint8)).save(jpeg, "JPEG")
images = [Image.open(io.BytesIO(jpeg.getvalue())) for _ in range(12)]
for image in images:
    image.load()
del images, image
memory.release_free_memory()
cached = Image.core.get_stats()["blocks_cached"]
print(json.dumps({"ours": ours, "max": Image.core.get_blocks_max(), "after_trim": cached}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PILLOW_BLOCKS_MAX": "5"})
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"ours": False, "max": 5, "after_trim": 5}
