"""Imported by a video decode process before it says it is ready (``VideoDecodePool(preload=...)``): NVDEC in
that process is nvdec_stand_in's stand-in, on a "GPU" that a clip can break (tests/video/test_nvdec_sessions.py).
NVDEC_STAND_IN_BREAK_AFTER_S and NVDEC_STAND_IN_BROKEN_STOP_S set its delays (StandInDecoder)."""

import contextlib
import os
import sys

import nvdec_stand_in
import torch

from encoder_service.preprocess import video_nvdec

sys.modules["PyNvVideoCodec"] = nvdec_stand_in.MODULE
torch.cuda.device = lambda gpu: contextlib.nullcontext()
video_nvdec._device_works = nvdec_stand_in.device_works
nvdec_stand_in.StandInDecoder.break_after_s = float(os.environ.get("NVDEC_STAND_IN_BREAK_AFTER_S", "0"))
nvdec_stand_in.StandInDecoder.broken_stop_s = float(os.environ.get("NVDEC_STAND_IN_BROKEN_STOP_S", "0"))
