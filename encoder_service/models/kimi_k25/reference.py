"""transformers' Kimi-K2.5 vision tower and projector with given weights: the reference that the parity
tests (tests/models/kimi_k25/test_kimi_parity.py) and the benchmark (bench/kimi_throughput.py) compare against.
transformers is imported only here, when called (it is a test dependency, not the service's)."""

from __future__ import annotations

import torch


def transformers_reference(config: dict, split_state: dict[str, torch.Tensor]
                           ) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(tower, projector) in eval mode for a checkpoint's ``config.json``, loaded from split_state:
    weights in transformers' layout under ``vision_tower.`` and ``mm_projector.``
    (``loading.original_to_split(state, cfg, prefix="")``)."""
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config, Kimi_K25VisionConfig
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25MultimodalProjection, Kimi_K25VisionModel

    vision_cfg = Kimi_K25VisionConfig(**{k: v for k, v in config["vision_config"].items() if k != "model_type"})
    vision_cfg._attn_implementation = "sdpa"
    full_cfg = Kimi_K25Config(vision_config=vision_cfg, text_config=config["text_config"],
                              projection_hidden_size=config["projection_hidden_size"],
                              projection_layer_norm_eps=config["projection_layer_norm_eps"])
    tower = Kimi_K25VisionModel._from_config(vision_cfg).eval()
    projector = Kimi_K25MultimodalProjection(full_cfg).eval()
    for module, prefix in ((tower, "vision_tower."), (projector, "mm_projector.")):
        part = {k.removeprefix(prefix): v for k, v in split_state.items() if k.startswith(prefix)}
        missing, unexpected = module.load_state_dict(part, strict=False)
        # time_position_embeddings is a non-persistent buffer transformers computes itself.
        missing = [m for m in missing if "time_position_embeddings" not in m]
        if missing or unexpected:
            raise ValueError(f"{prefix}: weights missing {missing}, unexpected {unexpected}")
    return tower, projector
