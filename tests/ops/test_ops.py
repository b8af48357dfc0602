"""The ops layer (encoder_service/ops): ``--ops`` parsing and its errors, the ``auto`` rule that keeps
``--attn-backend`` honest, and proof on the CPU that a named attention backend runs every attention
layer of every family (a spy backend counts its calls), and that a provider is one class plus one
registry line."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from encoder_service.attention.registry import BACKENDS
from encoder_service.attention.sdpa import SDPABackend
from encoder_service.errors import BackendUnavailable
from encoder_service.models import load_vision_model
from encoder_service.ops import PROVIDERS, OpTarget, parse_ops, select_ops
from encoder_service.ops.torch_ops import RotaryAttention, TorchGatedMLP, qkv_rotary
from encoder_service.ops.triton_window import TritonWindowAttention
from encoder_service.ops.triton_window import plan as window_plan

QWEN_OPS = ("window_attention", "rms_scale", "gated_mlp")
ALL_TORCH = "window_attention=torch,rms_scale=torch,gated_mlp=torch"
CPU = OpTarget(torch.device("cpu"), torch.float32, head_dim=16, hidden_size=64, intermediate_size=128,
               activation="silu", window_tokens=64)


class SpyBackend(SDPABackend):
    """SDPA that counts its calls: registered as attention backend "spy" by the fixture below."""

    name = "spy"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def forward(self, q, k, v, prepared):
        self.calls += 1
        return super().forward(q, k, v, prepared)


class SpyGatedMLP(TorchGatedMLP):
    """A provider registered by a test: one class and one line in ops.registry.PROVIDERS."""

    name = "spy"
    calls = 0

    def __call__(self, *args):
        SpyGatedMLP.calls += 1
        return super().__call__(*args)


class PaddedSDPA(SDPABackend):
    """A backend with padded_head_dim (as FlashInfer FA3 on Hopper): q, k, v come zero-padded, the
    output goes back padded."""

    name = "padded"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.padded_head_dim = self.head_dim + 8

    def forward_ragged(self, q, k, v, prepared):
        assert q.shape[-1] == self.padded_head_dim
        out = torch.empty_like(q)
        for start, end in prepared:
            qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            out[start:end] = torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, scale=self.scale).squeeze(0).transpose(0, 1)
        return out


class EmulatedWindowKernel(RotaryAttention):
    """The Triton window provider's contract in torch: computes attention itself (no backend) and
    returns the model's head_dim, whatever the backend pads to."""

    name = "emulated"
    runs_attention = True
    calls = 0

    def prepare(self, meta, backend, device):
        return [(int(a), int(b)) for a, b in zip(meta.cu_seqlens[:-1], meta.cu_seqlens[1:])]

    def __call__(self, acc, affine, cos, sin, num_heads, plan, backend):
        EmulatedWindowKernel.calls += 1
        q, k, v = qkv_rotary(acc, *affine, cos, sin, num_heads)
        out = torch.empty_like(q)
        for a, b in plan:
            out[a:b] = torch.nn.functional.scaled_dot_product_attention(
                *(x[a:b].transpose(0, 1) for x in (q, k, v))).transpose(0, 1)
        return out


@pytest.fixture
def spy(monkeypatch):
    monkeypatch.setitem(BACKENDS, "spy", f"{__name__}:SpyBackend")


def _pixels(model, grids, seed=0):
    n = sum(t * h * w for t, h, w in grids)
    return np.random.default_rng(seed).standard_normal((n, model.patch_dim), dtype=np.float32)


def _depth(model) -> int:
    cfg = model.cfg
    return getattr(cfg, "depth", None) or cfg.num_layers


