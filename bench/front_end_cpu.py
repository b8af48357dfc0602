"""The front end's CPU time per image, stage by stage, on one thread (what item 5 of the serving-path
work asks for: which stage would not scale to 2 x 73 images/s on one host).

    python bench/front_end_cpu.py [--images 30] [--out front_end_cpu.json]

Photo-like 1008x1008 JPEGs (the service benchmark's), Qwen2.5-VL-7B's preprocessing and output size
(1296 tokens x 3584, bf16: 9.3 MB). Stages, each timed with the thread's own CPU clock:
- the cache key (SHA-256 of the JPEG, as the server computes it);
- Pillow's decode into the uint8 array the device preprocesses (``--decode pillow``, torch mode);
- nvjpeg's CPU half: the JPEG header and the scan's marker check (``--decode nvjpeg``);
- the response's chunk messages on the gRPC stream (header + embedding bytes, 4 MiB chunks); gRPC's
  own copy of each message into its buffers comes after this and is not counted here.
The service benchmark (encoder-service bench --service) measures the whole server process's CPU per
image under load; this script says where it goes.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=30)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    import torch
    from encoder_client.protocol.hashing import hash_encoded

    from encoder_service.api.streaming import serialized_chunks
    from encoder_service.benchmarks.service_clients import photo_jpeg
    from encoder_service.engine import ImageResult
    from encoder_service.models.qwen2_5_vl import QWEN2_VL_PREPROCESSOR
    from encoder_service.models.qwen2_5_vl.preprocess import Qwen2VLPreprocessConfig, decode_qwen2_vl, geometry
    from encoder_service.preprocess.nvjpeg import NvjpegDecoder

    cfg = Qwen2VLPreprocessConfig.from_dict(QWEN2_VL_PREPROCESSOR)
    jpegs = [photo_jpeg(seed) for seed in range(args.images)]
    nvjpeg_cpu_half = NvjpegDecoder(None, geometry, cfg)  # photo JPEGs never fall back to Pillow
    result = ImageResult(0, "0" * 64, (1, 72, 72), torch.zeros(1296, 3584, dtype=torch.bfloat16), cache_hit=False)
    stages = {
        "cache key (sha256 of the JPEG)": lambda data: hash_encoded("namespace", data),
        "decode with Pillow to uint8 (--decode pillow)": lambda data: decode_qwen2_vl(data, cfg, "torch"),
        "nvjpeg's CPU half: header + scan check (--decode nvjpeg)": nvjpeg_cpu_half,
        "response chunk messages, 9.3 MB (gRPC stream)": lambda _data: list(serialized_chunks(
            result, request_id="r", out_dtype=None, model_dtype="bfloat16", max_chunk_bytes=4 << 20)),
    }
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(), "cpu": platform.processor(),
              "jpeg_bytes_mean": sum(map(len, jpegs)) / len(jpegs), "cpu_ms_per_image": {}}
    for name, stage in stages.items():
        stage(jpegs[0])  # warm: first calls import and allocate
        started = time.thread_time()
        for data in jpegs:
            stage(data)
        report["cpu_ms_per_image"][name] = (time.thread_time() - started) * 1000 / len(jpegs)
        print(f"{report['cpu_ms_per_image'][name]:8.2f} ms  {name}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
