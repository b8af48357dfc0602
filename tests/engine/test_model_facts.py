"""One type for the served model's facts, from the model to the wire: ``ModelInfo``.

The model's ``ModelFront`` and ``ModelSpec`` name each fact as GetModelInfo does, the engine reads
them by name (``Engine.describe``), and the wire mapping is by name too; so reporting a new fact is
a field of the front (or spec), of ``ModelInfo`` and of the proto, and nothing in between."""

from __future__ import annotations

import asyncio
from dataclasses import fields, make_dataclass
from types import SimpleNamespace

from encoder_client.protocol import ModelInfo, encoder_pb2
from prometheus_client import CollectorRegistry

from encoder_service.config import ServiceConfig
from encoder_service.engine import Engine
from encoder_service.engine.facts import model_info
from encoder_service.metrics import ServiceMetrics
from encoder_service.models import load_vision_model


def test_the_wire_message_and_the_dataclass_name_the_same_facts():
    wire = {f.name for f in encoder_pb2.ModelInfo.DESCRIPTOR.fields}
    assert wire == {f.name for f in fields(ModelInfo)}


def test_every_fact_of_a_real_engine_comes_by_its_own_name_from_the_model_or_the_engine():
    model = load_vision_model("tiny-qwen2.5-vl", device="cpu")
    engine = Engine(ServiceConfig(model="tiny-qwen2.5-vl", max_batch_tokens=4096), model,
                    metrics=ServiceMetrics(CollectorRegistry()))

    async def described() -> ModelInfo:
        await engine.start()
        try:
            return engine.describe(shared_memory=True, region_socket="encoder-regions-x")
        finally:
            await engine.stop()

    info = asyncio.run(described())
    front = model.front()
    for name in ("dtype", "attention_backend", "preprocess", "decode", "ops", "cache_namespace"):
        assert getattr(info, name) == getattr(front, name), name
    for name in ("model_id", "model_type", "hidden_size", "patch_size", "temporal_patch_size",
                 "spatial_merge_size", "patch_dim", "feature_levels"):
        assert getattr(info, name) == getattr(front.spec, name), name
    assert info.max_batch_tokens == 4096 and info.shared_memory is True and info.device == "cpu"
    assert info.max_image_pixels > 0 and info.version
    assert info.region_socket == "encoder-regions-x"
    # Nothing but the API's own facts (shared_memory, region_socket) may be missing from the engine's sources.
    unnamed = [f.name for f in fields(ModelInfo) if f.name not in engine.engine_facts()
               and not hasattr(front, f.name) and not hasattr(front.spec, f.name)]
    assert unnamed == ["shared_memory", "region_socket"]
    # ...and the answer survives the wire unchanged.
    assert ModelInfo.from_proto(info.to_proto()) == info


def test_a_new_fact_needs_only_its_field_and_a_source_of_the_same_name():
    extended = make_dataclass("Extended", [("novel_fact", str, "")], bases=(ModelInfo,), frozen=True)
    base = {f.name: 0 for f in fields(ModelInfo)}
    info = model_info(base, SimpleNamespace(novel_fact="from the model"), info_type=extended)
    assert info.novel_fact == "from the model"
