"""The one configuration object of the server, built once at start-up from flags and environment.

Every option is a flag ``--some-option`` and an environment variable ``ENCODER_SERVICE_SOME_OPTION``;
a flag given on the command line wins over the environment, the environment over the default
(``config_flags.py`` derives the flags and variables from the fields and checks the values at start-up).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

from encoder_client.protocol.dtypes import OUTPUT_DTYPES

from .preprocess.decoders import IMAGE_DECODERS, VIDEO_DECODERS
from .sink_allowlist import SinkAllowlist

ENV_PREFIX = "ENCODER_SERVICE_"
DEFAULT_PRESET = "tiny-qwen2.5-vl"
MiB = 1 << 20
GiB = 1 << 30
# The smallest chunk a request may ask for: each chunk repeats a header (request id, hash, grid),
# so tiny chunks would make a response many times the size of the embedding it carries.
MIN_CHUNK_BYTES = 4096


def chunk_budget(requested: int, server_max: int) -> int:
    """The byte budget of a response's chunks: EncodeRequest.max_chunk_bytes (0: the server's
    --max-chunk-bytes), the server's setting also the ceiling, so a chunk always fits in one gRPC
    message; the floor keeps the repeated chunk headers a small part of the response."""
    return max(MIN_CHUNK_BYTES, min(requested or server_max, server_max))


def option(default, help: str, *, choices: tuple[str, ...] | None = None, at_least: float | None = None,
           above: float | None = None, note: str | None = None):
    """One option, declared once: its default (and so its type), the --help text, the allowed values
    and the bound checked at start-up (``note`` names the special value the bound leaves out). The
    flag ``--some-option`` and the variable ``ENCODER_SERVICE_SOME_OPTION`` are derived from the name."""
    return field(default=default, metadata={"help": help, "choices": choices, "at_least": at_least,
                                            "above": above, "note": note})


@dataclass(frozen=True)
class ServiceConfig:
    # empty = the built-in tiny preset on the CPU
    model: str = option("",
        "checkpoint directory (transformers format) or a built-in preset name "
        f"(e.g. {DEFAULT_PRESET}, qwen2.5-vl-7b: random weights). Default: the tiny random "
        f"{DEFAULT_PRESET} preset on the CPU, for trying the service out.")
    device: str = option("cpu",
        "torch device the vision tower runs on: cpu, cuda, cuda:1, ...")
    # one worker process per entry (0,1 / cpu,cpu / all); empty = in-process on device
    devices: str = option("",
        "one worker process per device, behind this one front end (one port, one cache, one set "
        "of metrics): GPU indices (0,1 or cuda:0,cuda:1), all (every visible GPU) or cpu,cpu. The "
        "front end decodes, caches and batches, and never touches a GPU; each worker owns its model. "
        "A worker that dies is started again while the others serve. Empty: one device, --device, "
        "in this process.")
    dtype: str = option("float32",
        "model dtype: float32, float16 or bfloat16. Embeddings are cached in it and "
        "streamed in it unless a request asks for another output_dtype.",
        choices=OUTPUT_DTYPES)
    attn_backend: str = option("auto",
        "attention backend: auto (first one that works here), sdpa, varlen, "
        "flashinfer, aiter. A backend named here runs every attention layer unless --ops names "
        "a provider that computes attention itself.")
    # providers of the fused operations (encoder_service/ops/selection.py)
    ops: str = option("auto",
        "providers of the model's fused operations (window_attention, rms_scale, gated_mlp; with "
        "--quantization fp8 also rms_quant, fp8_gated_mlp or act_quant): auto "
        "(the fastest that runs here; the Triton window kernel only with --attn-backend auto), "
        "torch (plain torch everywhere, attention through the backend), or comma-separated "
        "CAPABILITY=PROVIDER entries, e.g. window_attention=triton,gated_mlp=torch, plus at most "
        "one bare provider for the rest (torch,rms_scale=triton). Providers: torch, triton.")
    quantization: str = option("none",
        "none (the weights' dtype, --dtype, throughout) or fp8: each transformer block's linears in "
        "FP8 e4m3, weights with one scale per output channel, activations with one per token "
        "(Qwen2.5-VL, Qwen3-VL and Qwen3.5 towers; a GPU with FP8 GEMMs, compute capability 8.9 or "
        "newer, with --dtype bfloat16; or the CPU). Faster, and less exact: docs/serving.md gives "
        "both. Its embeddings have their own cache namespace.",
        choices=("none", "fp8"))
    host: str = option("0.0.0.0",
        "address the gRPC server binds to (127.0.0.1 for loopback only).")
    port: int = option(50051,
        "gRPC port; 0 picks a free one (the log says which).")
    # -1 = by device (see _device_defaults)
    cache_bytes: int = option(-1,
        "embedding cache size in bytes (sum of the cached embeddings' bytes, kept on "
        "the CPU); least recently used entries are evicted beyond it. 0 disables caching; "
        "-1: 1 GiB on the CPU, on a GPU a quarter of the host's RAM up to 16 GiB.",
        at_least=0, note="or -1: by device")
    max_batch_tokens: int = option(16384,
        "most patches in one forward pass; concurrent requests are batched up to "
        "it. One image with more patches than this is rejected (RESOURCE_EXHAUSTED); a larger clip "
        "is cut into parts of whole time steps, one forward each (see --max-video-patches).",
        at_least=1)
    max_queue_images: int = option(256,
        "most items admitted and waiting for a forward pass, an image or a clip counting one "
        "each; a request that would exceed it is rejected at once with RESOURCE_EXHAUSTED.",
        at_least=1)
    max_message_bytes: int = option(64 * MiB,
        "largest gRPC message accepted or sent, in bytes (RESOURCE_EXHAUSTED over it).",
        at_least=64 * 1024)
    # -1 = derived from the model's max_pixels (preprocess/decode.py derived_pixel_limit)
    max_image_pixels: int = option(-1,
        "largest encoded image accepted, in pixels as read from its header, before any pixel is "
        "decoded (guards against decompression bombs). Also bounds each image's decode memory: "
        "12 bytes for each of these pixels (WebP and images with transparency need more a pixel, "
        "so their largest accepted size is smaller). -1: 16 x the model's max_pixels (the size "
        "its preprocessing resizes to), at most 64 Mi; Qwen2.5-VL-7B: 16056320, so a 12 Mpx "
        "photo passes. The start-up log and ModelInfo.max_image_pixels say the value in force.",
        at_least=1, note="or -1: 16 x the model's max_pixels")
    max_decode_seconds: float = option(5.0,
        "time budget of one image's decode: a decode still running after this many seconds "
        "(wall clock, from its start on a decode thread) is stopped and the image refused "
        "(RESOURCE_EXHAUSTED). Checked at each read of the file's bytes; the pixel, memory and "
        "JPEG scan limits bound what happens between two.",
        above=0)
    max_video_bytes: int = option(64 * MiB,
        "largest video accepted, in bytes (a container, or the sum of a clip's frames); larger is "
        "RESOURCE_EXHAUSTED before anything is decoded. 0: the server takes no video.",
        at_least=0)
    max_video_frames: int = option(18000,
        "most frames a clip's stream may hold (what decoding may have to walk through, 10 minutes "
        "at 30 fps by default), read from the container and enforced while decoding; the frames the "
        "model samples are bounded by its own max_frames, --max-video-patches and "
        "--max-video-decoded-bytes.",
        at_least=1)
    # -1 = 16 x max_batch_tokens
    max_video_patches: int = option(-1,
        "most patches one clip may have (all its parts together; RESOURCE_EXHAUSTED above): what a "
        "clip may cost the GPU and the host its embedding. -1: 16 x --max-batch-tokens (262144 by "
        "default: a 60 s 1280x720 clip at 2 fps for Qwen2.5-VL is 287,040).",
        at_least=1, note="or -1: 16 x --max-batch-tokens")
    max_video_decoded_bytes: int = option(1 << 30,
        "most bytes a clip's sampled frames may take decoded (frames x width x height x 3, from the "
        "container's header before any frame is decoded): what the host holds and the device "
        "receives for one clip, since the frames travel at their source size.",
        at_least=1)
    max_video_seconds: float = option(600.0,
        "longest clip accepted, in seconds of its stream (as the container states, enforced on the "
        "frames' timestamps while decoding)",
        above=0)
    max_video_decode_seconds: float = option(60.0,
        "wall-clock budget of one clip's decode in its decoder process; past it the process is "
        "killed and replaced and the clip refused (RESOURCE_EXHAUSTED)",
        above=0)
    max_video_pixels_per_sample: int = option(256 * MiB,
        "most pixels a clip's decode may put through the decoder for each frame it samples (every "
        "decoded frame's width x height, counted as it decodes): a clip whose few sampled frames lie "
        "far apart in a long, large stream is refused (RESOURCE_EXHAUSTED) after this much work "
        "instead of holding a decoder until --max-video-decode-seconds. The default lets a 4K clip "
        "at 60 fps be sampled at 2 fps.",
        at_least=1)
    # -1 = by device
    video_decode_processes: int = option(-1,
        "processes decoding clips (containers, and clips given as frames), started with the first "
        "clip: a decoder that crashes or hangs loses only its own clip; the process is replaced. "
        "Shared fairly: a free decoder goes to the client, then the request, holding the fewest, "
        "and with 3 or more the last two free ones only to a client (the last) or a request (the "
        "one before) holding none. -1: 3 on the CPU, on a GPU half the host's cores, from 3 to 16 "
        "per GPU (decoding a clip costs more CPU than encoding it costs the GPU).",
        at_least=1, note="or -1: by device")
    # -1 = 8 x video_decode_processes
    max_video_decodes_waiting: int = option(-1,
        "most clips waiting for a decoder (3/4 of it for one client, half for one request); more is "
        "RESOURCE_EXHAUSTED with a retry hint. -1: 8 x --video-decode-processes.",
        at_least=1, note="or -1: 8 x --video-decode-processes")
    max_chunk_bytes: int = option(4 * MiB,
        "default (and upper bound) of the embedding bytes in one streamed chunk; "
        f"a request may ask for less, down to {MIN_CHUNK_BYTES}.",
        at_least=MIN_CHUNK_BYTES)
    max_images_per_request: int = option(256,
        "most items (images and clips, as bytes, pixels, patches or content-hash references, "
        "each counting one) in one Encode request; more is INVALID_ARGUMENT. Bounds what one request can make "
        "the server hold and send.",
        at_least=1)
    batch_wait_ms: float = option(0.0,
        "how long an idle device worker waits for more images before starting a forward that "
        "is not full (0, the default: run what is queued right away; a busy worker batches what "
        "queued while its forward ran, so a lone image never waits and load still batches).",
        at_least=0)
    # -1 = by device
    preprocess_threads: int = option(-1,
        "threads decoding images (CPU work kept off the event loop; resize, "
        "normalize and patchify run on the model's device). -1: 2 on the CPU, "
        "on a GPU the host's cores minus 2, from 2 to 8.",
        at_least=1, note="or -1: by device")
    grace_period_s: float = option(30.0,
        "on SIGTERM: seconds in-flight requests get to finish before the server exits.",
        at_least=0)
    # 0 = no progress check (engine/watchdog.py)
    watchdog_timeout_s: float = option(120.0,
        "a device worker that has work (a batch in flight or images queued) and "
        "completes no forward for this long is stalled: "
        "encoder_service_worker_stalled says so, and health is NOT_SERVING while no "
        "device is up and progressing, SERVING again after its next forward. Generous "
        "by default: a cold, large batch can take long. 0 turns the check off (a dead "
        "worker thread is still noticed).",
        at_least=0, note="0: off")
    # -1 = no metrics endpoint; 0 = any free port (logged)
    metrics_port: int = option(-1,
        "port of the Prometheus /metrics HTTP endpoint; 0 picks a free one, -1 disables it.")
    # not --host: the endpoint is plaintext and unauthenticated (README "Security")
    metrics_host: str = option("127.0.0.1",
        "address the /metrics endpoint binds to: loopback by default, whatever --host is, since it "
        "has no TLS and no token. 0.0.0.0 where a scraper reaches it over the network (Kubernetes: "
        "Prometheus scrapes the pod's IP; deploy/ sets it), behind a NetworkPolicy.")
    log_level: str = option("INFO",
        "DEBUG, INFO, WARNING or ERROR.",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    # comma-separated host:port glob patterns; empty = no sink allowed
    allowed_sinks: str = option("",
        "comma-separated host:port patterns (e.g. 'prefill-*.svc:9000,10.0.0.*:9000') "
        "of the EmbeddingSink targets a request may push to; any other target is "
        "PERMISSION_DENIED before a connection is tried. IP patterns (a.b.c.*) match only "
        "IP addresses, octet by octet; host patterns match host names label by label "
        "(* never crosses a dot); '*:PORT' matches any host. Empty: sinks are refused.")
    sink_timeout_s: float = option(10.0,
        "bound on every push to a sink (connecting, retrying, writing, the ack), also "
        "without a caller deadline. Any failure toward a sink is answered UNAVAILABLE "
        "with one message once this bound has passed (the log and the metric say "
        "why), so a caller cannot tell a closed port from an open one.",
        above=0)
    # auto, off, or token budgets (models/cuda_graphs.py)
    cuda_graphs: str = option("auto",
        "on CUDA: forwards replayed as CUDA graphs captured at start-up, one per token budget; a "
        "batch runs in the smallest budget that holds it, padded with a filler image that changes "
        "no real image's output. auto: a ladder of budgets from 256 patches up (each 1.5x or 2x "
        "the last) to 6144 (a 1008x1008 image: above it replays measured slower than eager "
        "forwards) or --max-batch-tokens; off: every forward eager; or budgets in "
        "patches, comma-separated (e.g. 1024,4096). Larger batches run eagerly. The start-up log "
        "says what the capture took (seconds, GPU memory).")
    # auto, pil, torch
    preprocess: str = option("auto",
        "pil: resize on the CPU with Pillow, bit-exact with transformers' PIL image processor; "
        "torch: resize on the model's device (bicubic, antialiased), equal to transformers' "
        "default torchvision-backed processor; auto: torch on a GPU, pil on the CPU. "
        "Part of cache_namespace.",
        choices=("auto", "pil", "torch"))
    # pillow, nvjpeg (preprocess/nvjpeg.py)
    decode: str = option("pillow",
        "pillow: images decode on the CPU (libjpeg-turbo, the pixels transformers' processors get); "
        "nvjpeg: JPEGs decode on the GPU (torchvision's decode_jpeg; needs torchvision, a CUDA "
        "--device or GPU --devices, and --preprocess torch) and the CPU reads only their headers: "
        "about 1 ms instead of 9-14 ms of a core for a 1008x1008 photo. With --devices each worker "
        "process decodes on its own GPU. Its pixels differ from libjpeg's by a few levels (chroma "
        "upsampling), so it has a cache_namespace of its own. PNG, WebP, GIF and progressive, "
        "grayscale or CMYK JPEGs still decode with Pillow.",
        choices=tuple(IMAGE_DECODERS))
    # auto, front-end, workers (preprocess/worker_decode.py)
    decode_in: str = option("auto",
        "where --decode pillow runs with --devices: workers: each device's worker process decodes "
        "the JPEGs and PNGs of its own batches (the front end reads only their headers and checks "
        "every limit), so decode capacity grows with the GPUs; front-end: the server process decodes "
        "every image, as with one device; auto: workers when --devices starts worker processes. The "
        "same decoder on the same bytes: embeddings and cache_namespace do not change. WebP, GIF and "
        "the images the expensive-decode pool takes still decode in the front end.",
        choices=("auto", "front-end", "workers"))
    # pyav, nvdec (preprocess/video_nvdec.py)
    video_decode: str = option("pyav",
        "pyav: clips decode on the CPU with FFmpeg (PyAV), the frames transformers' read_video_pyav "
        "gives; nvdec: the sampled frames decode on the GPU's video decoder (NVIDIA's PyNvVideoCodec; "
        "needs a CUDA --device or GPU --devices), still in the decoder processes, after PyAV has "
        "checked and counted the clip; its frames are converted to RGB by FFmpeg's own converter, as "
        "pyav's are. It keeps a cache_namespace of its own; each decoder process holds a CUDA context.",
        choices=tuple(VIDEO_DECODERS))
    # on: Encode may name an EncodeRequest.output_region (api/shared_memory.py)
    shared_memory: str = option("on",
        "on: a caller on this host may have its embeddings written into a shared-memory region "
        "it created (/dev/shm/encoder-*, EncodeRequest.output_region) instead of the stream, "
        "so the bytes never pass through gRPC (what the Python client does by default for a "
        "target on its host). The server writes only into an object whose first bytes are the "
        "request's key, which only the object's owner can read: no caller can have it write into "
        "another's region. off: every response on the stream.",
        choices=("off", "on"))
    # processes that serve the gRPC port for this one (api/relay/process.py); 0 = this process serves it;
    # -1 = derived from --devices and the cores (_device_defaults)
    grpc_processes: int = option(-1,
        "N > 0: N processes of their own serve the gRPC port (SO_REUSEPORT; TLS ends there) and "
        "relay each call to this process over a private unix socket; what this process writes "
        "for them goes through shared memory, so streaming the responses (gRPC copies and sends "
        "every message on one thread per process) runs in N processes instead of beside the "
        "decode, cache and batching. One cache, one batch queue, one set of metrics, as with 0. "
        "Like vLLM's --api-server-count. Needs /dev/shm room for the responses in flight. -1: 0 "
        "with one device; with --devices of several GPUs, 2 a GPU, at most a quarter of the cores.",
        at_least=0, note="or -1: 2 a GPU with several --devices GPUs, else 0")
    # Security (README "Security"): every path empty = that feature off.
    # PEM certificate chain of the gRPC port; with tls_key
    tls_cert: str = option("",
        "PEM certificate (chain) of the gRPC port; with --tls-key the port speaks TLS only. "
        "Re-read when the file changes (certificate rotation without a restart).")
    tls_key: str = option("",
        "PEM private key of --tls-cert (unencrypted).")
    # PEM CA bundle: clients must present a certificate it signed (mTLS)
    tls_client_ca: str = option("",
        "PEM CA bundle: with it, clients must present a certificate signed by one of these "
        "CAs (mutual TLS). Needs --tls-cert. Re-read when the file changes.")
    # plaintext grpc.health.v1-only port; -1 = none
    health_port: int = option(-1,
        "a second, plaintext port serving only grpc.health.v1 (the same SERVING/NOT_SERVING "
        "as the main port), for Kubernetes gRPC probes, which cannot speak TLS; 0 picks a "
        "free one, -1 (the default) opens none.")
    # bearer tokens, one a line
    auth_token_file: str = option("",
        "file of accepted bearer tokens, one a line (blank lines and # comments ignored); "
        "callers send 'authorization: Bearer <token>' metadata. Without a token: "
        "UNAUTHENTICATED; a wrong one: PERMISSION_DENIED; health and reflection stay "
        "open. Re-read when the file changes.")
    # concurrent Encode calls per client; 0 = no limit
    max_requests_per_client: int = option(0,
        "most concurrent Encode calls of one client (its bearer token with "
        "--auth-token-file, else its IP address); beyond it RESOURCE_EXHAUSTED "
        "at once. 0: no limit.",
        at_least=0, note="0: no limit")
    # PEM CA bundle the sinks' certificates are checked against
    sink_tls_ca: str = option("",
        "PEM CA bundle: pushes to EmbeddingSinks use TLS and check the sink's certificate "
        "against it.")
    # PEM client certificate presented to sinks (mTLS); with sink_tls_key
    sink_tls_cert: str = option("",
        "PEM client certificate presented to EmbeddingSinks (mutual TLS); with "
        "--sink-tls-key. Without --sink-tls-ca the system's root CAs check the sink.")
    sink_tls_key: str = option("",
        "PEM private key of --sink-tls-cert.")

    # SGLang's encoder protocol (api/sglang/front_end.py); -1 = off
    sglang_compat_port: int = option(-1,
        "port of the SGLang-compatible front end: SGLang's sglang.grpc.encoder.SglangEncoder service, "
        "for a language server started with --language-only --encoder-urls grpc://HOST:PORT "
        "(README 'Using it with SGLang'). Plaintext; --auth-token-file's tokens (see "
        "--sglang-compat-tokens) and --max-requests-per-client apply as on the main port; embeddings "
        "are pushed over ZMQ to --allowed-sinks targets only. Needs the sglang extra. 0 picks a free "
        "one, -1 (the default) opens none.")
    # whether the SGLang port checks --auth-token-file's tokens
    sglang_compat_tokens: str = option("on",
        "on: with --auth-token-file, calls on the SGLang port need a bearer token too, as on the main "
        "port. SGLang's own client (0.5.23) sends none: 'off' leaves that port without tokens (keep it "
        "on the cluster network; per-client limits then count by IP address).",
        choices=("on", "off"))
    # bound on delivering an SGLang Encode's embeddings once computed
    sglang_send_timeout_s: float = option(30.0,
        "seconds an SGLang Encode's embeddings, once computed, may wait for delivery: for the "
        "scheduler ranks' SchedulerReceiveUrl registrations and the ZMQ pushes together; then the "
        "call is UNAVAILABLE and the embeddings are dropped. Also how long a registration waits for "
        "its Encode.",
        above=0)
    # bytes of SGLang embeddings computed and not yet delivered, all calls together
    sglang_max_held_bytes: int = option(1 * GiB,
        "bytes of embeddings the SGLang port holds for delivery, all calls together (waiting for "
        "receivers or being pushed); an Encode that would pass it is RESOURCE_EXHAUSTED (retry "
        "later; never, for a request over it by itself).",
        at_least=1)
    # hosts whose http(s) image URLs the SGLang front end fetches; empty = none
    allow_url_fetch: str = option("",
        "comma-separated hosts whose http(s) image URLs the SGLang front end may fetch: host names "
        "matched label by label (cdn.example.com, *.example.com), IPv4 patterns (10.0.0.*) or [IPv6] "
        "literals, each optionally :PORT. A host name is resolved once and fetched at that address; "
        "private, loopback and link-local addresses are refused unless an IP pattern lists them. "
        "No redirects; size bounded by --max-message-bytes, 10 s per fetch. Empty: data URLs only.")

    def __post_init__(self) -> None:
        if self.devices.strip():
            # With worker processes, ``device`` is the kind of device they run on (cpu or cuda). Kept for
            # what reads it; code that must tell the two meanings apart reads ``placement`` instead.
            entries = device_entries(self.devices)
            kind = "cpu" if entries and all(e == "cpu" for e in entries) else "cuda"
            object.__setattr__(self, "device", kind)
        # -1 means "what suits the device": resolved here, so every user of the config (and the
        # start-up log) sees the number in force.
        for name, value in _device_defaults(self.device, self.worker_count).items():
            if getattr(self, name) == -1:
                object.__setattr__(self, name, value)
        if self.max_video_patches == -1:
            object.__setattr__(self, "max_video_patches", 16 * self.max_batch_tokens)
        if self.max_video_decodes_waiting == -1:
            object.__setattr__(self, "max_video_decodes_waiting", 8 * self.video_decode_processes)

    @property
    def cuda_graph_budgets(self) -> tuple[int, ...] | None:
        """``--cuda-graphs`` read: None for auto (the model's ladder), () for off, else the budgets
        asked for. ValueError for anything else."""
        return _cuda_graph_budgets(self.cuda_graphs)

    @property
    def worker_count(self) -> int:
        """Devices served by this node. ``--devices all``: the GPUs CUDA_VISIBLE_DEVICES names, else those the
        driver lists (/proc/driver/nvidia/gpus; one where it lists none). Read without the CUDA runtime:
        the server process never initialises it."""
        if self.devices.strip() == "all":
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible is not None:
                return max(1, len(device_entries(visible)))
            try:
                return max(1, len(os.listdir("/proc/driver/nvidia/gpus")))
            except OSError:
                return 1
        return max(1, len(device_entries(self.devices)))

    @property
    def allowed_sink_patterns(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.allowed_sinks.split(",") if p.strip())

    @property
    def url_fetch_patterns(self) -> tuple[str, ...]:
        """``--allow-url-fetch`` as ``host:port`` patterns (``host:*`` where no port is given)."""
        return tuple(url_fetch_pattern(p.strip()) for p in self.allow_url_fetch.split(",") if p.strip())

    @functools.cached_property
    def sink_allowlist(self) -> SinkAllowlist:
        """``--allowed-sinks``, parsed once for every user (the start-up check raises its ValueError)."""
        return SinkAllowlist(self.allowed_sink_patterns, "allowed-sinks")

    @functools.cached_property
    def url_fetch_allowlist(self) -> SinkAllowlist:
        """``--allow-url-fetch``, parsed once (as strictly as ``--allowed-sinks``)."""
        return SinkAllowlist(self.url_fetch_patterns, "allow-url-fetch")

    @property
    def tls(self) -> bool:
        return self.security.tls

    @property
    def sink_tls(self) -> bool:
        return self.security.sink_tls

    @property
    def model_or_default(self) -> str:
        return self.loading.model_or_default

    @property
    def uses_default_model(self) -> bool:
        return not self.model

    # --- the groups each component is handed (as vLLM's VllmConfig hands out ModelConfig, ...) ------------
    # The fields above stay the one declaration of every flag (config_flags.py derives them); a group is a
    # read-only view of the resolved values one component needs, built once, small enough to pickle.

    @functools.cached_property
    def placement(self) -> Placement:
        """Where the model runs: ``--device`` in this process, or ``--devices``' worker processes (whose
        kind, cpu or cuda, is what ``device`` then holds: see ``__post_init__``)."""
        if self.devices:  # as the engine always chose (a blank --devices fails when the workers start)
            return OnWorkers(self.devices, kind="cuda" if self.device.startswith("cuda") else "cpu")
        return OnDevice(self.device)

    @property
    def decode_in_workers(self) -> bool:
        """``--decode-in`` resolved: whether worker processes decode the front end's JPEGs and PNGs."""
        return (self.decode_in == "workers"
                or (self.decode_in == "auto" and bool(self.devices.strip())
                    and not IMAGE_DECODERS[self.decode].on_device))

    @functools.cached_property
    def loading(self) -> LoadingConfig:
        return LoadingConfig(model=self.model, device=self.device, dtype=self.dtype, attn_backend=self.attn_backend,
                             ops=self.ops, quantization=self.quantization, preprocess=self.preprocess,
                             decode=self.decode,
                             video_decode=self.video_decode, cuda_graphs=self.cuda_graphs,
                             max_batch_tokens=self.max_batch_tokens, log_level=self.log_level)

    @functools.cached_property
    def batching(self) -> BatchingConfig:
        return BatchingConfig(max_batch_tokens=self.max_batch_tokens, batch_wait_ms=self.batch_wait_ms,
                              max_queue_images=self.max_queue_images)

    @functools.cached_property
    def video(self) -> VideoConfig:
        return VideoConfig(max_bytes=self.max_video_bytes, max_frames=self.max_video_frames,
                           max_patches=self.max_video_patches, max_decoded_bytes=self.max_video_decoded_bytes,
                           max_seconds=self.max_video_seconds, max_decode_seconds=self.max_video_decode_seconds,
                           max_pixels_per_sample=self.max_video_pixels_per_sample,
                           decode_processes=self.video_decode_processes,
                           max_decodes_waiting=self.max_video_decodes_waiting, decode=self.video_decode)

    @functools.cached_property
    def security(self) -> SecurityConfig:
        return SecurityConfig(tls_cert=self.tls_cert, tls_key=self.tls_key, tls_client_ca=self.tls_client_ca,
                              auth_token_file=self.auth_token_file,
                              max_requests_per_client=self.max_requests_per_client,
                              relayed=self.grpc_processes > 0, sink_tls_ca=self.sink_tls_ca,
                              sink_tls_cert=self.sink_tls_cert, sink_tls_key=self.sink_tls_key)

    @functools.cached_property
    def sglang(self) -> SglangConfig:
        return SglangConfig(port=self.sglang_compat_port, tokens=self.sglang_compat_tokens,
                            send_timeout_s=self.sglang_send_timeout_s, max_held_bytes=self.sglang_max_held_bytes,
                            allow_url_fetch=self.allow_url_fetch, url_fetch_allowlist=self.url_fetch_allowlist)

    @functools.cached_property
    def requests(self) -> RequestLimits:
        return RequestLimits(max_message_bytes=self.max_message_bytes,
                             max_images_per_request=self.max_images_per_request,
                             max_chunk_bytes=self.max_chunk_bytes, sink_timeout_s=self.sink_timeout_s,
                             sink_allowlist=self.sink_allowlist)

    @functools.cached_property
    def metrics_endpoint(self) -> MetricsConfig:
        return MetricsConfig(port=self.metrics_port, host=self.metrics_host)

    @functools.cached_property
    def relays(self) -> RelayConfig:
        return RelayConfig(processes=self.grpc_processes, host=self.host, port=self.port, log_level=self.log_level)


