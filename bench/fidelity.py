"""How far each way of running a tower is from float32: transformers in bf16, ours in bf16, ours with
``--quantization fp8``, each against transformers' own float32 forward of the same random weights.

    python bench/fidelity.py --out fidelity.json

Random weights of the full-size presets (seed 0, as every bench), two images of the towers' case
sizes (Qwen2.5-VL-7B 1008x1008, Qwen3-VL-8B 1024x1024) as normal random patches, on one GPU with
TF32 off. Reports each contender's relative Frobenius error against the reference, per feature
level, and its smallest per-token cosine similarity.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from encoder_service.models import load_vision_model
from encoder_service.models.family import preset_config, random_state
from encoder_service.models.presets import get_preset
from encoder_service.models.registry import family_for

CASES = {"qwen2.5-vl-7b": (1008, 14), "qwen3-vl-8b": (1024, 16)}


def transformers_tower(preset, state: dict[str, torch.Tensor], dtype: torch.dtype, device: str) -> torch.nn.Module:
    """transformers' vision model of the preset with our weights (sdpa)."""
    from transformers import AutoConfig, AutoModel

    family = family_for(preset.model_type)
    vision = AutoConfig.for_model(**family.checkpoint_config(preset)).vision_config
    vision._attn_implementation = "sdpa"
    with torch.device(device):
        if preset.model_type == "qwen2_5_vl":  # its vision config has no AutoModel mapping
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

            model = Qwen2_5_VisionTransformerPretrainedModel._from_config(vision, dtype=dtype).eval()
        else:
            model = AutoModel.from_config(vision, dtype=dtype).eval()
    model.load_state_dict({k: v.to(device, dtype) for k, v in state.items()}, strict=True)
    return model


def as_rows(out) -> torch.Tensor:
    """transformers' output -> [tokens, levels * hidden] as ours lays it out (main, then deepstack)."""
    if isinstance(out, torch.Tensor):
        return out
    main = out.pooler_output if getattr(out, "pooler_output", None) is not None else out[0]
    levels = getattr(out, "deepstack_features", None) or []
    return torch.cat([main, *levels], dim=-1) if levels else main


def compare(out: torch.Tensor, ref: torch.Tensor, levels: int) -> dict:
    out, ref = out.float(), ref.float()
    width = ref.shape[-1] // levels
    per_level = [float((out[:, i * width:(i + 1) * width] - ref[:, i * width:(i + 1) * width]).norm()
                       / ref[:, i * width:(i + 1) * width].norm()) for i in range(levels)]
    cos = torch.nn.functional.cosine_similarity(out, ref, dim=-1)
    return {"rel_err": float((out - ref).norm() / ref.norm()), "rel_err_per_level": per_level,
            "min_token_cosine": float(cos.min()), "mean_token_cosine": float(cos.mean())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default=",".join(CASES))
    parser.add_argument("--images", type=int, default=2)
    parser.add_argument("--device", default="cuda", help="cpu runs the tiny presets' check of this script")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    report = {"device": device_name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(sys.argv), "towers": []}
    for name in args.presets.split(","):
        preset = get_preset(name)
        family = family_for(preset.model_type)
        cfg = preset_config(family, preset)
        side, patch = CASES.get(name, (4 * cfg.patch_size * cfg.spatial_merge_size, cfg.patch_size))
        state = random_state(family, cfg)  # seed 0: the tensors load_vision_model(preset) builds
        cells = side // patch
        grids = [(1, cells, cells)] * args.images
        patch_dim = 3 * cfg.temporal_patch_size * cfg.patch_size ** 2
        rng = np.random.default_rng(0)
        pixels = torch.from_numpy(rng.standard_normal((args.images * cells * cells, patch_dim), dtype=np.float32))
        grid_t = torch.tensor(grids, device=args.device)
        outputs = {}
        with torch.inference_mode():
            for label, dtype in (("transformers float32", torch.float32), ("transformers bf16", torch.bfloat16)):
                ref_model = transformers_tower(preset, state, dtype, args.device)
                outputs[label] = as_rows(ref_model(pixels.to(args.device, dtype), grid_thw=grid_t)).float().cpu()
                del ref_model
            for label, dtype, quant in (("ours float32", torch.float32, None), ("ours bf16", torch.bfloat16, None),
                                        ("ours bf16 + fp8", torch.bfloat16, "fp8")):
                model = load_vision_model(name, device=args.device, dtype=dtype, quantization=quant)
                outputs[label] = model.encode_packed(pixels.to(args.device, dtype), grids)[0].float().cpu()
                del model
        ref = outputs["transformers float32"]
        levels = ref.shape[-1] // preset_config(family, preset).out_hidden_size
        rows = {label: compare(out, ref, levels) for label, out in outputs.items() if label != "transformers float32"}
        for label, row in rows.items():
            print(f"{name:14s} {label:22s} rel err {100 * row['rel_err']:6.3f}%  per level "
                  f"{', '.join(f'{100 * e:.3f}%' for e in row['rel_err_per_level'])}  min token cosine "
                  f"{row['min_token_cosine']:.5f}", flush=True)
        report["towers"].append({"preset": name, "images": args.images, "side": side, "rows": rows})
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