@pytest.mark.parametrize("preset", ["tiny-qwen2.5-vl", "tiny-kimi-k2.5", "tiny-qwen3-vl"])
def test_a_named_backend_runs_every_attention_layer(spy, preset):
    # Full and window layers alike: the count is the tower's depth, and the output is SDPA's.
    model = load_vision_model(preset, attn_backend="spy")
    reference = load_vision_model(preset, attn_backend="sdpa")
    grids = [[1, 8, 12], [1, 4, 4]]
    pixels = _pixels(model, grids)
    out = torch.cat(model.encode(pixels, grids))
    assert model.attn_backend == "spy" and model.backend.calls == _depth(model) > 0
    torch.testing.assert_close(out, torch.cat(reference.encode(pixels, grids)), rtol=0, atol=0)


def test_families_without_fused_operations_say_so():
    for preset in ("tiny-kimi-k2.5", "tiny-qwen3-vl"):
        assert load_vision_model(preset).ops.describe() == "none"
        assert load_vision_model(preset, ops="torch").ops.describe() == "none"
        with pytest.raises(BackendUnavailable, match="names gated_mlp, but this model uses no fused operations"):
            load_vision_model(preset, ops="gated_mlp=torch")


def test_the_cpu_runs_every_operation_in_torch():
    assert load_vision_model("tiny-qwen2.5-vl").ops.describe() == ALL_TORCH
    assert load_vision_model("tiny-qwen2.5-vl", ops="torch").ops.describe() == ALL_TORCH


@pytest.fixture
def window_kernel_runs_here(monkeypatch):
    """As on an NVIDIA GPU: the Triton window provider says it can run (only it: the others would
    import triton when built). Selection only; nothing here calls the kernel."""
    monkeypatch.setattr(TritonWindowAttention, "unavailable_reason", classmethod(lambda cls, target: None))


def test_auto_takes_the_window_kernel_only_with_an_auto_attention_backend(window_kernel_runs_here):
    def window(spec, attention_named):
        return select_ops(spec, CPU, QWEN_OPS, attention_named=attention_named).providers["window_attention"].name

    assert window("auto", attention_named=False) == "triton"
    # --attn-backend sdpa (any named backend): every attention layer through it...
    assert window("auto", attention_named=True) == "torch"
    assert window("rms_scale=torch", attention_named=True) == "torch"
    # ...unless --ops names the kernel too.
    assert window("window_attention=triton", attention_named=True) == "triton"
    assert window("torch", attention_named=False) == "torch"


def test_a_named_backend_keeps_the_window_layers_of_a_model_where_the_kernel_runs(spy, window_kernel_runs_here):
    assert load_vision_model("tiny-qwen2.5-vl").ops.describe().startswith("window_attention=triton,")
    model = load_vision_model("tiny-qwen2.5-vl", attn_backend="spy")
    assert model.ops.describe() == ALL_TORCH
    grids = [[1, 8, 8]]
    model.encode(_pixels(model, grids), grids)
    assert model.backend.calls == model.cfg.depth


@pytest.mark.parametrize("spec,default,named", [
    ("auto", "auto", {}),
    ("", "auto", {}),
    ("torch", "torch", {}),
    (" window_attention = triton , gated_mlp=torch", "auto", {"window_attention": "triton", "gated_mlp": "torch"}),
    ("torch,rms_scale=triton", "torch", {"rms_scale": "triton"}),
    ("rms_scale=auto", "auto", {"rms_scale": "auto"}),
])
def test_ops_syntax(spec, default, named):
    assert parse_ops(spec) == (default, named)


@pytest.mark.parametrize("spec,message", [
    ("flash", "unknown provider 'flash'; providers: auto, torch, triton"),
    ("swiglu=triton", "unknown capability 'swiglu'; capabilities: window_attention, rms_scale, gated_mlp"),
    ("gated_mlp=cutlass", "unknown provider 'cutlass' for gated_mlp; providers: auto, torch, triton"),
    ("torch,auto", "at most one provider without a capability"),
    ("rms_scale=torch,rms_scale=triton", "rms_scale is named twice"),
])
def test_ops_errors_name_what_is_wrong(spec, message):
    with pytest.raises(BackendUnavailable, match=message.replace("(", r"\(")):
        parse_ops(spec)


