"""Is nvJPEG worth offering as a decode option? Times and differences against Pillow's decode.

For photo-like JPEGs (those of the service benchmark) this measures, on one machine:
- Pillow's decode to uint8 RGB (what the service's decode threads do), one image at a time;
- ``torchvision.io.decode_jpeg(device="cuda")``, one image and batched;
- how far nvJPEG's pixels are from Pillow's (max / mean absolute difference, in levels);
- what that does to the embeddings: the same model encodes both decodes (the service's own device
  preprocessing and forward), relative error of nvJPEG's embedding against Pillow's, beside the
  error of the model's bf16 forward itself (bf16 against float32 on Pillow's pixels) for scale.

Needs a GPU and torchvision (not a dependency of the service). Random-weight presets: the error
is a property of the pixels and the tower's arithmetic, not of trained weights, but trained
weights may amplify differently. Prints one JSON object (and writes it with --out).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from encoder_service.benchmarks.service_clients import photo_jpeg
from encoder_service.models import load_vision_model
from encoder_service.preprocess.staged import DecodedImage


def _ms(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-vl-7b")
    p.add_argument("--images", type=int, default=16)
    p.add_argument("--size", type=int, default=1008)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from torchvision.io import decode_jpeg  # the GPU machine has torchvision; the service does not need it

    jpegs = [photo_jpeg(5000 + i, args.size) for i in range(args.images)]
    datas = [torch.frombuffer(bytearray(j), dtype=torch.uint8) for j in jpegs]

    def pil(j: bytes) -> np.ndarray:
        return np.asarray(Image.open(io.BytesIO(j)).convert("RGB"))

    result: dict = {"device": torch.cuda.get_device_name(), "images": args.images, "size": args.size,
                    "jpeg_bytes_mean": float(np.mean([len(j) for j in jpegs]))}
    result["pillow_ms_per_image"] = _ms(lambda: [pil(j) for j in jpegs], max(2, args.iters // 5)) / args.images
    decode_jpeg(datas[:2], device="cuda")  # initialise nvJPEG
    result["nvjpeg_one_ms"] = _ms(lambda: decode_jpeg(datas[0], device="cuda"), args.iters)
    result["nvjpeg_batched_ms_per_image"] = _ms(lambda: decode_jpeg(datas, device="cuda"), args.iters) / args.images

    ref = [pil(j) for j in jpegs]
    gpu = [t.permute(1, 2, 0).cpu().numpy() for t in decode_jpeg(datas, device="cuda")]
    diffs = [np.abs(a.astype(np.int16) - b.astype(np.int16)) for a, b in zip(ref, gpu)]
    result["pixel_max_abs_diff"] = int(max(d.max() for d in diffs))
    result["pixel_mean_abs_diff"] = float(np.mean([d.mean() for d in diffs]))
    result["pixel_share_differing"] = float(np.mean([(d > 0).mean() for d in diffs]))

    errs, scale = [], []
    for dtype in (torch.bfloat16, torch.float32):
        model = load_vision_model(args.model, device="cuda", dtype=dtype)
        outs = {}
        for name, pixels in (("pillow", ref), ("nvjpeg", gpu)):
            staged = []
            for j, px in zip(jpegs, pixels):
                like = model.decode(j)  # grid and resize target from the service's own decode
                staged.append(DecodedImage(np.ascontiguousarray(px), like.resize_to, like.pad_to, like.grid))
            outs[name] = [e.float().cpu() for e in model.encode_inputs_async(staged).wait()]
        if dtype == torch.bfloat16:
            errs = [_rel(a, b) for a, b in zip(outs["nvjpeg"], outs["pillow"])]
            bf16_pillow = outs["pillow"]
        else:
            scale = [_rel(a, b) for a, b in zip(bf16_pillow, outs["pillow"])]
            errs32 = [_rel(a, b) for a, b in zip(outs["nvjpeg"], outs["pillow"])]
        del model
        torch.cuda.empty_cache()
    result["embedding_rel_err_nvjpeg_vs_pillow_bf16"] = {"max": max(errs), "mean": float(np.mean(errs))}
    result["embedding_rel_err_nvjpeg_vs_pillow_fp32"] = {"max": max(errs32), "mean": float(np.mean(errs32))}
    result["embedding_rel_err_bf16_vs_fp32_same_pixels"] = {"max": max(scale), "mean": float(np.mean(scale))}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
