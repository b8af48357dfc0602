"""``encoder-service``: ``serve`` runs the gRPC server; ``bench {forward,service,video,reliability,profile}`` runs a
benchmark (encoder_service/benchmarks); ``make-checkpoint`` writes a preset's random-weight checkpoint (transformers
format) for trying the loader out."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from .config import ENV_PREFIX
from .config_flags import add_serve_arguments, build_config

# Each benchmark parses its own options (encoder_service/benchmarks/<name>.py, main(argv)); its module is
# imported only when it runs: forward imports torch at the top, and --help of the rest must not wait for it.
BENCHMARKS = {
    "forward": "the ViT's throughput on a GPU against transformers' reference, same random weights",
    "service": "the whole service as users run it: a real server process, client processes, photo-like JPEGs",
    "video": "clips, then images of the same token size, through one real server from client processes",
    "reliability": "the reliability scenarios of tests/reliability run for long (a soak), one table of checks",
    "profile": "where a tower's forward goes, by op class (torch.profiler's kernels: GEMM, attention, norms, ...)",
}
# Where a benchmark's main lives when it is not encoder_service/benchmarks/<name>.py.
_MODULES = {"reliability": ".benchmarks.reliability.soak", "profile": ".benchmarks.op_profile"}


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
    bench = sub.add_parser(
        "bench", help="benchmarks: " + ", ".join(BENCHMARKS) + " (encoder-service bench BENCHMARK --help)",
        description="Benchmarks; each takes its own options (encoder-service bench BENCHMARK --help).",
        epilog="The spellings before these subcommands still run, with a notice, until the next release: "
               "'bench --service' (now 'bench service'), 'bench --service --video' ('bench video'), and 'bench' "
               "followed by the forward benchmark's options ('bench forward').")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, summary in BENCHMARKS.items():
        benchmarks.add_parser(name, add_help=False, help=summary)
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


def _run_benchmark(name: str, argv: list[str]) -> int:
    if name == "video":  # the service bench's parser and server, then video.py's run
        from .benchmarks.service import main as service_main

        return service_main(argv, video=True)
    return importlib.import_module(_MODULES.get(name, f".benchmarks.{name}"), __package__).main(argv)


def _old_bench_spelling(argv: list[str]) -> tuple[str, list[str]] | None:
    """(the benchmark, its arguments) for what follows ``bench`` in a spelling from before the
    subcommands, or None where it is a subcommand or asks for bench's own help."""
    if argv[:1] == ["--service"]:
        rest = argv[1:]
        own = rest.index("--") if "--" in rest else len(rest)  # after "--": the server's flags, left alone
        if "--video" not in rest[:own]:
            return "service", rest
        return "video", [a for a in rest[:own] if a != "--video"] + rest[own:]
    if argv[:1] and (argv[0] in BENCHMARKS or argv[0] in ("-h", "--help")):
        return None
    return "forward", argv


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        old = _old_bench_spelling(argv[1:])
        if old is not None:
            # Scripts written before the subcommands keep running for one release.
            print(f"encoder-service: this spelling of bench is deprecated and goes in the next release; "
                  f"use: encoder-service bench {old[0]} ...", file=sys.stderr, flush=True)
            return _run_benchmark(*old)
        if argv[1] in BENCHMARKS:
            return _run_benchmark(argv[1], argv[2:])
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
    if config.placement.kind == "cuda":  # this process's GPU, or its workers' (--devices)
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
