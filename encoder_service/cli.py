"""``encoder-service``: ``serve`` runs the gRPC server; ``make-checkpoint`` writes a preset's
random-weight checkpoint (transformers format) for trying the loader out."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from .config import ENV_PREFIX
from .config_flags import add_serve_arguments, build_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="encoder-service",
        description="Vision-encoder microservice for EPD (encode/prefill/decode) disaggregated serving.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser(
        "serve", help="run the gRPC server",
        description="Serve a vision tower over gRPC (encoder.v1.VisionEncoder, grpc.health.v1, reflection). "
                    f"Every option can also be set as an environment variable {ENV_PREFIX}<OPTION> "
                    f"(e.g. {ENV_PREFIX}CACHE_BYTES); a flag wins over the environment.")
    add_serve_arguments(serve)
    sub.add_parser("bench", add_help=False,
                   help="ViT throughput on a GPU against transformers (encoder-service bench --help); with --service "
                        "first, the whole service as users run it (encoder-service bench --service --help)")
    make = sub.add_parser("make-checkpoint", help="write a preset's random-weight checkpoint directory")
    make.add_argument("--preset", required=True, help="preset name, e.g. tiny-qwen2.5-vl or qwen2.5-vl-7b")
    make.add_argument("--out", required=True, help="output directory")
    make.add_argument("--seed", type=int, default=0, help="random seed of the weights (default 0)")
    make.add_argument("--layout", default=None,
                      help="tensor names as in one of the family's checkpoint layouts (Qwen2.5-VL: transformers, "
                           "original; Kimi-K2.5: original, transformers); default: the family's first")
    return parser


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "--service"]:
        from .benchmarks.service import main as service_main  # a real server process and clients

        return service_main(argv[2:])
    if argv[:1] == ["bench"]:
        from .benchmarks.forward import main as bench_main  # its own options; imports transformers only if asked

        return bench_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "make-checkpoint":
        _setup_logging("INFO")
        from .models.presets import make_checkpoint

        path = make_checkpoint(args.preset, args.out, seed=args.seed, layout=args.layout)
        print(path)
        return 0
    try:
        config = build_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    _setup_logging(config.log_level)
    from .api import serve  # imports grpc and the engine only when serving

    code = asyncio.run(serve(config))
    if config.device.startswith("cuda"):
        # Everything is stopped and drained. Interpreter teardown would only make the cuDNN
        # frontend's nanobind module print hundreds of "leaked instance" lines into the log (its
        # objects live in module-level caches); leave without it.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