@dataclass(frozen=True)
class OnDevice:
    """No ``--devices``: the model runs in this process, on ``device`` (cpu, cuda, cuda:1, ...)."""

    device: str

    @property
    def kind(self) -> str:
        return "cuda" if self.device.startswith("cuda") else "cpu"


@dataclass(frozen=True)
class OnWorkers:
    """``--devices``: one worker process per entry of ``devices``; this process never touches a device.
    ``devices``: the flag as given (engine/devices.py parses it); ``kind``: what the workers run on, cpu
    or cuda (``--device`` is not used then)."""

    devices: str
    kind: str


# Where the model runs: the meaning ``--device`` had, made a type instead of a rewritten field.
Placement = OnDevice | OnWorkers


@dataclass(frozen=True)
class LoadingConfig:
    """What shapes the model a worker loads (engine/loading.py): all a worker process is sent.
    ``device``: ``--device`` as resolved (with ``--devices`` each worker is told its own device)."""

    model: str
    device: str
    dtype: str
    attn_backend: str
    ops: str
    quantization: str
    preprocess: str
    decode: str
    video_decode: str
    cuda_graphs: str
    max_batch_tokens: int  # the largest CUDA graph budget --cuda-graphs auto captures
    log_level: str  # a worker process sets up its own logging

    @property
    def model_or_default(self) -> str:
        return self.model or DEFAULT_PRESET

    @property
    def cuda_graph_budgets(self) -> tuple[int, ...] | None:
        """``--cuda-graphs`` read (``ServiceConfig.cuda_graph_budgets``: one rule, checked at start-up)."""
        return _cuda_graph_budgets(self.cuda_graphs)


