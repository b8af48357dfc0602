"""vLLM's encoder-cache connector fed by encoder-service: ``EncoderServiceECConnector``.

Importing this module imports torch and vLLM (tested with vLLM 0.33.0); ``import encoder_client``
never does. A vLLM consumer (prefill/decode) started with

    --ec-transfer-config '{"ec_connector": "EncoderServiceECConnector",
                           "ec_connector_module_path": "encoder_client.integrations.vllm",
                           "ec_role": "ec_consumer",
                           "ec_connector_extra_config": {"encoder": "dns:///encoder:50051"}}'

skips its own vision encoder for every image whose ``uuid`` is the encoder's content hash of it
(vLLM then uses the uuid verbatim as the item's ``mm_hash``, as long as the request carries no
``mm_processor_kwargs`` / ``media_io_kwargs``):

- scheduler side: ``ensure_cache_available`` starts fetching each missing item from the encoder
  (``Encode`` by content hash) in background threads and defers the request until every item is
  staged in node-local shared memory (``encoder_client.integrations.staging``); ``has_cache_item``
  says True only for what is staged; an item that cannot be had (NOT_FOUND, encoder down, timeout,
  wrong size) fails its request through ``take_unavailable_requests`` with the reason in the log;
- worker side: ``start_load_caches`` maps each staged file and copies it into a tensor of the
  model's dtype on the worker's device, at ``encoder_cache[mm_hash]``;
- staged files are removed once their requests are done with them and every worker has loaded
  them, and all of them at shutdown.

Settings (``ec_connector_extra_config``): see ``encoder_client.integrations.stager.ConnectorSettings``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics, ECConnectorStats
from vllm.logger import init_logger

from encoder_client.integrations.stager import ENCODER_MODE_OF_BACKEND, ConnectorSettings, EmbeddingStager
from encoder_client.integrations.staging import StagedItem, open_staged

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

# Under vLLM's "vllm" logger, so that its handler and format apply (a logger outside it has no
# handler inside vLLM: errors came out as bare stderr lines and INFO not at all).
logger = init_logger("vllm.ec_connector.encoder_service")

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_COUNTERS = ("items_fetched", "items_staged", "items_failed", "bytes_staged", "items_loaded", "bytes_loaded",
             "requests_failed")


@dataclass
class EncoderServiceECMetadata(ECConnectorMetadata):
    """Scheduler -> workers, per step: the staged items to load into the encoder cache."""

    loads: list[StagedItem] = field(default_factory=list)


@dataclass
class EncoderServiceECWorkerMetadata(ECConnectorWorkerMetadata):
    """Workers -> scheduler, per step: the content hashes each worker loaded (one entry per worker)."""

    loaded: list[str] = field(default_factory=list)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        assert isinstance(other, EncoderServiceECWorkerMetadata)
        self.loaded.extend(other.loaded)
        return self


@dataclass
class EncoderServiceECStats(ECConnectorStats):
    """Counters of an interval: items fetched / staged / failed, bytes staged (scheduler side);
    items and bytes loaded into the encoder cache (worker side); requests failed."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        for key, value in (other.data or {}).items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: self.data.get(key, 0) for key in _COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.values())


_COUNTER_HELP = {
    "items_fetched": "Images the connector fetched from encoder-service (by content hash)",
    "items_staged": "Fetched images staged in node-local shared memory for the workers",
    "items_failed": "Images the connector could not have from encoder-service (their requests failed)",
    "bytes_staged": "Bytes of embeddings staged in node-local shared memory",
    "items_loaded": "Staged images the workers loaded into vLLM's encoder cache",
    "bytes_loaded": "Bytes of embeddings the workers loaded into vLLM's encoder cache",
    "requests_failed": "Requests failed because an image's embeddings could not be had",
}


