#!/usr/bin/env bash
# Video against images through the service on one and several GPUs of a node: for each device set, one
# `encoder-service bench video` run (a fresh server with --devices SET, 10 s 1280x720 P-frame clips,
# then 1288x728 JPEGs of one temporal slice's tokens, at CLIENTS_PER_GPU x GPUs clients), its JSON and
# its summary: clip tokens/s over image tokens/s, the server's and the front end's CPU, and the mean
# of each clip stage (encoder_service_video_stage_seconds) and of the queue per clip.
#
#   bash bench/video_scaling.sh OUT_DIR "0;0,1;0,1,2,3" [CLIENTS_PER_GPU (16)] [EXTRA SERVE FLAGS...]
#
# e.g. `bash bench/video_scaling.sh /tmp/out "0;0,1,2,3" 16 --video-decode nvdec`. Random bf16 weights of
# the 7B preset; the model is the same in every set, so only the GPUs and the flags change. MODEL, DEVICE,
# DTYPE, FRAME_SIZE and SECONDS_PER_LEVEL override the defaults (a CPU check: MODEL=tiny-qwen2.5-vl DEVICE=cpu
# DTYPE=float32 FRAME_SIZE=64x48 SECONDS_PER_LEVEL=2, sets "cpu").
set -euo pipefail
out=${1:?OUT_DIR}
sets=${2:?'device sets, e.g. "0;0,1"'}
per_gpu=${3:-16}
shift $(( $# < 3 ? $# : 3 ))
mkdir -p "$out"
IFS=';' read -ra device_sets <<< "$sets"
for devices in "${device_sets[@]}"; do
  gpus=$(( $(tr -cd ',' <<< "$devices" | wc -c) + 1 ))
  clients=$(( per_gpu * gpus ))
  name="video-devices-${devices//,/_}"
  echo "== --devices $devices: $clients clients $*" >&2
  set +e  # the bench's own exit code, not grep's, says whether this set ran
  python -m encoder_service bench video --model "${MODEL:-qwen2.5-vl-7b}" --device "${DEVICE:-cuda}" \
    --dtype "${DTYPE:-bfloat16}" --clip-seconds 10 --frame-sizes "${FRAME_SIZE:-1280x720}" \
    --concurrency "$clients" --seconds "${SECONDS_PER_LEVEL:-20}" \
    --client-procs "$(( clients < 16 ? clients : 16 ))" --label "$name" --out "$out/$name.json" \
    -- --devices "$devices" "$@" 2>&1 | tee "$out/$name.log" | grep -vE "^(generated|clips:|images:)"
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" -ne 0 ]; then echo "== --devices $devices: the bench failed (exit code $rc); $out/$name.log" >&2; failed=1; fi
done
exit "${failed:-0}"