@dataclass(frozen=True)
class BatchingConfig:
    """How the engine's queue is filled and emptied: admission, and the batches the workers take."""

    max_batch_tokens: int
    batch_wait_ms: float
    max_queue_images: int

    @property
    def batch_wait_s(self) -> float:
        return self.batch_wait_ms / 1000.0


@dataclass(frozen=True)
class VideoConfig:
    """The clip limits and the decoder processes (engine/video_preparation.py, engine/clip_parts.py)."""

    max_bytes: int  # 0: no video
    max_frames: int
    max_patches: int
    max_decoded_bytes: int
    max_seconds: float
    max_decode_seconds: float
    max_pixels_per_sample: int
    decode_processes: int
    max_decodes_waiting: int
    decode: str  # pyav or nvdec


@dataclass(frozen=True)
class SecurityConfig:
    """The gRPC port's TLS, tokens and per-client limits, and TLS toward the sinks (api/security/).
    ``relayed``: calls reach this process through --grpc-processes' relays."""

    tls_cert: str
    tls_key: str
    tls_client_ca: str
    auth_token_file: str
    max_requests_per_client: int
    relayed: bool
    sink_tls_ca: str
    sink_tls_cert: str
    sink_tls_key: str

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def sink_tls(self) -> bool:
        return bool(self.sink_tls_ca or self.sink_tls_cert)


