"""Bad input to the model raises a typed error naming the problem, never a shape error from torch."""

import numpy as np
import pytest

from encoder_service.errors import InvalidInput
from encoder_service.models import load_vision_model

PATCH_DIM = 1176


@pytest.fixture(scope="module")
def model():
    return load_vision_model("tiny-qwen2.5-vl")


def patches(n, width=PATCH_DIM):
    return np.zeros((n, width), dtype=np.float32) + 0.5


@pytest.mark.parametrize(
    ("pixels", "grids", "message"),
    [
        (patches(12), [[1, 3, 4]],
         r"image 0: grid h and w must be positive multiples of the spatial merge size 2, got h=3"),
        (patches(16), [[1, 4, 4], [1, 4, 5]], r"image 1: .*got h=4, w=5"),
        (patches(16), [[0, 4, 4]], r"image 0: grid t must be >= 1, got t=0"),
        (patches(16), [[1, 4]], r"image 0: grid_thw must be \[t, h, w\]"),
        (patches(15), [[1, 4, 4]], r"patch count does not match the grids: pixel_values has 15 patches.*need 16"),
        (patches(16, 588), [[1, 4, 4]],
         r"wrong patch width: pixel_values has 588 values per patch, the model needs 1176"),
        (patches(16)[0], [[1, 4, 4]], r"pixel_values must be 2-D"),
        (patches(0), [], r"empty batch"),
    ],
)
def test_bad_batch_raises_invalid_input_naming_the_problem(model, pixels, grids, message):
    with pytest.raises(InvalidInput, match=message):
        model.encode(pixels, grids)


def test_model_still_encodes_after_bad_input(model):
    with pytest.raises(InvalidInput):
        model.encode(patches(15), [[1, 4, 4]])
    out = model.encode(patches(16), [[1, 4, 4]])
    assert out[0].shape == (4, 48)
