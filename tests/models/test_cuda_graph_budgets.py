"""CUDA graphs at token budgets (models/cuda_graphs.py): what can be held on the CPU. The capture
itself needs a GPU (tests/gpu/test_gpu.py replays every family against its eager forward); here the
ladder, the filler, the padded attention patterns, the refresh of a graph's buffers, and the padded
forward of every family against its eager one (float32, tiny random-weight presets)."""

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from encoder_service.attention import RaggedOnly
from encoder_service.config_flags import build_config
from encoder_service.metadata import attention_metadata, check_grids, pad_attention
from encoder_service.models import load_vision_model
from encoder_service.models.cuda_graphs import (
    PREPARED_BYTES,
    PREPARED_KEPT,
    BudgetGraphs,
    GraphForward,
    NotStatic,
    Slots,
    copy_into,
    filler_grid,
    ladder,
    resolve_budgets,
)
from encoder_service.models.registry import families

TINY = [p.name for f in families() for p in f.presets if p.name.startswith("tiny-")]


def test_the_default_ladder_steps_by_half_or_a_third_then_by_quarters_and_ends_at_its_top():
    assert ladder(16384) == (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 5120, 6144, 7168, 8192, 10240,
                             12288, 14336, 16384)
    assert ladder(5000) == (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 5000)
    assert resolve_budgets(None, 16384, 4) == ladder(6144) == (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
                                                                5120, 6144)
    assert resolve_budgets(None, 2002, 4)[-1] == 2000  # a smaller largest batch, rounded down to the merge unit
    assert resolve_budgets((4096, 1024), 16384, 4) == (1024, 4096)


@pytest.mark.parametrize("budgets", [(100,), (1026,), (32768,)])
def test_budgets_asked_for_must_be_whole_merge_units_within_the_largest_batch(budgets):
    with pytest.raises(ValueError, match="multiple of 4 patches"):
        resolve_budgets(budgets, 16384, 4)


@pytest.mark.parametrize(("value", "budgets"), [("auto", None), ("off", ()), ("4096,1024", (1024, 4096))])
def test_the_flag_reads_auto_off_or_budgets(value, budgets):
    assert build_config(environ={"ENCODER_SERVICE_CUDA_GRAPHS": value}).cuda_graph_budgets == budgets


@pytest.mark.parametrize("patches", [4, 8, 36, 4 * 97, 1000, 5184 - 1024])
def test_the_filler_is_one_legal_frame_of_exactly_the_missing_patches(patches):
    t, h, w = filler_grid(patches, 2)
    assert (t, h * w) == (1, patches)
    check_grids([(t, h, w)], 2)  # sides are multiples of the merge size
    assert h <= w


def test_a_padded_pattern_has_the_budgets_shape_and_the_same_sequences():
    meta = attention_metadata([16, 4, 64])
    padded = pad_attention(meta, 6, 128)
    assert padded.cu_seqlens.tolist() == [0, 16, 20, 84, 84, 84, 84]
    assert padded.max_seqlen == 128 and padded.total_tokens == 84
    assert padded.sequence_lengths.tolist() == [16, 4, 64, 0, 0, 0, 0, 0]  # bucketed to 8, as cuDNN's
    with pytest.raises(ValueError, match="3 sequences of up to 64 tokens do not fit 2"):
        pad_attention(meta, 2, 128)
    with pytest.raises(ValueError, match="do not fit 6 of up to 32"):
        pad_attention(meta, 6, 32)


@dataclass(frozen=True)
class _Plan:
    cu: torch.Tensor
    max_seqlen: int


