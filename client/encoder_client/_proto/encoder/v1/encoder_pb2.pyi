from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_UINT8: DType

class Patches(_message.Message):
    __slots__ = ("grid_thw", "dtype", "data")
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    data: bytes
    def __init__(self, grid_thw: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("encoded", "patches", "content_hash", "video")
    ENCODED_FIELD_NUMBER: _ClassVar[int]
    PATCHES_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    encoded: bytes
    patches: Patches
    content_hash: str
    video: Video
    def __init__(self, encoded: _Optional[bytes] = ..., patches: _Optional[_Union[Patches, _Mapping]] = ..., content_hash: _Optional[str] = ..., video: _Optional[_Union[Video, _Mapping]] = ...) -> None: ...

class Video(_message.Message):
    __slots__ = ("encoded", "frames", "sampling", "frames_fps")
    ENCODED_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FPS_FIELD_NUMBER: _ClassVar[int]
    encoded: bytes
    frames: _containers.RepeatedScalarFieldContainer[bytes]
    sampling: VideoSampling
    frames_fps: float
    def __init__(self, encoded: _Optional[bytes] = ..., frames: _Optional[_Iterable[bytes]] = ..., sampling: _Optional[_Union[VideoSampling, _Mapping]] = ..., frames_fps: _Optional[float] = ...) -> None: ...

class VideoSampling(_message.Message):
    __slots__ = ("reference", "fps", "num_frames", "min_frames", "max_frames", "min_pixels", "max_pixels", "all_frames", "cap_pixels_per_frame", "processor_fps", "processor_num_frames", "processor_do_sample_frames")
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MIN_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    ALL_FRAMES_FIELD_NUMBER: _ClassVar[int]
    CAP_PIXELS_PER_FRAME_FIELD_NUMBER: _ClassVar[int]
    PROCESSOR_FPS_FIELD_NUMBER: _ClassVar[int]
    PROCESSOR_NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    PROCESSOR_DO_SAMPLE_FRAMES_FIELD_NUMBER: _ClassVar[int]
    reference: str
    fps: float
    num_frames: int
    min_frames: int
    max_frames: int
    min_pixels: int
    max_pixels: int
    all_frames: bool
    cap_pixels_per_frame: bool
    processor_fps: float
    processor_num_frames: int
    processor_do_sample_frames: bool
    def __init__(self, reference: _Optional[str] = ..., fps: _Optional[float] = ..., num_frames: _Optional[int] = ..., min_frames: _Optional[int] = ..., max_frames: _Optional[int] = ..., min_pixels: _Optional[int] = ..., max_pixels: _Optional[int] = ..., all_frames: _Optional[bool] = ..., cap_pixels_per_frame: _Optional[bool] = ..., processor_fps: _Optional[float] = ..., processor_num_frames: _Optional[int] = ..., processor_do_sample_frames: _Optional[bool] = ...) -> None: ...

class Sink(_message.Message):
    __slots__ = ("target", "request_id")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    target: str
    request_id: str
    def __init__(self, target: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "images", "output_dtype", "sink", "max_chunk_bytes", "output_region", "cache_only")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SINK_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_REGION_FIELD_NUMBER: _ClassVar[int]
    CACHE_ONLY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[Image]
    output_dtype: DType
    sink: Sink
    max_chunk_bytes: int
    output_region: SharedMemoryRegion
    cache_only: bool
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., output_dtype: _Optional[_Union[DType, str]] = ..., sink: _Optional[_Union[Sink, _Mapping]] = ..., max_chunk_bytes: _Optional[int] = ..., output_region: _Optional[_Union[SharedMemoryRegion, _Mapping]] = ..., cache_only: _Optional[bool] = ...) -> None: ...

class SharedMemoryRegion(_message.Message):
    __slots__ = ("name", "size", "key", "handle")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    key: bytes
    handle: str
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., key: _Optional[bytes] = ..., handle: _Optional[str] = ...) -> None: ...