@pytest.mark.parametrize("capability", QWEN_OPS)
def test_a_triton_provider_named_on_the_cpu_fails_at_load_with_the_reason(capability):
    with pytest.raises(BackendUnavailable, match=f"{capability}=triton cannot run here: needs an NVIDIA GPU "
                                                 r"\(device cpu, dtype torch.float32\)"):
        load_vision_model("tiny-qwen2.5-vl", ops=f"{capability}=triton")


def test_the_triton_providers_decline_from_facts_known_at_load():
    from encoder_service.ops.triton_rms import TritonRmsScale
    from encoder_service.ops.triton_swiglu import TritonGatedMLP

    for cls in (TritonWindowAttention, TritonRmsScale, TritonGatedMLP):
        assert cls.unavailable_reason(CPU) == "needs an NVIDIA GPU"
    # Windows longer than the kernel's tile: the kernel cannot take the model.
    assert window_plan(np.array([0, 64, 129]), 65, torch.device("cpu")) is None


def test_a_new_provider_is_one_class_and_one_registry_line(monkeypatch):
    monkeypatch.setitem(PROVIDERS["gated_mlp"], "spy", f"{__name__}:SpyGatedMLP")
    SpyGatedMLP.calls = 0
    model = load_vision_model("tiny-qwen2.5-vl", ops="gated_mlp=spy")
    assert model.ops.describe() == "window_attention=torch,rms_scale=torch,gated_mlp=spy"
    grids = [[1, 4, 8]]
    pixels = _pixels(model, grids)
    out = model.encode(pixels, grids)[0]
    assert SpyGatedMLP.calls == model.cfg.depth
    torch.testing.assert_close(out, load_vision_model("tiny-qwen2.5-vl").encode(pixels, grids)[0], rtol=0, atol=0)


def test_the_ops_package_imports_without_triton():
    # The Triton providers answer unavailable_reason without their kernels: triton is imported only
    # when one is built. This machine's CPU torch has no triton; the check holds where one is installed.
    code = ("import sys; import encoder_service.ops, encoder_service.ops.triton_window, encoder_service.ops.triton_rms,"
            " encoder_service.ops.triton_swiglu, encoder_service.models; assert 'triton' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_option_reaches_the_config():
    from encoder_service.config_flags import parse_serve_args

    assert parse_serve_args([]).ops == "auto"
    assert parse_serve_args(["--ops", "torch"]).ops == "torch"
    assert parse_serve_args([], {"ENCODER_SERVICE_OPS": "gated_mlp=torch"}).ops == "gated_mlp=torch"


def test_window_layers_of_a_kernel_next_to_a_backend_that_pads_head_dims(monkeypatch):
    # The H100's mix with flashinfer-fa3 (padded head_dim) and the window kernel (unpadded): each
    # layer's output projection follows what its attention returned.
    monkeypatch.setitem(BACKENDS, "padded", f"{__name__}:PaddedSDPA")
    monkeypatch.setitem(PROVIDERS["window_attention"], "emulated", f"{__name__}:EmulatedWindowKernel")
    # Under auto a named backend keeps the window layers, even from a provider that could run.
    assert load_vision_model("tiny-qwen2.5-vl", attn_backend="padded").ops.describe() == ALL_TORCH
    model = load_vision_model("tiny-qwen2.5-vl", attn_backend="padded", ops="window_attention=emulated")
    assert model.ops.describe().startswith("window_attention=emulated,")
    EmulatedWindowKernel.calls = 0
    grids = [[1, 8, 12], [2, 4, 4], [1, 10, 14]]
    pixels = _pixels(model, grids)
    out = torch.cat(model.encode(pixels, grids))
    ref = torch.cat(load_vision_model("tiny-qwen2.5-vl", attn_backend="sdpa").encode(pixels, grids))
    assert EmulatedWindowKernel.calls == model.cfg.depth - len(model.cfg.fullatt_block_indexes) > 0
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
