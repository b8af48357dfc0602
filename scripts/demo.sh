#!/usr/bin/env bash
# The quick start: sets up .venv, starts the server on the CPU with the tiny random preset, encodes
# a few generated sample images twice through the client (the second pass is all cache hits), and
# stops the server.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh

work=$(mktemp -d)
port=${PORT:-50151}
cleanup() { [ -n "${server_pid:-}" ] && kill -TERM "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

python - "$work" <<'PY'
import sys
import numpy as np
from PIL import Image
rng = np.random.default_rng(0)
for i, (w, h) in enumerate([(640, 480), (320, 320), (200, 600)]):
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(f"{sys.argv[1]}/sample{i}.jpg")
PY

echo "starting encoder-service on 127.0.0.1:$port (tiny random Qwen2.5-VL preset, CPU)..."
encoder-service serve --host 127.0.0.1 --port "$port" > "$work/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 1 120); do
  if encoder-client health --target "127.0.0.1:$port" >/dev/null 2>&1; then break; fi
  if ! kill -0 "$server_pid" 2>/dev/null; then cat "$work/server.log"; exit 1; fi
  sleep 0.5
done
encoder-client health --target "127.0.0.1:$port"
encoder-client encode --target "127.0.0.1:$port" --repeat 2 "$work"/sample*.jpg
echo "second pass: every image a cache hit, no forward run."
