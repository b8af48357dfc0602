"""``encoder-client``: encode files, show the model, look up hashes, check health; run the EPD proxy."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from encoder_client.client import EncoderClient
from encoder_client.dtypes import BF16_AS, BFLOAT16, DEFAULT_BF16_AS
from encoder_client.errors import EncoderClientError
from encoder_client.protocol import OUTPUT_DTYPES
from encoder_client.routing import RoutingEncoderClient
from encoder_client.security import read_token_file, tls_credentials
from encoder_client.types import SAMPLING_REFERENCES, EncodedImage, Video

ENV_PREFIX = "ENCODER_CLIENT_"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows])
    return "\n".join(line.rstrip() for line in lines)


# A file with one of these suffixes is sent as a clip (Video), any other as an image.
VIDEO_SUFFIXES = (".mp4", ".m4v", ".webm", ".mkv", ".mov", ".avi")


def _input(path: Path, args: argparse.Namespace) -> bytes | Video:
    data = path.read_bytes()
    if path.suffix.lower() not in VIDEO_SUFFIXES:
        return data
    return Video(data, fps=args.fps, num_frames=args.num_frames, min_frames=args.min_frames,
                 max_frames=args.max_frames, min_pixels=args.min_pixels, max_pixels=args.max_pixels,
                 reference=args.video_reference, all_frames=args.all_frames,
                 cap_pixels_per_frame=_on_off(args.cap_pixels_per_frame), processor_fps=args.processor_fps,
                 processor_num_frames=args.processor_num_frames,
                 processor_do_sample_frames=_on_off(args.processor_do_sample_frames))


def _on_off(value: str | None) -> bool | None:
    """An on|off flag's value: None where it is not given (the model's or vLLM's own)."""
    return None if value is None else value == "on"


def _encode(args: argparse.Namespace, client: EncoderClient | RoutingEncoderClient) -> int:
    output_dtype = None if args.dtype == "model" else args.dtype
    # Read once: --repeat measures the service (cache hits on repeats), not the disk.
    images = [_input(Path(f), args) for f in args.files]
    runs: list[list[EncodedImage]] = []
    kwargs = {} if isinstance(client, RoutingEncoderClient) else {"hash_first": args.hash_first}
    for _ in range(args.repeat):
        runs.append(client.encode(images, output_dtype=output_dtype, bf16_as=args.bf16_as, **kwargs))
    results = runs[-1]
    # A "levels" column only for models with extra feature levels (deepstack): others print as before.
    levels = any(r.feature_levels > 1 for r in results)
    header = ["image", "tokens", "hidden", *(["levels"] if levels else []), "hash", "cache hit", "ms"]
    frames = any(r.frame_indices for r in results)  # a "frames" column only when clips were sent
    if frames:
        header.append("frames")
    if args.repeat > 1:
        header = ["run", *header]
    rows: list[list[str]] = []
    for run, run_results in enumerate(runs):
        for name, r in zip(args.files, run_results, strict=True):
            row = [name, str(r.num_tokens), str(r.hidden_size), *([str(r.feature_levels)] if levels else []),
                   r.content_hash[:12], "yes" if r.cache_hit else "no", f"{r.latency_ms:.1f}"]
            if frames:
                row.append(_frames(r.frame_indices))
            rows.append([str(run + 1), *row] if args.repeat > 1 else row)
    print(_table(rows, header))
    if args.out is not None:
        arrays = {f"image_{r.index}": _savable(r.embedding) for r in results}
        arrays.update({f"image_{r.index}_deepstack_{k}": _savable(level)
                       for r in results for k, level in enumerate(r.deepstack)})
        # Fixed-width unicode, not object arrays, so np.load works without allow_pickle.
        arrays.update({f"image_{r.index}_frame_indices": np.array(r.frame_indices, dtype=np.int64)
                       for r in results if r.frame_indices})
        arrays["hashes"] = np.array([r.content_hash for r in results], dtype=str)
        np.savez(args.out, **arrays)
        print(f"wrote {args.out}")
    return 0


def _savable(array: np.ndarray) -> np.ndarray:
    """What --out writes: bf16 (ml_dtypes.bfloat16) widened to float32, exactly, because .npy has no
    bfloat16 (it would read back as 2-byte voids); every other dtype as it is."""
    return array.astype(np.float32) if array.dtype == BFLOAT16 else array


def _frames(indices: tuple[int, ...]) -> str:
    shown = ",".join(map(str, indices[:8]))
    return f"{len(indices)}: {shown}{',...' if len(indices) > 8 else ''}"


def _info(args: argparse.Namespace, client: EncoderClient) -> int:
    for key, value in asdict(client.model_info()).items():
        print(f"{key}: {value}")
    return 0


def _lookup(args: argparse.Namespace, client: EncoderClient) -> int:
    for content_hash, cached in zip(args.hashes, client.lookup(args.hashes), strict=True):
        print(f"{content_hash}  {'cached' if cached else 'not cached'}")
    return 0


