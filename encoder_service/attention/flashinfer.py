"""FlashInfer attention: ragged prefill (FA2/FA3) and the cuDNN path, NVIDIA only.

Which kernel ``flashinfer`` uses, from measurement inside the whole Qwen2.5-VL-7B forward on an H100
(bench/RESULTS.md): the cuDNN kernel runs the unpadded head_dim (72, 80) and was faster end to end
than FA3 ragged, whose kernel alone is quicker but which needs q, k, v zero-padded to 128 and the
output sliced back (copies that cost more than the kernel saves). So ``flashinfer`` means cuDNN
wherever cuDNN supports the head_dim (multiples of 8 up to 128) and ragged FA3 (Hopper) / FA2
otherwise. ``flashinfer-fa3``, ``flashinfer-fa2`` and ``flashinfer-cudnn`` force one kernel.

Both paths take their metadata from the CPU: ragged ``plan()`` is fed pinned host indptrs (it
copies them asynchronously), cuDNN gets device copies of the bucketed ``sequence_lengths`` and
element batch offsets. Nothing here reads a device tensor on the host.

A plan lives in a wrapper's workspace (and its pinned host copy), so there is one wrapper per
attention pattern of a batch (full and window) and per batch in flight: the engine's worker enqueues
batch i+1 before waiting for batch i, and waits for batch i before planning batch i+2, so a ring of
``PLANS_IN_FLIGHT`` wrappers never rewrites a plan that queued work still reads.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ..device import is_rocm
from ..metadata import AttentionMetadata
from .base import GpuHalfPrecisionBackend

WORKSPACE_BYTES = 128 * 1024 * 1024
PADDED_HEAD_DIMS = (64, 128, 256)
PLANS_IN_FLIGHT = 4  # 2 attention patterns x 2 batches in flight (module docstring)


def _padded_head_dim(head_dim: int) -> int:
    return next(d for d in PADDED_HEAD_DIMS if d >= head_dim)


def _bucket_seqlen(n: int) -> int:
    """cuDNN builds a graph per (batch, max length): round the length up to a power of two (min 64)."""
    return max(64, 1 << (max(n, 1) - 1).bit_length())


class _FlashInferBase(GpuHalfPrecisionBackend):
    @classmethod
    def unavailable_reason(cls) -> str | None:
        if is_rocm():
            return "FlashInfer is NVIDIA-only; this torch is built for ROCm (use 'aiter')"
        if importlib.util.find_spec("flashinfer") is None:
            return "the flashinfer package is not installed (pip install flashinfer-python)"
        return None

    @staticmethod
    def _capability(device: torch.device) -> tuple[int, int]:
        return torch.cuda.get_device_capability(device)

    def __init__(self, num_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(num_heads, head_dim, device, dtype)
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


class FlashInferRaggedBackend(_FlashInferBase):
    """BatchPrefillWithRaggedKVCacheWrapper with head_dim zero-padded to 64/128/256."""

    name = "flashinfer-fa3"
    priority = 0  # reached through "flashinfer" in auto mode
    kernel: ClassVar[str] = "fa3"
    static_plans = False  # a plan is a ring slot that the 4th batch after it re-plans

    @classmethod
    def supports_head_size(cls, head_dim: int) -> bool:
        return head_dim <= PADDED_HEAD_DIMS[-1] and head_dim % 8 == 0

    @classmethod
    def unsupported_reason(cls, device, dtype, head_dim) -> str | None:
        reason = super().unsupported_reason(device, dtype, head_dim)
        if reason is None and cls.kernel == "fa3" and cls._capability(device)[0] != 9:
            major, minor = cls._capability(device)
            return f"the FA3 kernel needs a Hopper GPU (sm90); {device} is sm{major}{minor}"
        return reason

    def __init__(self, num_heads, head_dim, device, dtype, kernel: str | None = None) -> None:
        super().__init__(num_heads, head_dim, device, dtype)
        self.padded = _padded_head_dim(head_dim)
        self.padded_head_dim = self.padded if self.padded != head_dim else None
        self.kernel_name = kernel or self.kernel
        self._wrappers: list[Any] = []
        self._next = 0

    def _wrapper(self):
        import flashinfer

        # A ring of wrappers (plans): see the module docstring.
        if not self._wrappers:
            self._wrappers = [flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                self.workspace, kv_layout="NHD", backend=self.kernel_name) for _ in range(PLANS_IN_FLIGHT)]
        wrapper = self._wrappers[self._next % PLANS_IN_FLIGHT]
        self._next += 1
        return wrapper

    def prepare_ragged(self, meta: AttentionMetadata):
        wrapper = self._wrapper()
        indptr = torch.from_numpy(meta.cu_seqlens).pin_memory()
        # sm_scale of the TRUE head_dim: the zero padding adds nothing to q.k but would change the
        # default scale.
        wrapper.plan(indptr, indptr, self.num_heads, self.num_heads, self.padded, causal=False,
                     sm_scale=self.scale, q_data_type=self.dtype, kv_data_type=self.dtype)
        return wrapper

    def forward_ragged(self, q, k, v, prepared) -> torch.Tensor:
        if q.shape[-1] == self.padded:  # handed over padded (padded_head_dim): output stays padded
            return prepared.run(q, k, v)
        pad = self.padded - self.head_dim
        if pad:
            q, k, v = (F.pad(x, (0, pad)) for x in (q, k, v))
        out = prepared.run(q, k, v)
        return out[..., : self.head_dim] if pad else out


class FlashInferFA2Backend(FlashInferRaggedBackend):
    name = "flashinfer-fa2"
    kernel = "fa2"


@dataclass(frozen=True)
class _CuDNNPrepared:
    seq_lens: torch.Tensor  # int32 [B_bucket, 1, 1, 1] on device
    offsets: torch.Tensor  # int32 [B_bucket + 1] element offsets on device
    max_seqlen: int  # bucketed


class FlashInferCuDNNBackend(_FlashInferBase):
    """flashinfer.cudnn.prefill.cudnn_batch_prefill_with_kv_cache, unpadded head_dim."""

    name = "flashinfer-cudnn"
    priority = 0
    # Device tensors of the bucketed sequence count, and the bucketed longest length.
    static_plans = True

    @classmethod
    def supports_head_size(cls, head_dim: int) -> bool:
        return head_dim % 8 == 0 and head_dim <= 128

    def prepare_ragged(self, meta: AttentionMetadata) -> _CuDNNPrepared:
        from ..device import host_to_device

        seq = host_to_device(meta.sequence_lengths.reshape(-1, 1, 1, 1), self.device)
        offsets = meta.batch_offsets(self.num_heads, self.head_dim)
        if offsets[-1] >= 2**31:
            raise ValueError(f"batch of {meta.total_tokens} tokens overflows cuDNN's int32 element offsets")
        off = host_to_device(offsets.astype("int32"), self.device)
        return _CuDNNPrepared(seq, off, _bucket_seqlen(meta.max_seqlen))

    def forward_ragged(self, q, k, v, prepared: _CuDNNPrepared) -> torch.Tensor:
        from flashinfer.cudnn.prefill import cudnn_batch_prefill_with_kv_cache

        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        p = prepared
        out, _ = cudnn_batch_prefill_with_kv_cache(
            q, k, v, self.scale, self.workspace,
            max_token_per_sequence=p.max_seqlen, max_sequence_kv=p.max_seqlen,
            actual_seq_lens_q=p.seq_lens, actual_seq_lens_kv=p.seq_lens,
            causal=False, return_lse=False,
            batch_offsets_q=p.offsets, batch_offsets_o=p.offsets,
            batch_offsets_k=p.offsets, batch_offsets_v=p.offsets,
        )
        return out


class FlashInferBackend(_FlashInferBase):
    """``flashinfer``: the kernel that measured fastest for this GPU (module docstring)."""

    name = "flashinfer"
    priority = 20

    @classmethod
    def supports_head_size(cls, head_dim: int) -> bool:
        return FlashInferRaggedBackend.supports_head_size(head_dim)

    def __new__(cls, num_heads, head_dim, device, dtype):
        if FlashInferCuDNNBackend.supports_head_size(head_dim):
            return FlashInferCuDNNBackend(num_heads, head_dim, device, dtype)
        if torch.cuda.get_device_capability(device)[0] == 9:
            return FlashInferRaggedBackend(num_heads, head_dim, device, dtype)
        return FlashInferFA2Backend(num_heads, head_dim, device, dtype)
