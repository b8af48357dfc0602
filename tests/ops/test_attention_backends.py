"""Backend registry and selector: what runs where, and why not."""

import numpy as np
import pytest
import torch

from encoder_service.attention import select_backend, valid_names
from encoder_service.attention.registry import BACKENDS, backend_class
from encoder_service.attention.sdpa import SDPABackend
from encoder_service.errors import BackendUnavailable
from encoder_service.metadata import attention_metadata

CPU = torch.device("cpu")


def test_auto_picks_sdpa_on_the_cpu():
    assert select_backend("auto", "cpu", torch.float32, 80) is SDPABackend


def test_every_registered_backend_imports_without_its_kernel_library():
    for name in BACKENDS:
        assert backend_class(name).name == name


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("varlen", "device cpu is not supported"),
        ("aiter", "aiter needs a ROCm build of torch"),
        ("flashinfer", "flashinfer"),
        ("flashinfer-cudnn", "flashinfer"),
        ("flashinfer-fa3", "flashinfer"),
    ],
)
def test_a_backend_that_cannot_run_here_says_why(name, reason):
    with pytest.raises(BackendUnavailable, match=f"attention backend '{name}' cannot run here: .*{reason}"):
        select_backend(name, "cpu", torch.bfloat16, 80)


def test_unknown_backend_lists_every_valid_name():
    with pytest.raises(BackendUnavailable) as info:
        select_backend("flash_attn", "cpu", torch.float32, 80)
    for name in valid_names():
        assert name in str(info.value)


def test_sdpa_backend_attends_only_within_each_sequence():
    torch.manual_seed(0)
    lengths = [5, 1, 9, 3]
    heads, dim = 3, 8
    q, k, v = (torch.randn(sum(lengths), heads, dim, dtype=torch.float64) for _ in range(3))
    backend = SDPABackend(heads, dim, CPU, torch.float64)
    out = backend.forward(q, k, v, backend.prepare(attention_metadata(lengths)))

    # Reference: dense attention with a block-diagonal mask.
    seg = np.repeat(np.arange(len(lengths)), lengths)
    mask = torch.from_numpy(seg[:, None] == seg[None, :])
    scores = torch.einsum("qhd,khd->hqk", q, k) * dim**-0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    ref = torch.einsum("hqk,khd->qhd", probs, v)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)

