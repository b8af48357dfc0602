"""Image decode, resize, normalize, patchify. numpy + Pillow only: no torch here."""

from encoder_service.preprocess.decode import SUPPORTED_FORMATS, decode_image
from encoder_service.preprocess.qwen2_vl import (
    Qwen2VLPreprocessConfig,
    preprocess_qwen2_vl,
    preprocess_qwen2_vl_image,
    smart_resize,
)

__all__ = [
    "SUPPORTED_FORMATS",
    "Qwen2VLPreprocessConfig",
    "decode_image",
    "preprocess_qwen2_vl",
    "preprocess_qwen2_vl_image",
    "smart_resize",
]
