"""Generates the Python protobuf/gRPC code into client/encoder_client/_proto.

    python scripts/gen_protos.py            # writes the generated files
    python scripts/gen_protos.py --out DIR  # writes them elsewhere (the staleness test uses this)

The proto is compiled under the import path ``encoder_client/_proto/...`` so the generated modules
import each other as ``encoder_client._proto.encoder.v1``; the wire package stays ``encoder.v1``.
That package is private: everyone imports the stubs from ``encoder_client.protocol``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO = ROOT / "protos" / "encoder" / "v1" / "encoder.proto"
DEFAULT_OUT = ROOT / "client" / "encoder_client" / "_proto"
GENERATED = ("encoder_pb2.py", "encoder_pb2.pyi", "encoder_pb2_grpc.py")


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "src" / "encoder_client" / "_proto" / "encoder" / "v1"
        staged.mkdir(parents=True)
        shutil.copy(PROTO, staged / "encoder.proto")
        gen = Path(tmp) / "gen"
        gen.mkdir()
        rel = "encoder_client/_proto/encoder/v1/encoder.proto"
        args = ["protoc", f"-I{Path(tmp) / 'src'}", f"--python_out={gen}", f"--pyi_out={gen}",
                f"--grpc_python_out={gen}", rel]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        target = out / "encoder" / "v1"
        target.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED:
            src = gen / "encoder_client" / "_proto" / "encoder" / "v1" / name
            shutil.copy(src, target / name)
            written.append(target / name)
    for pkg in (out, out / "encoder", out / "encoder" / "v1"):
        init = pkg / "__init__.py"
        if not init.exists():
            init.write_text("")
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
