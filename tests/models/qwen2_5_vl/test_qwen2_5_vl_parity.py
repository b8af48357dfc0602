"""Our Qwen2.5-VL vision tower against transformers' reference, same random weights (float32, CPU)."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

from encoder_service.attention.registry import BACKENDS, backend_class
from encoder_service.models import load_vision_model, make_checkpoint

BATCHES = {
    "one_image": [[1, 8, 8]],
    "several_sizes": [[1, 16, 16], [1, 4, 6], [1, 12, 20]],
    "non_square": [[1, 6, 30]],
    "sides_not_multiple_of_window": [[1, 10, 14], [1, 18, 6]],  # 140x196 px and 252x84 px
    "two_frame_video": [[2, 12, 8]],
    "smallest_legal_image": [[1, 2, 2]],
    "mixed_video_and_images": [[1, 2, 2], [3, 8, 10], [1, 16, 4]],
}

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("tiny-qwen2.5-vl", tmp_path_factory.mktemp("ckpt"), seed=3)


@pytest.fixture(scope="module")
def reference(checkpoint):
    vision_cfg = json.loads((checkpoint / "config.json").read_text())["vision_config"]
    cfg = Qwen2_5_VLVisionConfig(**vision_cfg)
    cfg._attn_implementation = "sdpa"
    model = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg).eval()
    state = load_file(str(checkpoint / "model.safetensors"))
    missing, unexpected = model.load_state_dict(
        {k.removeprefix("model.visual."): v for k, v in state.items()}, strict=True)
    assert not missing and not unexpected
    return model


def _available_backends():
    """Every registered backend that can run on this machine's CPU in float32."""
    return [name for name in BACKENDS
            if backend_class(name).unsupported_reason(torch.device("cpu"), torch.float32, 16) is None]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("backend", _available_backends())
@pytest.mark.parametrize("batch", list(BATCHES))
def test_embeddings_equal_transformers(checkpoint, reference, batch, backend):
    # The one block implementation (RMSNorms folded into the GEMMs, biases deferred, residual adds
    # inside the output GEMMs: models/qwen2_5_vl/folded.py), the one a GPU runs too, with the plain
    # torch providers of its fused operations: the same function as the reference, up to float32
    # rounding (relative error at most 1e-5).
    grids = BATCHES[batch]
    model = load_vision_model(checkpoint, attn_backend=backend)
    assert model.ops.describe() == "window_attention=torch,rms_scale=torch,gated_mlp=torch"
    n = sum(t * h * w for t, h, w in grids)
    pixels = torch.from_numpy(np.random.default_rng(len(grids) + n).standard_normal((n, model.patch_dim),
                                                                                      dtype=np.float32))
    ours = model.encode(pixels, grids)

    with torch.no_grad():
        ref = reference(pixels, grid_thw=torch.tensor(grids)).pooler_output
    ref_split = ref.split([t * h * w // 4 for t, h, w in grids])
    assert len(ours) == len(grids)
    for i, (a, b) in enumerate(zip(ours, ref_split)):
        assert a.shape == b.shape == (grids[i][0] * grids[i][1] * grids[i][2] // 4, 48)
        assert rel_err(a, b) <= 1e-5, f"image {i}: relative error {rel_err(a, b):.2e}"


def test_each_image_is_encoded_as_if_alone(checkpoint):
    # Batching must not leak attention across images: the same image alone or among others.
    model = load_vision_model(checkpoint)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((1 * 8 * 12, model.patch_dim), dtype=np.float32)
    b = rng.standard_normal((2 * 4 * 4, model.patch_dim), dtype=np.float32)
    alone = model.encode(a, [[1, 8, 12]])[0]
    together = model.encode(np.concatenate([b, a]), [[2, 4, 4], [1, 8, 12]])[1]
    assert rel_err(together, alone) <= 1e-6


def test_a_backend_taking_padded_head_dims_equals_transformers(checkpoint, reference):
    # A backend with padded_head_dim (FlashInfer FA3 on Hopper) gets q, k, v zero-padded by the
    # model's rotary graph and hands back a padded output, which the padded output projection reads.
    import torch.nn.functional as F

    from encoder_service.attention.sdpa import SDPABackend

    class PaddedSDPA(SDPABackend):
        def forward_ragged(self, q, k, v, prepared):
            assert q.shape[-1] == self.padded_head_dim
            out = torch.empty_like(q)
            for start, end in prepared:
                qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
                out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, scale=self.scale).squeeze(0).transpose(0, 1)
            return out

    grids = BATCHES["mixed_video_and_images"]
    model = load_vision_model(checkpoint)
    model.backend = PaddedSDPA(model.cfg.num_heads, model.cfg.head_dim, torch.device("cpu"), torch.float32)
    model.backend.padded_head_dim = model.cfg.head_dim + 8
    n = sum(t * h * w for t, h, w in grids)
    pixels = torch.from_numpy(np.random.default_rng(n).standard_normal((n, model.patch_dim), dtype=np.float32))
    ours = torch.cat(model.encode(pixels, grids))
    with torch.no_grad():
        ref = reference(pixels, grid_thw=torch.tensor(grids)).pooler_output
    assert rel_err(ours, ref) <= 1e-5, f"relative error {rel_err(ours, ref):.2e}"
