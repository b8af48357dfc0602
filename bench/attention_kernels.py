"""Attention kernels alone at the towers' shapes: each backend's kernel on q, k, v already in its layout
(padding done before the clock starts), its time, its rate counting the model's own head_dim, and its
error against float32 attention of the same bf16 inputs.

Contenders: cuDNN at the model's head_dim and zero-padded to wider ones, FlashInfer's FA3 padded to
128, and torch's varlen (FlashAttention-2).

    python bench/attention_kernels.py [--shapes qwen3-a,qwen3-c,qwen3-b,qwen25-full] [--only cudnn,fa3] [--out F.json]

Each kernel runs in a child process of its own: a launch config that faults poisons only its own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from encoder_service.benchmarks.forward import MIXED_SIZES
from encoder_service.metadata import attention_metadata

# name -> (what, sequence lengths, heads, head_dim)
SHAPES = {
    "qwen3-a": ("Qwen3-VL-8B, 8 x 1024x1024", [4096] * 8, 16, 72),
    "qwen3-c": ("Qwen3-VL-8B, 64 x 448x448", [784] * 64, 16, 72),
    "qwen3-b": ("Qwen3-VL-8B, mixed 224..1344", [(h // 32 * 2) * (w // 32 * 2) for h, w in MIXED_SIZES], 16, 72),
    "qwen25-full": ("Qwen2.5-VL-7B full layers, 8 x 1008x1008", [5184] * 8, 16, 80),
}


def attention_flops(lengths, heads, head_dim) -> float:
    return sum(4 * n * n * heads * head_dim for n in lengths)


def reference(q, k, v, lengths, count: int) -> list[torch.Tensor]:
    """float32 attention of the first ``count`` sequences."""
    out, start = [], 0
    for n in lengths[:count]:
        qs, ks, vs = (x[start:start + n].float().transpose(0, 1) for x in (q, k, v))
        out.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1))
        start += n
    return out


def rel_error(out, ref, lengths, head_dim) -> float:
    errs, start = [], 0
    for r, n in zip(ref, lengths, strict=False):
        o = out[start:start + n, :, :head_dim].float()
        errs.append(((o - r).norm() / r.norm()).item())
        start += n
    return max(errs)


def labels(head_dim, device) -> list[str]:
    """Every kernel that runs here at this head_dim, by label."""
    from encoder_service.attention.registry import backend_class

    def runs(name, dim):
        return backend_class(name).unsupported_reason(device, torch.bfloat16, dim) is None

    found = [f"cudnn d={dim}" for dim in sorted({head_dim, 80, 96, 128})
             if dim >= head_dim and runs("flashinfer-cudnn", dim)]
    if runs("flashinfer-fa3", head_dim):
        found.append("fa3 padded")
    if runs("varlen", head_dim):
        found.append("varlen (torch FA2)")
    return found


def backend_for(label, heads, head_dim, device):
    """(backend, the width it takes q, k, v at) for a label of ``labels``."""
    from encoder_service.attention.registry import backend_class

    if label.startswith("cudnn"):
        width = int(label.split("=")[1])
        backend = backend_class("flashinfer-cudnn")(heads, width, device, torch.bfloat16)
    elif label.startswith("fa3"):
        backend = backend_class("flashinfer-fa3")(heads, head_dim, device, torch.bfloat16)
        width = backend.padded
    else:
        backend, width = backend_class("varlen")(heads, head_dim, device, torch.bfloat16), head_dim
    backend.scale = head_dim**-0.5  # the model's, whatever the kernel's width
    return backend, width


def run_one(key: str, label: str, iters: int) -> dict:
    """One kernel at one shape, in this process (a child of main's: an illegal access in one kernel
    cannot poison the others' measurements)."""
    from encoder_service.benchmarks.forward import time_it

    _, lengths, heads, head_dim = SHAPES[key]
    device = torch.device("cuda")
    torch.manual_seed(0)
    tokens = sum(lengths)
    q, k, v = (torch.randn(tokens, heads, head_dim, device=device, dtype=torch.bfloat16) for _ in range(3))
    ref = reference(q, k, v, lengths, 2)
    backend, width = backend_for(label, heads, head_dim, device)
    qq, kk, vv = (F.pad(x, (0, width - head_dim)) for x in (q, k, v)) if width != head_dim else (q, k, v)
    plan = backend.prepare_ragged(attention_metadata(lengths))
    err = rel_error(backend.forward_ragged(qq, kk, vv, plan), ref, lengths, head_dim)
    seconds = time_it(lambda: backend.forward_ragged(qq, kk, vv, plan), iters, 3)
    return {"kernel": label, "ms": seconds * 1e3,
            "tflops_at_model_head_dim": attention_flops(lengths, heads, head_dim) / seconds / 1e12, "rel_error": err}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--only", default="", help="comma list: only kernels whose label contains one of them")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=120, help="seconds for one kernel's child process")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", nargs=2, metavar=("SHAPE", "LABEL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_one(*args.child, args.iters)))
        return 0

    device = torch.device("cuda")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for key in args.shapes.split(","):
        what, lengths, heads, head_dim = SHAPES[key]
        flops = attention_flops(lengths, heads, head_dim)
        print(f"== {what}: {len(lengths)} sequences, {sum(lengths)} tokens, {heads} heads, head_dim {head_dim}, "
              f"{flops / 1e12:.2f} TFLOP", flush=True)
        rows = []
        for label in labels(head_dim, device):
            if not any(part in label for part in args.only.split(",")):
                continue
            cmd = [sys.executable, __file__, "--child", key, label, "--iters", str(args.iters)]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                row = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else \
                    {"kernel": label, "error": done.stderr.strip().splitlines()[-1][:300] if done.stderr else
                     f"exit {done.returncode}"}
            except subprocess.TimeoutExpired:
                row = {"kernel": label, "error": f"timed out after {args.timeout:.0f} s"}
            rows.append(row)
            if "error" in row:
                print(f"  {label:30s} {row['error']}", flush=True)
            else:
                print(f"  {label:30s} {row['ms']:8.3f} ms {row['tflops_at_model_head_dim']:7.1f} TFLOP/s  "
                      f"rel err {row['rel_error']:.2e}", flush=True)
        results["shapes"][key] = {"what": what, "lengths": lengths, "heads": heads, "head_dim": head_dim,
                                  "tflop": flops / 1e12, "kernels": rows}
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
