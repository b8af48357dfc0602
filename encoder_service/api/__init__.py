"""gRPC edge: servicers (VisionEncoder, health, reflection), request validation, error-to-status
mapping, chunked streaming and the server's life cycle. Knows protobuf; hands plain inputs to the
engine."""

from .server import serve
from .servicer import VisionEncoderServicer

__all__ = ["VisionEncoderServicer", "serve"]
