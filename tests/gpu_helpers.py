"""What the per-model GPU tests share (tests/test_kimi_gpu.py, tests/test_qwen3_vl_gpu.py): the
marks, the CUDA backends to compare against sdpa, and the no-hidden-sync forward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import torch

from encoder_service.attention.registry import BACKENDS, backend_class

DEVICE = torch.device("cuda")


def gpu_marks(why: str) -> list[pytest.MarkDecorator]:
    """A module's pytestmark: gpu, skipped without CUDA, and allowed to skip under CI for ``why``."""
    return [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            pytest.mark.allow_skip_on_cpu(why)]


def cuda_backends(head_dim: int) -> list[str]:
    """The attention backends other than sdpa that this GPU runs in bf16 at head_dim."""
    if not torch.cuda.is_available():
        return []
    return [n for n in BACKENDS if n != "sdpa"
            and backend_class(n).unsupported_reason(DEVICE, torch.bfloat16, head_dim) is None]


@contextlib.contextmanager
def no_device_sync() -> Iterator[None]:
    """Any device sync inside raises (torch.cuda.set_sync_debug_mode("error"))."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def encode_without_device_sync(model, pixels, grids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """model.encode(pixels, grids) after a warm-up call (lazy kernel and plan set-up may sync once),
    under no_device_sync."""
    model.encode(pixels, grids)
    with no_device_sync():
        out = model.encode(pixels, grids)
    torch.cuda.synchronize()
    return out


def random_patches(grids: Sequence[Sequence[int]], patch_dim: int) -> np.ndarray:
    n = sum(t * h * w for t, h, w in grids)
    return np.random.default_rng(0).standard_normal((n, patch_dim), dtype=np.float32)


def forward_matching_sdpa(make_model, name: str, pixels, grids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """make_model(name)'s outputs, encoded without a device sync and checked against make_model("sdpa")'s."""
    reference = [o.float() for o in make_model("sdpa").encode(pixels, grids)]
    out = encode_without_device_sync(make_model(name), pixels, grids)
    assert_close_to_reference(out, reference, name)
    return out


def assert_close_to_reference(out: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], name: str,
                              tolerance: float = 2e-2) -> None:
    for i, (a, b) in enumerate(zip(out, reference)):
        err = rel_err(a.float(), b)
        assert err <= tolerance, f"{name}, image {i}: relative error {err:.2e}"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()