@dataclass(frozen=True)
class SglangConfig:
    """The SGLang-compatible front end (api/sglang/front_end.py)."""

    port: int  # -1: off
    tokens: str  # on / off
    send_timeout_s: float
    max_held_bytes: int
    allow_url_fetch: str
    url_fetch_allowlist: SinkAllowlist  # allow_url_fetch, parsed once


@dataclass(frozen=True)
class RequestLimits:
    """What one call may ask of a front end (the VisionEncoder port's and the SGLang port's alike)."""

    max_message_bytes: int
    max_images_per_request: int
    max_chunk_bytes: int
    sink_timeout_s: float
    sink_allowlist: SinkAllowlist  # --allowed-sinks, parsed once


@dataclass(frozen=True)
class RelayConfig:
    """``--grpc-processes``' relay processes (api/relay/): how many, the public port they serve in this
    process's place, and the log level they set up. They also read two groups the main port has: the
    message sizes of ``RequestLimits`` and the port's TLS of ``SecurityConfig``."""

    processes: int  # 0: no relays, this process serves the port
    host: str
    port: int  # 0: a free one (the first relay's, which the others share)
    log_level: str  # a relay process sets up its own logging


@dataclass(frozen=True)
class MetricsConfig:
    """The Prometheus endpoint: port (-1: none, 0: any free one) and address."""

    port: int
    host: str