def test_a_graphs_buffers_are_refreshed_in_place_and_a_mismatch_is_refused():
    static = (torch.zeros(3), _Plan(torch.zeros(4, dtype=torch.int32), 64), [torch.zeros(2)])
    buffers = (static[0], static[1].cu, static[2][0])
    copy_into(static, (torch.ones(3), _Plan(torch.arange(4, dtype=torch.int32), 64), [torch.full((2,), 2.0)]))
    assert (static[0], static[1].cu, static[2][0]) == buffers  # the same storage the graph reads
    assert static[0].tolist() == [1, 1, 1] and static[1].cu.tolist() == [0, 1, 2, 3] and static[2][0].tolist() == [2, 2]
    with pytest.raises(NotStatic, match="64 gets 128"):  # a host int baked into a launch
        copy_into(static, (torch.ones(3), _Plan(torch.arange(4, dtype=torch.int32), 128), [torch.zeros(2)]))
    with pytest.raises(NotStatic, match=r"\(3,\) torch.float32 gets torch.Size\(\[4\]\)"):
        copy_into(static, (torch.ones(4), static[1], static[2]))
    with pytest.raises(NotStatic, match="float32 gets"):
        copy_into(static, (torch.ones(3, dtype=torch.float64), static[1], static[2]))


@pytest.mark.parametrize("slots", [Slots(), Slots(full_min=1, full_max=2, window_factor=2.0),
                                   Slots(window_factor=None)])
@pytest.mark.parametrize("budget", [256, 1024, 3072, 6144, 16384])
def test_each_pattern_holds_a_power_of_two_of_sequences_and_a_lone_image_filling_its_budget(slots, budget):
    merge_unit, window_tokens = 4, 64  # Qwen2.5-VL: 2x2 merge, windows of 4x4 merged tokens
    full, windows = slots.full(budget), slots.windows(budget, window_tokens, merge_unit)
    assert full & (full - 1) == 0 and windows & (windows - 1) == 0  # what cuDNN pads the count to
    assert full >= 2  # an image and the filler
    side = int((budget * 0.75) ** 0.5) // 2 * 2  # a lone square image of about 3/4 of the budget
    assert windows >= -(-side // 8) ** 2 + 1  # its windows (8x8 patches each) and the filler's


def test_without_a_window_factor_every_merged_token_may_be_its_own_window():
    assert Slots(window_factor=None).windows(1024, 64, 4) == 256
    assert Slots().windows(1024, 64, 4) == 64  # twice the 16 tiled windows, and 32 full slots
    assert Slots(full_min=16, full_max=1 << 20).full(16384) == 128  # 64 slots and the filler, bucketed


def _budget_graphs(model, budgets):
    graphs = BudgetGraphs(model.graph_forward(RaggedOnly(model.backend)), budgets, patch_dim=model.spec.patch_dim,
                          device=model.device, dtype=model.dtype)
    graphs.static_buffers()  # no capture on the CPU: the forward runs eagerly on the budgets' buffers
    return graphs


BATCHES = {
    "one image, no filler": [[1, 16, 16]],
    "one image and a filler": [[1, 10, 14]],
    "several images": [[1, 6, 8], [1, 12, 4], [1, 2, 2]],
    "a clip and an image": [[2, 8, 8], [1, 4, 6]],
}


@pytest.mark.parametrize("preset", TINY)
def test_a_batch_padded_to_its_budget_gives_every_image_its_eager_embedding(preset):
    model = load_vision_model(preset)
    graphs = _budget_graphs(model, [256, 384])
    rng = np.random.default_rng(0)
    for name, grids in BATCHES.items():
        pixels = torch.from_numpy(rng.standard_normal((sum(t * h * w for t, h, w in grids), model.spec.patch_dim),
                                                      dtype=np.float32))
        eager, tokens = model.encode_packed(pixels, grids)
        replayed = graphs.run(pixels, [tuple(g) for g in grids], sum(tokens))
        assert replayed is not None, name
        assert replayed.shape == eager.shape, name
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5, msg=name)
    assert graphs.replays == len(BATCHES)


@pytest.mark.parametrize("preset", TINY)
def test_a_shape_seen_lately_replays_on_its_kept_metadata_and_each_batch_gets_its_own_embedding(preset):
    model = load_vision_model(preset)
    graphs = _budget_graphs(model, [256, 384])
    prepared = []
    real_prepare = graphs.forward.prepare
    graphs.forward = dataclasses.replace(graphs.forward,
                                         prepare=lambda meta: prepared.append(1) or real_prepare(meta))
    shapes = list(BATCHES.values())
    order = [0, 1, 0, 2, 0, 3, 1, 2, 3, 0]  # shapes come back, interleaved, with new pixels each time
    rng = np.random.default_rng(1)
    for i in order:
        grids = shapes[i]
        pixels = torch.from_numpy(rng.standard_normal((sum(t * h * w for t, h, w in grids), model.spec.patch_dim),
                                                      dtype=np.float32))
        eager, tokens = model.encode_packed(pixels, grids)
        replayed = graphs.run(pixels, [tuple(g) for g in grids], sum(tokens))
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5, msg=str(grids))
    assert len(prepared) == len(shapes)  # once per shape, not once per batch


