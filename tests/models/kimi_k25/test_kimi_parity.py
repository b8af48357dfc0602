"""Our Kimi-K2.5 vision tower + projector against transformers' kimi_k25 reference, same random
weights (float32, CPU, relative error <= 1e-5 per image), on every backend that runs on this CPU.

Where transformers' reference deviates from the original Kimi-K2.5 (moonshotai remote code,
``MoonViT3dPretrainedModel`` + ``tpool_patch_merger``), we follow the original:
- A batch that mixes clips of different frame counts cannot run through transformers up to 5.23:
  ``get_vision_temporal_merge_index`` concatenates per-clip index blocks of shape [tokens, t, 4]
  along dim 0, which fails when t differs (5.24 runs it; the test then compares that too). The
  original merges clip by clip, so does our tower;
  the reference for such a batch is transformers run on each clip alone (attention never crosses
  clips, so that is the same function).
Multi-frame clips on their own match transformers (frame f adds the sin-cos row f, frame 0
included, for t > 1; nothing for t == 1), which is also the original's rule.
"""

import json

import numpy as np
import pytest
import torch

from encoder_service.attention.registry import BACKENDS, backend_class
from encoder_service.models import load_vision_model, make_checkpoint
from encoder_service.models.kimi_k25.loading import original_to_split
from encoder_service.models.kimi_k25.model import KimiK25VisionConfig
from encoder_service.models.kimi_k25.reference import transformers_reference
from encoder_service.models.presets import PRESETS, random_vision_state

# tiny-kimi-k2.5: position table 8 x 8, 4 frames, head_dim 72.
BATCHES = {
    "one_image": [[1, 8, 12]],
    "several_sizes": [[1, 16, 16], [1, 4, 6], [1, 12, 20]],
    "non_square": [[1, 6, 30]],
    "table_size_no_resize": [[1, 8, 8]],
    "smaller_than_table": [[1, 2, 4]],
    "multi_frame": [[3, 6, 8]],
    "most_frames": [[4, 4, 6]],
    # The processor's largest grid for this preset (max_patches 1024) and the longest side the
    # rotary table of the original covers (512 patches): the extremes the table is resized to.
    "largest_processor_grid": [[1, 32, 32]],
    "longest_sides": [[1, 2, 512], [1, 512, 2]],
}
MIXED_FRAMES = [[1, 4, 4], [2, 6, 6], [1, 8, 10], [4, 2, 2]]
SEED = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("tiny-kimi-k2.5", tmp_path_factory.mktemp("kimi"), seed=SEED)


@pytest.fixture(scope="module")
def reference(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    cfg = KimiK25VisionConfig.from_config(config)
    tower, projector = transformers_reference(
        config, original_to_split(random_vision_state(PRESETS["tiny-kimi-k2.5"], SEED), cfg, prefix=""))

    def run(pixels: torch.Tensor, grids: list[list[int]]) -> list[torch.Tensor]:
        with torch.no_grad():
            pooled = tower(pixels.view(-1, 3, 14, 14), grid_thw=torch.tensor(grids)).pooler_output
            embeds = projector(pooled).squeeze(1)
        return list(embeds.split([h * w // 4 for _, h, w in grids]))

    return run


def _available_backends():
    return [name for name in BACKENDS
            if backend_class(name).unsupported_reason(torch.device("cpu"), torch.float32, 72) is None]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _pixels(grids, patch_dim=588):
    n = sum(t * h * w for t, h, w in grids)
    rng = np.random.default_rng(n + len(grids))
    return torch.from_numpy(rng.standard_normal((n, patch_dim), dtype=np.float32))


@pytest.fixture(scope="module", params=_available_backends())
def model(request, checkpoint):
    return load_vision_model(checkpoint, attn_backend=request.param)


@pytest.mark.parametrize("batch", list(BATCHES))
def test_embeddings_equal_transformers(model, reference, batch):
    grids = BATCHES[batch]
    pixels = _pixels(grids)
    ours = model.encode(pixels, grids)
    ref = reference(pixels, grids)
    assert len(ours) == len(grids)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.shape == b.shape == (grids[i][1] * grids[i][2] // 4, 64)
        assert rel_err(a, b) <= 1e-5, f"image {i}: relative error {rel_err(a, b):.2e}"


def test_mixed_frame_counts_equal_transformers_per_clip(model, reference):
    pixels = _pixels(MIXED_FRAMES)
    ours = model.encode(pixels, MIXED_FRAMES)
    try:
        whole = reference(pixels, MIXED_FRAMES)
    except RuntimeError:
        whole = None  # the transformers limitation the module docstring describes (up to 5.23)
    if whole is not None:  # a transformers that runs such a batch must agree with the clip-by-clip rule
        for i, (a, b) in enumerate(zip(ours, whole)):
            assert rel_err(a, b) <= 1e-5, f"clip {i} in the whole batch: relative error {rel_err(a, b):.2e}"
    offset = 0
    for i, grid in enumerate(MIXED_FRAMES):
        n = grid[0] * grid[1] * grid[2]
        ref = reference(pixels[offset:offset + n], [grid])[0]
        offset += n
        assert rel_err(ours[i], ref) <= 1e-5, f"clip {i}: relative error {rel_err(ours[i], ref):.2e}"


def test_processor_layout_4d_pixels_accepted(model):
    # transformers' processor returns [patches, 3, 14, 14]; the same patches flat give the same result.
    grids = [[1, 4, 6]]
    pixels = _pixels(grids)
    flat = model.encode(pixels, grids)[0]
    four_d = model.encode(pixels.view(-1, 3, 14, 14), grids)[0]
    assert torch.equal(flat, four_d)


def test_each_image_is_encoded_as_if_alone(model):
    a, b = _pixels([[1, 8, 12]]), _pixels([[2, 4, 4]])
    alone = model.encode(a, [[1, 8, 12]])[0]
    together = model.encode(torch.cat([b, a]), [[2, 4, 4], [1, 8, 12]])[1]
    assert rel_err(together, alone) <= 1e-6


def test_rotary_matters(model, reference):
    # Guards the parity test itself: transposing the image's rows and columns changes the output,
    # so a rotary that ignored position (or swapped h and w) could not pass it.
    grids = [[1, 6, 6]]
    pixels = _pixels(grids)
    transposed = pixels.view(6, 6, -1).transpose(0, 1).reshape(36, -1)
    assert rel_err(model.encode(transposed, grids)[0], model.encode(pixels, grids)[0]) > 1e-2