def _health(args: argparse.Namespace, client: EncoderClient) -> int:
    status = client.health(args.service)
    print(status)
    return 0 if status == "SERVING" else 1


def _env(name: str) -> str | None:
    return os.environ.get(ENV_PREFIX + name) or None


def _security(args: argparse.Namespace) -> dict:
    """credentials / token keyword arguments of the clients from the --tls-* and --token-file flags."""
    kwargs: dict = {}
    if args.tls_ca or args.tls_cert or args.tls_key:
        if bool(args.tls_cert) != bool(args.tls_key):
            raise ValueError("--tls-cert and --tls-key go together: give both (mutual TLS) or neither")
        kwargs["credentials"] = tls_credentials(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key)
    if args.token_file:
        kwargs["token"] = read_token_file(args.token_file)
    return kwargs


def _add_security(p: argparse.ArgumentParser) -> None:
    tls = p.add_argument_group("security (each flag falls back to an environment variable: "
                               "ENCODER_CLIENT_TLS_CA, ..._TLS_CERT, ..._TLS_KEY, ..._TOKEN_FILE)")
    tls.add_argument("--tls-ca", default=_env("TLS_CA"),
                     help="PEM CA bundle the server's certificate must chain to; TLS is on when any --tls-* "
                          "flag is given (without --tls-ca: the system's root CAs)")
    tls.add_argument("--tls-cert", default=_env("TLS_CERT"),
                     help="PEM client certificate, for a server that requires mutual TLS (with --tls-key)")
    tls.add_argument("--tls-key", default=_env("TLS_KEY"), help="PEM private key of --tls-cert")
    tls.add_argument("--token-file", default=_env("TOKEN_FILE"),
                     help="file whose first token line (# comments skipped) is the bearer token sent as "
                          "'authorization: Bearer ...' (a file, not a flag value: command lines are visible "
                          "to other users)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="encoder-client", description="Client of the encoder-service vision encoder.")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--target", required=True,
                       help="HOST:PORT of the encoder service (encode also takes several, comma-separated, "
                            "or dns:///NAME:PORT: images are then routed by content hash)")
        p.add_argument("--timeout", type=float, default=60.0, help="deadline per call, seconds (default 60)")
        p.add_argument("--retries", type=int, default=3, help="retries on UNAVAILABLE (default 3, at most 4)")
        _add_security(p)
        return p

    p = add("encode", "encode image and video files and print one row per file")
    p.add_argument("files", nargs="+", metavar="FILE",
                   help=f"images, or clips (a file ending {', '.join(VIDEO_SUFFIXES)}: sampled by the server)")
    p.add_argument("--fps", type=float, default=None, help="clips: frames to sample per second (default: the model's)")
    p.add_argument("--num-frames", type=int, default=None, help="clips: frames to sample in all (instead of --fps)")
    p.add_argument("--min-frames", type=int, default=None, help="clips: fewest frames fps sampling keeps")
    p.add_argument("--max-frames", type=int, default=None, help="clips: most frames fps sampling keeps")
    p.add_argument("--min-pixels", type=int, default=None,
                   help="clips: the processor's lower pixel bound (per frame or per clip, as the model means it)")
    p.add_argument("--max-pixels", type=int, default=None, help="clips: the processor's upper pixel bound")
    p.add_argument("--all-frames", action="store_true",
                   help="clips: every frame, none sampled (transformers' do_sample_frames=False; with none of "
                        "the four above)")
    p.add_argument("--cap-pixels-per-frame", choices=["on", "off"], default=None,
                   help="clips: the processor's per-frame pixel cap (default: the model's setting)")
    p.add_argument("--processor-fps", type=float, default=None,
                   help="clips, --video-reference vllm: vLLM's processor-level fps (a request's "
                        "mm_processor_kwargs fps; the settings above are its loader's)")
    p.add_argument("--processor-num-frames", type=int, default=None,
                   help="clips, --video-reference vllm: vLLM's processor-level frame count (mm_processor_kwargs)")
    p.add_argument("--processor-do-sample-frames", choices=["on", "off"], default=None,
                   help="clips, --video-reference vllm: whether vLLM's processor samples again (mm_processor_kwargs' "
                        "do_sample_frames; default: what vLLM sets)")
    p.add_argument("--video-reference", choices=SAMPLING_REFERENCES, default=SAMPLING_REFERENCES[0],
                   help=f"clips: whose frame sampling to equal (default {SAMPLING_REFERENCES[0]}; vllm for an encoder "
                        "feeding vLLM)")
    p.add_argument("--dtype", choices=["model", *OUTPUT_DTYPES], default="model",
                   help="output dtype (default: the model's)")
    p.add_argument("--bf16-as", choices=list(BF16_AS), default=DEFAULT_BF16_AS,
                   help="how bf16 embeddings are returned (default bfloat16: as they came); --out saves "
                        "bfloat16 and float32 as float32 (exact), uint16 as the raw bit patterns")
    p.add_argument("--repeat", type=int, default=1,
                   help="send the same request N times (cache hits after the first)")
    p.add_argument("--out", type=Path, help="write an .npz: image_0, image_1, ... and hashes (and "
                                            "image_0_deepstack_0, ... for a model with extra feature levels)")
    p.add_argument("--hash-first", action="store_true",
                   help="ask Lookup first and send pixels only for images the server does not cache "
                        "(always on with several targets)")
    p.set_defaults(run=_encode)
    p = add("info", "print the server's ModelInfo")
    p.set_defaults(run=_info)
    p = add("lookup", "which content hashes the server caches")
    p.add_argument("hashes", nargs="+", metavar="HASH")
    p.set_defaults(run=_lookup)
    p = add("health", "grpc.health.v1 check; exit 0 only when SERVING")
    p.add_argument("--service", default="", help="service name to check (default: the server as a whole)")
    p.set_defaults(run=_health)
    _add_proxy(sub)
    return parser


