"""The toy family's image processing: transformers' ``Qwen2VLImageProcessor`` (models/qwen2_5_vl/preprocess.py,
its hooks in processor.py) with these settings, as Qwen3-VL's preprocess.py does."""

TOY_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