class EmbeddingChunk(_message.Message):
    __slots__ = ("request_id", "image_index", "content_hash", "grid_thw", "num_tokens", "hidden_size", "dtype", "token_offset", "data", "last", "cache_hit", "timing", "num_images", "feature_levels", "region_offset", "region_bytes", "frame_indices", "frame_timestamps_s", "sampled_frame_indices")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    NUM_IMAGES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LEVELS_FIELD_NUMBER: _ClassVar[int]
    REGION_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    FRAME_INDICES_FIELD_NUMBER: _ClassVar[int]
    FRAME_TIMESTAMPS_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FRAME_INDICES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    image_index: int
    content_hash: str
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    hidden_size: int
    dtype: DType
    token_offset: int
    data: bytes
    last: bool
    cache_hit: bool
    timing: ServerTiming
    num_images: int
    feature_levels: int
    region_offset: int
    region_bytes: int
    frame_indices: _containers.RepeatedScalarFieldContainer[int]
    frame_timestamps_s: _containers.RepeatedScalarFieldContainer[float]
    sampled_frame_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., image_index: _Optional[int] = ..., content_hash: _Optional[str] = ..., grid_thw: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., token_offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., cache_hit: _Optional[bool] = ..., timing: _Optional[_Union[ServerTiming, _Mapping]] = ..., num_images: _Optional[int] = ..., feature_levels: _Optional[int] = ..., region_offset: _Optional[int] = ..., region_bytes: _Optional[int] = ..., frame_indices: _Optional[_Iterable[int]] = ..., frame_timestamps_s: _Optional[_Iterable[float]] = ..., sampled_frame_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class ServerTiming(_message.Message):
    __slots__ = ("queue_ms", "preprocess_ms", "forward_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_MS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    preprocess_ms: float
    forward_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., preprocess_ms: _Optional[float] = ..., forward_ms: _Optional[float] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("content_hashes",)
    CONTENT_HASHES_FIELD_NUMBER: _ClassVar[int]
    content_hashes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, content_hashes: _Optional[_Iterable[str]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("cached",)
    CACHED_FIELD_NUMBER: _ClassVar[int]
    cached: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, cached: _Optional[_Iterable[bool]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("images",)
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    images: int
    def __init__(self, images: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "model_type", "hidden_size", "dtype", "patch_size", "temporal_patch_size", "spatial_merge_size", "patch_dim", "attention_backend", "device", "cache_namespace", "max_batch_tokens", "max_message_bytes", "max_image_pixels", "version", "preprocess", "feature_levels", "shared_memory", "ops", "decode", "video", "max_video_frames", "max_video_seconds", "max_video_bytes", "quantization", "region_socket")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    TEMPORAL_PATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPATIAL_MERGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PATCH_DIM_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_PIXELS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LEVELS_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    MAX_VIDEO_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_VIDEO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_VIDEO_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    REGION_SOCKET_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_type: str
    hidden_size: int
    dtype: DType
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
    preprocess: str
    feature_levels: int
    shared_memory: bool
    ops: str
    decode: str
    video: str
    max_video_frames: int
    max_video_seconds: float
    max_video_bytes: int
    quantization: str
    region_socket: str
    def __init__(self, model_id: _Optional[str] = ..., model_type: _Optional[str] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., patch_size: _Optional[int] = ..., temporal_patch_size: _Optional[int] = ..., spatial_merge_size: _Optional[int] = ..., patch_dim: _Optional[int] = ..., attention_backend: _Optional[str] = ..., device: _Optional[str] = ..., cache_namespace: _Optional[str] = ..., max_batch_tokens: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_image_pixels: _Optional[int] = ..., version: _Optional[str] = ..., preprocess: _Optional[str] = ..., feature_levels: _Optional[int] = ..., shared_memory: _Optional[bool] = ..., ops: _Optional[str] = ..., decode: _Optional[str] = ..., video: _Optional[str] = ..., max_video_frames: _Optional[int] = ..., max_video_seconds: _Optional[float] = ..., max_video_bytes: _Optional[int] = ..., quantization: _Optional[str] = ..., region_socket: _Optional[str] = ...) -> None: ...
