"""Image decode and the device half of preprocessing that every model shares: a CPU half (decode to
uint8) and a device half (``staged``). No model code here: each family's image processing lives in
its package (``models/<family>/preprocess.py``)."""

from encoder_service.preprocess.decode import SUPPORTED_FORMATS, decode_image

__all__ = [
    "SUPPORTED_FORMATS",
    "decode_image",
]
