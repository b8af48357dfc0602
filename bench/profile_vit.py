"""Where the time of one Qwen2.5-VL-7B forward goes (GPU kernels, torch.profiler), per backend.

    python bench/profile_vit.py --backends flashinfer-cudnn,varlen
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from encoder_service.benchmarks.forward import time_it
from encoder_service.models.presets import PRESETS, random_vision_state
from encoder_service.models.qwen2_5_vl.loading import build
from encoder_service.models.qwen2_5_vl.model import Qwen2_5_VisionConfig


def median_ms(fn, iters=5) -> float:
    return time_it(fn, iters, warmup=1) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="flashinfer-cudnn")
    # A named backend runs every attention layer unless --ops names the window kernel: the default
    # profiles the window layers as --attn-backend auto serves them (the fused Triton kernel).
    ap.add_argument("--ops", default="window_attention=triton", help="the server's --ops (encoder_service/ops)")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--trace", type=Path, default=None, help="write a Chrome trace of one case-(a) forward here")
    args = ap.parse_args()
    preset = PRESETS["qwen2.5-vl-7b"]
    cfg = Qwen2_5_VisionConfig.from_dict(preset.vision_config)
    state = {k: v.to("cuda", torch.bfloat16) for k, v in random_vision_state(preset).items()}
    rng = np.random.default_rng(0)
    grids_a = [[1, 72, 72]] * 8
    grids_c = [[1, 32, 32]] * 64
    px_a = torch.from_numpy(rng.standard_normal((8 * 5184, 1176), dtype=np.float32)).to("cuda", torch.bfloat16)
    px_c = torch.from_numpy(rng.standard_normal((64 * 1024, 1176), dtype=np.float32)).to("cuda", torch.bfloat16)
    for backend in args.backends.split(","):
        model = build(cfg, dict(state), model_id="7b", preprocess_config=None, device=torch.device("cuda"),
                      dtype=torch.bfloat16, attn_backend=backend, ops=args.ops, compile=True)
        for px, g in ((px_a, grids_a), (px_c, grids_c), (px_a, grids_a)):  # second shape: automatic recompile
            model.encode_packed(px, g)
        ms_a = median_ms(lambda m=model: m.encode_packed(px_a, grids_a))
        ms_c = median_ms(lambda m=model: m.encode_packed(px_c, grids_c))
        torch.cuda.synchronize()
        host = []
        for _ in range(3):
            t0 = time.perf_counter()
            model.encode_packed(px_a, grids_a)
            host.append(time.perf_counter() - t0)  # time to enqueue the forward (no sync inside)
            torch.cuda.synchronize()
        print(f"host time to enqueue case a: {1e3 * min(host):.1f} ms")
        print(f"\n=== {backend}: case a {ms_a:.1f} ms ({8000 / ms_a:.1f} img/s), "
              f"case c {ms_c:.1f} ms ({64000 / ms_c:.1f} img/s)", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            model.encode_packed(px_a, grids_a)
            torch.cuda.synchronize()
        if args.trace:
            prof.export_chrome_trace(str(args.trace.with_suffix(f".{backend}.json")))
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.device_time_total for e in events)
        print(f"kernel time total {total / 1e3:.1f} ms")
        for e in sorted(events, key=lambda e: -e.device_time_total)[: args.top]:
            print(f"{e.device_time_total / 1e3:8.2f} ms {100 * e.device_time_total / total:5.1f}% "
                  f"x{e.count:<4d} {e.key[:110]}")
        del model
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