@pytest.mark.parametrize("preset", TINY)
def test_a_graphs_buffers_share_no_memory_with_the_model(preset):
    # Every batch's metadata is copied into them: a buffer that is a view of a weight (Kimi-K2.5's
    # position table, at a filler of exactly its size) would have each batch overwrite the model.
    model = load_vision_model(preset)
    side = model.module.vision_tower.patch_embed.pos_emb.weight.shape[0] if "kimi" in preset else 8
    graphs = _budget_graphs(model, [side * side, 256])
    weights = {p.untyped_storage().data_ptr() for p in model.module.parameters()}
    weights |= {b.untyped_storage().data_ptr() for b in model.module.buffers()}
    for budget in graphs.budgets:
        buffers = []
        _tensors(graphs._graphs[budget].prepared, buffers)
        assert buffers, budget
        assert not weights & {t.untyped_storage().data_ptr() for t in buffers}, (preset, budget)


def _tensors(value, out):
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            _tensors(getattr(value, f.name), out)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _tensors(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors(v, out)


def test_the_kept_metadata_is_bounded_to_the_shapes_seen_last():
    graphs = BudgetGraphs(GraphForward(metadata=lambda grids: list(grids), pad=lambda meta, budget, slots: meta,
                                       prepare=lambda meta: tuple(meta), run=None, merge=2),
                          [1024], patch_dim=4, device=torch.device("cpu"), dtype=torch.float32)
    for side in range(2, 2 + 2 * PREPARED_KEPT, 2):
        graphs._keep(*graphs._prepared_for([(1, side, side)], side * side, 1024)[:2])
    assert len(graphs._prepared) == PREPARED_KEPT
    newest = (1024, ((1, 2 * PREPARED_KEPT, 2 * PREPARED_KEPT),))
    assert list(graphs._prepared)[-1] == newest


def test_the_kept_metadata_is_bounded_in_bytes():
    big = torch.zeros(PREPARED_BYTES // 3, dtype=torch.uint8)
    graphs = BudgetGraphs(GraphForward(metadata=lambda grids: list(grids), pad=lambda meta, budget, slots: meta,
                                       prepare=lambda meta: (big.clone(),), run=None, merge=2),
                          [1024], patch_dim=4, device=torch.device("cpu"), dtype=torch.float32)
    for side in (2, 4, 6, 8):
        graphs._keep(*graphs._prepared_for([(1, side, side)], side * side, 1024)[:2])
    assert len(graphs._prepared) == 3  # a fourth third would pass the bound
    assert next(iter(graphs._prepared)) == (1024, ((1, 4, 4),))


@pytest.mark.parametrize("preset", TINY)
def test_a_batch_that_fits_no_budget_is_left_to_the_eager_forward(preset):
    model = load_vision_model(preset)
    graphs = _budget_graphs(model, [256])
    too_many_patches = [[1, 16, 18]]
    too_many_frames = [[1, 2, 2]] * Slots().full(256)  # with the filler's: one more than 256 holds
    for grids in (too_many_patches, too_many_frames):
        pixels = torch.zeros(sum(t * h * w for t, h, w in grids), model.spec.patch_dim)
        assert graphs.run(pixels, [tuple(g) for g in grids], 1) is None
    assert (graphs.replays, graphs.eager) == (0, 2)


def test_the_model_on_the_cpu_keeps_no_graphs():
    model = load_vision_model("tiny-qwen2.5-vl")
    model.set_cuda_graphs(ladder(1024))
    assert model.graphs is None and model.capture_cuda_graphs() is None
