"""The client installs and imports without torch: a decode server must be able to use it as is."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata


def test_importing_the_client_does_not_import_torch() -> None:
    code = (
        "import sys, encoder_client, encoder_client.client, encoder_client.aio, encoder_client.cli, "
        "encoder_client.testing, encoder_client.protocol; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'encoder_service')); "
        "print(','.join(bad)); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"importing encoder_client imported: {proc.stdout.strip()} {proc.stderr}"


def test_the_distribution_depends_only_on_grpc_protobuf_numpy_ml_dtypes() -> None:
    # grpcio-health-checking is grpc's own generated grpc.health.v1 code: grpcio and protobuf only;
    # ml_dtypes is numpy's bfloat16 (numpy only), the dtype bf16 embeddings are returned in.
    requires = metadata.requires("encoder-client") or []
    names = {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in requires if "extra ==" not in r}
    assert names == {"grpcio", "grpcio-health-checking", "protobuf", "numpy", "ml_dtypes"}
