"""Qwen3-VL's image processing: transformers' ``Qwen2VLImageProcessor`` (models/qwen2_5_vl/preprocess.py)
with the settings published with the checkpoints."""

# Qwen3-VL's preprocessor_config.json as published (Qwen3.5's is the same): transformers'
# Qwen2VLImageProcessor at patch 16 with mean/std 0.5.
QWEN3_VL_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
