"""The benchmark's FLOP count (what 'share of the GEMM ceiling' divides by) against the hand count below."""

from encoder_service.bench import grids_for, model_flops
from encoder_service.models.presets import PRESETS
from encoder_service.models.qwen2_5_vl.model import Qwen2_5_VisionConfig


def test_qwen_7b_costs_about_1_4_gflop_per_patch_at_1008px():
    cfg = Qwen2_5_VisionConfig.from_dict(PRESETS["qwen2.5-vl-7b"].vision_config)
    grids = grids_for([(1008, 1008)])
    assert grids == [[1, 72, 72]]
    per_patch = model_flops(cfg, grids) / (72 * 72)
    # Hand count: ~1.40 GFLOP per patch (GEMMs 1.29, attention 0.11) for a 1008x1008 image.
    assert 1.35e9 < per_patch < 1.45e9
