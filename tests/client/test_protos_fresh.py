"""The committed generated protobuf code matches what scripts/gen_protos.py makes from the .proto."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "client" / "encoder_client" / "_proto"


def _load_gen_protos():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_generated_protos_are_fresh(tmp_path: Path) -> None:
    gen_protos = _load_gen_protos()
    written = gen_protos.generate(tmp_path)
    assert {p.name for p in written} == set(gen_protos.GENERATED)
    for fresh in written:
        rel = fresh.relative_to(tmp_path)
        committed = COMMITTED / rel
        assert committed.exists(), f"{committed} is missing: run `python scripts/gen_protos.py`"
        assert committed.read_bytes() == fresh.read_bytes(), (
            f"{committed.relative_to(ROOT)} is stale against protos/encoder/v1/encoder.proto: "
            "run `python scripts/gen_protos.py` and commit the result"
        )