def _add_proxy(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("proxy", help="OpenAI-compatible HTTP proxy before vLLM: has the encoder encode each image "
                                     "and clip, gives vLLM its content hash as the part's uuid "
                                     "(needs the 'proxy' extra)")
    p.add_argument("--encoder", required=True,
                   help="HOST:PORT of the encoder service; several comma-separated, or dns:///NAME:PORT "
                        "(images are then routed by content hash)")
    p.add_argument("--vllm", required=True, help="base URL of the vLLM server, e.g. http://vllm-0:8000")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port to listen on (default 8000)")
    p.add_argument("--allowed-hosts", default="",
                   help="comma-separated hosts whose http(s) image and clip URLs the proxy may fetch (cdn.example.com, "
                        "*.example.com, 10.0.0.*, or * for any); default none: only data: URLs")
    p.add_argument("--mm-kwargs", choices=["refuse", "strip"], default="refuse",
                   help="requests carrying mm_processor_kwargs or media_io_kwargs break the uuid contract: refuse "
                        "them with a 400 (default) or strip those keys and forward the rest")
    p.add_argument("--encode-mode", choices=["cache", "full"], default="cache",
                   help="cache (default): the encoder encodes and caches each image and returns its header "
                        "only; full: it streams each embedding back, which the proxy drops")
    p.add_argument("--max-image-bytes", type=int, default=32 << 20, help="largest image, bytes (default 32 MiB)")
    p.add_argument("--max-video-bytes", type=int, default=64 << 20,
                   help="largest clip of a video_url part, bytes (default 64 MiB, the encoder's own default)")
    p.add_argument("--video-fps", type=float, default=2.0,
                   help="fps at which each video_url clip is sampled for the encoder (Video(reference='vllm')); "
                        "MUST equal the fps vLLM samples clips at: the part's uuid is the content hash of the "
                        "clip sampled so, and vLLM counts placeholders for its own frames. With the connector "
                        "that is vLLM's default, 2.0 (vllm serve --media-io-kwargs would change it, but vLLM "
                        "then hashes every uuid with it)")
    p.add_argument("--max-request-bytes", type=int, default=128 << 20,
                   help="largest request body, bytes (default 128 MiB)")
    p.add_argument("--timeout", type=float, default=60.0, help="deadline of each encoder call, seconds (default 60)")
    p.add_argument("--fetch-timeout", type=float, default=10.0,
                   help="deadline of fetching one image URL, seconds (default 10)")
    _add_security(p)
    p.set_defaults(run=_proxy)


def _proxy(args: argparse.Namespace, security: dict) -> int:
    try:
        from encoder_client.integrations import proxy
    except ImportError as err:  # aiohttp is the 'proxy' extra
        raise ValueError(f"encoder-client proxy needs aiohttp: pip install 'encoder-client[proxy]' ({err})") from None
    return proxy.run(args, security)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "repeat", 1) < 1:
        print("encoder-client: error: --repeat must be >= 1", file=sys.stderr)
        return 2
    try:
        security = _security(args)
        if args.command == "proxy":
            return args.run(args, security)
        if args.command == "encode" and ("," in args.target or args.target.startswith("dns:")):
            # A one-shot command would rather wait a few seconds for a busy encoder's health answer
            # than route around it (refused connections still fail at once).
            with RoutingEncoderClient(args.target, timeout_s=args.timeout,
                                      health_timeout_s=min(5.0, args.timeout), **security) as routing:
                return args.run(args, routing)
        with EncoderClient(args.target, timeout_s=args.timeout, retries=args.retries, **security) as client:
            return args.run(args, client)
    except EncoderClientError as err:
        message = f"{err.code.name}: {err.details}"
    except (OSError, ValueError, TypeError) as err:
        message = str(err)
    # One line, whatever the server's message held, so scripts can log it as is.
    print(f"encoder-client: error: {' '.join(message.split())}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
