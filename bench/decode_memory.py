"""A JPEG's decode to its uint8 array, the server's CPU half, two ways: through Pillow's image
(``pillow``: ``decode.open_image``, then the array) and as the server decodes now (``direct``:
``decode.decode_rgb``, libjpeg-turbo straight into the array for a plain JPEG, the same pixels). Each into
memory already mapped or into new memory: warm, right after the allocator handed its free pages back
(``memory.release_free_memory``, the server's idle trim), with Pillow's cache of freed blocks off (its
default) and on (``memory.keep_image_blocks``). One thread, the server's allocator settings.

    python3 bench/decode_memory.py [--sizes 448,1008] [--images 30] [--paths pillow,direct] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
from PIL import Image

from encoder_service import memory
from encoder_service.benchmarks.service import make_images
from encoder_service.preprocess import decode

PATHS = {
    "pillow": lambda data: np.asarray(decode.open_image(data, None), dtype=np.uint8),
    "direct": lambda data: decode.decode_rgb(data, None),
}


def _median_ms(images: list[bytes], trim: bool, path: str) -> float:
    times = []
    for data in images:
        if trim:
            memory.release_free_memory()
        started = time.perf_counter()
        PATHS[path](data)
        times.append(time.perf_counter() - started)
    return float(np.median(times) * 1000.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="448,1008")
    parser.add_argument("--images", type=int, default=30)
    parser.add_argument("--paths", default="pillow,direct")
    parser.add_argument("--out")
    args = parser.parse_args()
    memory.limit_arenas()
    memory.keep_large_blocks_in_heap()
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        images = make_images(args.images, 0, 1, size)
        for path in args.paths.split(","):
            for blocks in (0, memory.IMAGE_BLOCKS_KEPT):
                Image.core.set_blocks_max(blocks)
                Image.core.clear_cache()
                _median_ms(images, False, path)  # first touches
                row = {"size": size, "path": path, "pillow_blocks_max": blocks,
                       "warm_ms": _median_ms(images, False, path), "after_trim_ms": _median_ms(images, True, path)}
                rows.append(row)
                print(f"{size}x{size} JPEG, {path}, Pillow blocks kept {blocks}: warm {row['warm_ms']:.2f} ms, "
                      f"right after a trim {row['after_trim_ms']:.2f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"host": platform.node(), "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
