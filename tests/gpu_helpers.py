"""What the per-model GPU tests share (tests/gpu/test_kimi_gpu.py, tests/gpu/test_qwen3_vl_gpu.py): the
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


# Batches for the graph replays: one image (a filler pads it), several sizes, a clip beside an image,
# exactly a budget (no filler), and one above the ladder's top (eager).
# [1, 56, 64] replays at 4096 patches, whose filler is a 64x64 frame: the size of Kimi-K2.5's position
# table, which a graph's buffer once aliased (each such replay then overwrote the model's table).
GRAPH_BATCHES = [[[1, 32, 32]], [[1, 36, 36], [1, 10, 14], [1, 2, 2]], [[2, 12, 8], [1, 16, 44]], [[1, 32, 48]],
                 [[1, 56, 64]], [[1, 72, 72]]]
GRAPH_BUDGETS = (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
# Replays against the eager forward of the same model: both bf16 with the same kernels, so what may
# differ is a GEMM's kernel choice over the padded rows (bf16 rounding of the activations, compounded
# over the blocks). The measured figure is printed beside the bound.
GRAPH_TOLERANCE = 1e-2


def graph_replays_match_eager(make_model, name: str, patch_dim: int, *, clips_replay: bool = True,
                              tolerance: float = GRAPH_TOLERANCE) -> None:
    """make_model(name) with CUDA graphs at GRAPH_BUDGETS: every budget captures; each batch of
    GRAPH_BATCHES replays (the one above the top runs eagerly; with ``clips_replay`` False, so does a
    batch with a clip) without a device sync and matches the eager forward per image; a second set of
    pixels for the same grids gives that set's embeddings (the replay read its new input). The
    batches then come again in reverse order: each replays on the metadata kept for its shape, copied
    into buffers that another shape's batch filled last."""
    eager = make_model(name)
    model = make_model(name)
    model.set_cuda_graphs(GRAPH_BUDGETS)
    assert model.graphs is not None, f"{name}: no graphs on CUDA"
    report = model.capture_cuda_graphs()
    assert report.budgets == GRAPH_BUDGETS and not report.failed, report
    print(f"{name}: captured {len(report.budgets)} budgets in {report.seconds:.2f} s, "
          f"{report.memory_bytes / 2**20:.0f} MiB")
    rng = np.random.default_rng(1)
    worst, exact, images = 0.0, 0, 0
    for grids in [*GRAPH_BATCHES, *GRAPH_BATCHES[::-1]]:
        patches = sum(t * h * w for t, h, w in grids)
        for _ in range(2):  # new pixels for the same grids: the replay must read them
            pixels = rng.standard_normal((patches, patch_dim), dtype=np.float32)
            reference = [o.float() for o in eager.encode(pixels, grids)]
            replays = model.graphs.replays
            with no_device_sync():
                out = model.encode(pixels, grids)
            torch.cuda.synchronize()
            replayed = patches <= GRAPH_BUDGETS[-1] and (clips_replay or all(g[0] == 1 for g in grids))
            assert model.graphs.replays == replays + replayed, (name, grids)
            assert [tuple(o.shape) for o in out] == [tuple(r.shape) for r in reference]
            for a, b in zip(out, reference):
                worst = max(worst, rel_err(a.float(), b))
                exact += bool(torch.equal(a.float(), b))
                images += 1
            assert_close_to_reference(out, reference, f"{name} replayed {grids}", tolerance)
    print(f"{name}: replays against eager, worst relative error {worst:.2e}, {exact} of {images} images bit-exact")
