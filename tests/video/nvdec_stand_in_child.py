"""Imported by a video decode process before it says it is ready (``VideoDecodePool(preload=...)``): NVDEC in
that process is nvdec_stand_in's stand-in, on a "GPU" that a clip can break (tests/video/test_nvdec_sessions.py)."""

import contextlib
import sys

import nvdec_stand_in
import torch

from encoder_service.preprocess import video_nvdec

sys.modules["PyNvVideoCodec"] = nvdec_stand_in.MODULE
torch.cuda.device = lambda gpu: contextlib.nullcontext()
video_nvdec._device_works = nvdec_stand_in.device_works
