"""Image decode, resize, normalize, patchify: a CPU half (decode to uint8) and a device half
(``staged``). No model code here."""

from encoder_service.preprocess.decode import SUPPORTED_FORMATS, decode_image
from encoder_service.preprocess.kimi_k25 import KimiK25PreprocessConfig, preprocess_kimi_k25
from encoder_service.preprocess.qwen2_vl import (
    Qwen2VLPreprocessConfig,
    preprocess_qwen2_vl,
    smart_resize,
)

__all__ = [
    "SUPPORTED_FORMATS",
    "KimiK25PreprocessConfig",
    "Qwen2VLPreprocessConfig",
    "decode_image",
    "preprocess_kimi_k25",
    "preprocess_qwen2_vl",
    "smart_resize",
]
