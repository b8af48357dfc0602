"""Image decode and the device half of preprocessing that every model shares: a CPU half (decode to
uint8) and a device half (``staged``). No model code here: each family's image processing lives in
its package (``models/<family>/preprocess.py``)."""

__all__ = [
    "SUPPORTED_FORMATS",
    "decode_image",
]


def __getattr__(name: str):
    # Imported when first asked for, not with the package: the config imports the decoders' table
    # (preprocess/decoders.py) for its choices, and must not pull in Pillow with it.
    if name in __all__:
        from encoder_service.preprocess import decode

        return getattr(decode, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