class EncoderServicePromMetrics(ECConnectorPromMetrics):
    """The connector's counters on vLLM's /metrics, ``vllm:encoder_service_ec_<counter>_total`` with
    vLLM's engine labels: unlike the "EC Transfer metrics" log line (which vLLM writes at DEBUG level,
    and so drops, for an interval it judges idle), a counter keeps every increment."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {name: self._counter_cls(name=f"vllm:encoder_service_ec_{name}",
                                                  documentation=_COUNTER_HELP[name], labelnames=labelnames)
                          for name in _COUNTERS}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in (transfer_stats_data or {}).items():
            if name in self._counters and value:
                self._counters[name].labels(*labels).inc(value)


def engine_preprocess(vllm_config: VllmConfig) -> str:
    """The encoder preprocess mode (ModelInfo.preprocess) that equals vLLM's own image processor:
    transformers' backend as transformers resolves it for vLLM's processor (``backend`` or the
    deprecated ``use_fast`` in the engine's ``--mm-processor-kwargs``, else torchvision where it is
    installed, else PIL)."""
    model_config = vllm_config.model_config
    kwargs = dict((model_config.mm_processor_kwargs or {}) if model_config is not None else {})
    backend = kwargs.get("backend")
    if backend is None and kwargs.get("use_fast") is not None:
        backend = "torchvision" if kwargs["use_fast"] else "pil"
    if backend is None:
        from transformers.utils import is_torchvision_available

        backend = "torchvision" if is_torchvision_available() else "pil"
    return ENCODER_MODE_OF_BACKEND.get(str(backend), "torch")


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES:
        raise ValueError(f"EncoderServiceECConnector: dtype {dtype!r} is not one of {sorted(_TORCH_DTYPES)}")
    return name


class EncoderServiceECConnector(ECConnectorBase):
    """An EC consumer whose encoder outputs come from encoder-service (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        if self.is_producer:
            raise ValueError("EncoderServiceECConnector is a consumer only (ec_role ec_consumer): the encoder "
                             "service is the producer")
        ec_config = vllm_config.ec_transfer_config
        self.settings = ConnectorSettings.from_extra_config(ec_config.ec_connector_extra_config)
        model_dtype = vllm_config.model_config.dtype if vllm_config.model_config is not None else "float32"
        self.dtype = _TORCH_DTYPES[_dtype_name(self.settings.dtype or model_dtype)]
        self.stager: EmbeddingStager | None = None
        self._pending_loads: dict[str, StagedItem] = {}
        self._loaded: list[str] = []
        self._worker_stats: dict[str, int] = {}
        if role == ECConnectorRole.SCHEDULER:
            pc = vllm_config.parallel_config
            # Every rank of the stage loads each item and reports it (the mp executor gathers them all).
            reports = (pc.tensor_parallel_size * pc.prefill_context_parallel_size
                       if pc.distributed_executor_backend == "mp" else 1)
            self.stager = EmbeddingStager(self.settings, reports_per_load=reports,
                                          output_dtype=self.settings.output_dtype or _dtype_name(self.dtype),
                                          log=logger, engine_preprocess=engine_preprocess(vllm_config))
            logger.info("EncoderServiceECConnector: encoder %s, staging in %s, tensors in %s, preprocessing %s "
                        "(preprocess_check %s)", self.settings.encoder, self.stager.staging.directory, self.dtype,
                        self.stager.engine_preprocess, self.settings.preprocess_check)

    # --- scheduler side -------------------------------------------------------------------------------
    def _items(self, request: Request, num_computed_tokens: int) -> list[tuple[str, int]]:
        """(identifier, embeddings) of the request's items this connector serves and still needs."""
        out = []
        for feature in request.mm_features:
            pos = feature.mm_position
            if feature.modality in self.settings.modalities and pos.offset + pos.length > num_computed_tokens:
                out.append((feature.identifier, pos.get_num_embeds()))
        return out

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        assert self.stager is not None
        items = self._items(request, num_computed_tokens)
        return self.stager.ensure(request.request_id, items) if items else True

    def has_cache_item(self, identifier: str) -> bool:
        assert self.stager is not None
        return self.stager.is_staged(identifier)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        assert self.stager is not None
        mm_hash = request.mm_features[index].identifier
        if mm_hash not in self._pending_loads:
            item = self.stager.plan_load(mm_hash)
            if item is not None:
                self._pending_loads[mm_hash] = item

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> EncoderServiceECMetadata:
        meta = EncoderServiceECMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads = {}
        return meta

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        meta = connector_output.ec_connector_worker_meta
        if isinstance(meta, EncoderServiceECWorkerMetadata) and self.stager is not None:
            self.stager.loads_done(meta.loaded)

    def take_unavailable_requests(self) -> set[str]:
        assert self.stager is not None
        failed = self.stager.take_failed()
        self.stager.stats["requests_failed"] += len(failed)
        return set(failed)

    def update_state_after_free(self, request: Request, index: int) -> None:
        if self.stager is not None:
            self.stager.release(request.request_id, request.mm_features[index].identifier)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        if self.stager is not None:
            self.stager.release(request.request_id)
        return False, None

    # --- worker side ----------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        from vllm.platforms import current_platform

        device_type = current_platform.device_type or "cpu"
        if current_platform.is_cuda_alike():
            return torch.device(device_type, current_platform.current_device())
        return torch.device(device_type)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, EncoderServiceECMetadata)
        device = self._device() if metadata.loads else None
        for item in metadata.loads:
            self._loaded.append(item.content_hash)  # reported whatever happens: the scheduler unpins it
            if item.content_hash in encoder_cache:
                continue
            try:
                with open_staged(item.path) as (data, shape, dtype, _):
                    staged = torch.frombuffer(data, dtype=_TORCH_DTYPES[dtype]).view(shape)
                    tensor = staged.to(device=device, dtype=self.dtype, copy=True)
                    del staged
            except (OSError, ValueError, KeyError) as err:
                logger.error("EncoderServiceECConnector: cannot load staged %s (%s): %s", item.content_hash,
                             item.path, err)
                continue
            encoder_cache[item.content_hash] = tensor
            self._worker_stats["items_loaded"] = self._worker_stats.get("items_loaded", 0) + 1
            self._worker_stats["bytes_loaded"] = self._worker_stats.get("bytes_loaded", 0) + item.nbytes

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        return None  # a consumer only: the encoder service produces

    def build_connector_worker_meta(self) -> EncoderServiceECWorkerMetadata | None:
        if not self._loaded:
            return None
        meta, self._loaded = EncoderServiceECWorkerMetadata(loaded=self._loaded), []
        return meta

    # --- both -----------------------------------------------------------------------------------------
    def get_ec_connector_stats(self) -> EncoderServiceECStats | None:
        if self.stager is not None:
            data, self.stager.stats = dict(self.stager.stats), type(self.stager.stats)()
        else:
            data, self._worker_stats = self._worker_stats, {}
        stats = EncoderServiceECStats(data=data)
        return None if stats.is_empty() else stats

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> EncoderServiceECStats | None:
        return EncoderServiceECStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> EncoderServicePromMetrics:
        return EncoderServicePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.stager is not None:
            self.stager.close()