def _cuda_graph_budgets(cuda_graphs: str) -> tuple[int, ...] | None:
    value = cuda_graphs.strip().lower()
    if value in ("auto", "off"):
        return None if value == "auto" else ()
    try:
        budgets = tuple(sorted({int(v) for v in value.split(",") if v.strip()}))
    except ValueError:
        budgets = ()
    if not budgets or budgets[0] < 1:
        raise ValueError(f"cuda-graphs {cuda_graphs!r}: auto, off, or token budgets in patches, "
                         "comma-separated (e.g. 1024,4096)")
    return budgets


def url_fetch_pattern(entry: str) -> str:
    """An ``--allow-url-fetch`` entry as an allowlist pattern: the port is a glob, any when left out."""
    host, sep, port = entry.rpartition(":")
    has_port = sep and port and not host.endswith(":") and (not host.startswith("[") or host.endswith("]"))
    return entry if has_port else f"{entry}:*"


def _device_defaults(device: str, workers: int = 1) -> dict[str, int]:
    """A GPU encodes ~70 1008x1008 images/s: decoding them needs several threads (more with more
    GPUs), and 1 GiB would hold only ~110 of their embeddings. The CPU keeps small numbers."""
    if device == "cpu":
        return {"cache_bytes": 1 * GiB, "preprocess_threads": 2, "video_decode_processes": 3, "grpc_processes": 0}
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 64 * GiB
    cores = os.cpu_count() or 2
    return {"cache_bytes": int(min(16 * GiB, ram // 4)),
            "preprocess_threads": max(2, min(8 * workers, cores - 2)),
            "video_decode_processes": max(3, min(16 * workers, cores // 2)),
            # Streamed responses: one process copies and sends ~100-140 1008x1008 embeddings a second,
            # less than two GPUs make (bench/RESULTS.md): with several, relays stream them.
            "grpc_processes": min(2 * workers, cores // 4) if workers > 1 else 0}


def device_entries(devices: str) -> list[str]:
    """The entries of ``--devices``, stripped, empty ones left out."""
    return [e.strip() for e in devices.split(",") if e.strip()]


def check_devices(devices: str) -> list[str]:
    """What is wrong with a ``--devices`` value (empty: nothing). The one place these rules live:
    start-up checks the flag with it, and the engine each list it starts workers for."""
    if not devices.strip() or devices.strip() == "all":
        return []
    entries = [e.strip() for e in devices.split(",")]
    bad = [e for e in entries if e != "cpu" and not e.removeprefix("cuda:").isdigit()]
    if bad:
        return [f"devices: {', '.join(map(repr, bad))} is neither cpu nor a GPU index (0, 1 or cuda:1)"]
    gpus = [e.removeprefix("cuda:") for e in entries if e != "cpu"]
    if len(set(gpus)) != len(gpus):
        return [f"devices {devices!r} names a GPU twice"]
    if gpus and len(gpus) != len(entries):
        return [f"devices {devices!r} mixes cpu and GPU workers: one node computes one kind of embedding"]
    return []
