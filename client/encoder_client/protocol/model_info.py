"""The shape of GetModelInfo's answer, as the client returns it and the server describes itself."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from encoder_client.protocol.dtypes import BY_NAME, dtype_name
from encoder_client.protocol.stubs import encoder_pb2


@dataclass(frozen=True)
class ModelInfo:
    """What the server runs (GetModelInfo); ``dtype`` is a name, e.g. "bfloat16". The server builds
    its answer from one (``to_proto``), the client reads it back (``from_proto``)."""

    model_id: str
    model_type: str
    hidden_size: int
    dtype: str
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    patch_dim: int
    attention_backend: str
    device: str
    cache_namespace: str
    max_batch_tokens: int
    max_message_bytes: int
    max_image_pixels: int
    version: str
    preprocess: str = ""  # "pil" or "torch"; empty from servers older than the field
    # Levels in each embedding row (main + deepstack levels, each hidden_size wide); 1 for models
    # without extra levels and from servers older than the field.
    feature_levels: int = 1
    # Whether the server writes embeddings into a caller's shared-memory region (--shared-memory on).
    shared_memory: bool = False
    # Where the server decodes images: "pillow" (CPU) or "nvjpeg" (GPU, other pixels: its own
    # cache_namespace); empty from servers older than the field.
    decode: str = ""
    # Which provider runs each fused operation, e.g. "window_attention=triton,rms_scale=triton,
    # gated_mlp=torch"; "none" for a model that uses none; empty from servers older than the field.
    ops: str = ""
    # Video input: "" from a server that takes none (or older than the field), else the decoder and
    # the sampling references it offers; and the limits a clip must stay within (0: unknown).
    video: str = ""
    max_video_frames: int = 0
    max_video_seconds: float = 0.0
    max_video_bytes: int = 0
    # --quantization: "none" or "fp8" (the blocks' linears in e4m3); empty from servers older than the field.
    quantization: str = ""
    # The abstract unix socket where a caller on this host registers shared-memory regions by
    # descriptor (SharedMemoryRegion.handle); empty when the server takes none.
    region_socket: str = ""

    @classmethod
    def from_proto(cls, msg: encoder_pb2.ModelInfo) -> ModelInfo:
        values: dict[str, Any] = {f.name: getattr(msg, f.name) for f in fields(cls)}
        values["feature_levels"] = msg.feature_levels or 1  # 0 on the wire means 1
        try:
            values["dtype"] = dtype_name(msg.dtype)
        except ValueError:
            # A newer server may know dtypes this client does not; do not fail the whole call.
            values["dtype"] = f"dtype({msg.dtype})"
        return cls(**values)

    def to_proto(self) -> encoder_pb2.ModelInfo:
        values: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        values["dtype"] = BY_NAME[self.dtype].enum
        values["feature_levels"] = self.feature_levels if self.feature_levels > 1 else 0  # 1: left off the wire
        return encoder_pb2.ModelInfo(**values)
