"""Vision-encoder microservice for EPD (encode / prefill / decode) disaggregated serving."""

__version__ = "0.1.0"
