"""GPU checks of the serving path (pytest -m gpu on the GPU machine, which has torchvision and
transformers): the ``torch`` preprocessing mode equals transformers' default torchvision-backed
processors on the CPU and on CUDA; preprocessing on the device keeps the forward free of host
syncs; embeddings through a real server equal a direct encode of transformers' pixels."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from gpu_helpers import no_device_sync
from PIL import Image

from encoder_service.models import PRESETS, load_vision_model
from encoder_service.preprocess.staged import RawPatches

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.allow_skip_on_cpu("needs a CUDA GPU, and torchvision for transformers' processors")]

SIZES = [(1008, 1008), (61, 97), (1080, 1920), (333, 500), (2000, 37)]


def _photo(height: int, width: int, seed: int = 0, fmt: str = "JPEG") -> bytes:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 / width, yy * 255 / height, (xx * yy) % 255], axis=-1)
    pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt, quality=90)
    return buffer.getvalue()


def _transformers_qwen(data: bytes, device: str):
    """transformers' default processor with the tiny preset's preprocessor config."""
    pytest.importorskip("torchvision")
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    config = PRESETS["tiny-qwen2.5-vl"].preprocessor_config
    out = Qwen2VLImageProcessor(**config)(Image.open(io.BytesIO(data)), return_tensors="pt", device=device)
    return out["pixel_values"], [int(v) for v in out["image_grid_thw"][0]]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torch_mode_equals_transformers_default_qwen_processor(size, device):
    # Tolerance held: exact. The resize is the same torch op on the same device (uint8 kernel on the
    # CPU; float32, clamp, round elsewhere), the normalisation a table of the same float32
    # operations, the patch order a permutation: no step may round differently.
    data = _photo(*size, seed=size[0])
    ref, ref_grid = _transformers_qwen(data, device)
    model = load_vision_model("tiny-qwen2.5-vl", device=device, preprocess="torch")
    item = model.decode(data)
    ours = model.pixel_values([item], dtype=torch.float32)
    assert list(item.grid) == ref_grid
    diff = (ours - ref.to(ours.device)).abs().max().item()
    print(f"torch mode vs transformers, {device}, {size}: max abs diff {diff}")
    assert diff == 0.0


@pytest.mark.parametrize("size", [(90, 130), (1200, 1700), (33, 2000)])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torch_mode_equals_transformers_kimi_processor(size, device):
    pytest.importorskip("torchvision")
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor

    data = _photo(*size, seed=7, fmt="PNG")
    out = Kimi_K25ImageProcessor()(Image.open(io.BytesIO(data)), return_tensors="pt", device=device)
    model = load_vision_model("tiny-kimi-k2.5", device=device, preprocess="torch")
    model.preprocess_config = type(model.preprocess_config)()  # the processor's defaults, as above
    model.set_preprocess_mode("torch")
    item = model.decode(data)
    ours = model.pixel_values([item], dtype=torch.float32)
    assert [list(item.grid)] == out["image_grid_thw"].tolist()
    ref = out["pixel_values"].reshape(ours.shape).to(ours.device)
    diff = (ours - ref).abs().max().item()
    print(f"kimi torch mode vs transformers, {device}, {size}: max abs diff {diff}")
    assert diff == 0.0


@pytest.mark.parametrize("preset", ["tiny-qwen2.5-vl", "tiny-kimi-k2.5"])
@pytest.mark.parametrize("mode", ["torch", "pil"])
def test_forward_with_device_preprocessing_has_no_host_sync(preset, mode):
    model = load_vision_model(preset, device="cuda", dtype=torch.bfloat16, preprocess=mode)
    inputs = [model.decode(_photo(h, w, seed=h)) for h, w in [(300, 200), (120, 500)]]
    g = inputs[0].grid
    raw = np.random.default_rng(0).standard_normal((g[0] * g[1] * g[2], model.patch_dim)).astype(np.float16)
    inputs.append(RawPatches(raw.tobytes(), "float16", g))
    model.encode_inputs_async(inputs).wait()  # warm: first calls compile and plan
    with no_device_sync():
        pending = model.encode_inputs_async(inputs)
    out = pending.wait()  # the batch's one explicit wait
    assert [e.shape[0] for e in out] == [model.num_tokens(i.grid) for i in inputs]
    assert 0 < pending.device_preprocess_seconds() < pending.device_seconds()  # a part of the batch's time


def test_embeddings_through_the_service_equal_direct_encode_of_transformers_pixels(start_encoder_server):
    from encoder_client import EncoderClient

    server = start_encoder_server("--device", "cuda", "--dtype", "bfloat16")
    images = [_photo(h, w, seed=h) for h, w in [(1008, 1008), (333, 500), (61, 97)]]
    with EncoderClient(server.target) as client:
        info = client.model_info()
        assert info.preprocess == "torch"
        results = client.encode(images, output_dtype="float32")
    model = load_vision_model("tiny-qwen2.5-vl", device="cuda", dtype=torch.bfloat16)
    for data, r in zip(images, results):
        pixels, grid = _transformers_qwen(data, "cuda")
        assert list(r.grid_thw) == grid
        ref = model.encode(pixels.to(model.dtype), [grid])[0].float().cpu()
        got = torch.from_numpy(np.asarray(r.embedding))
        rel = ((got - ref).norm() / ref.norm()).item()
        print(f"service vs direct encode of transformers' pixels: rel err {rel:.2e}")
        assert rel < 1e-2  # bf16: batch composition changes the GEMM tiling, not the inputs
