"""Loading the model the engine serves: one place for the flags that shape it (model, device,
dtype, attention backend, fused operations' providers, preprocessing mode, CUDA graphs), used by
the in-process worker and by every worker process alike."""

from __future__ import annotations

import logging

from ..config import LoadingConfig
from ..models.cuda_graphs import resolve_budgets
from ..models.served import ServedModel
from ..preprocess.decoders import image_decoder

log = logging.getLogger(__name__)


def load_model(config: LoadingConfig, device: str | None = None) -> ServedModel:
    """The configured model on ``device`` (``config.device``, --device, by default), warm-up not yet run.
    Takes the loading group only: it is what a worker process is sent (process_worker.py)."""
    from ..models import load_vision_model  # pulls in torch and the kernels: not at import time

    model = load_vision_model(config.model_or_default, device=device or config.device, dtype=config.dtype,
                              attn_backend=config.attn_backend, preprocess=config.preprocess,
                              ops=config.ops, quantization=config.quantization)
    if model.quantization:
        log.info("quantization %s on %s: the blocks' linears in e4m3 (cache namespace %s)", model.quantization,
                 model.device, model.cache_namespace)
    model.set_decode(config.decode)
    model.set_video_decode(config.video_decode)
    if not image_decoder(model.decode_backend).default:  # say where images decode when it is not the usual way
        log.info("images: JPEGs decode on %s with %s, other formats with Pillow (cache namespace %s)",
                 model.device, model.decode_backend, model.cache_namespace)
    model.set_cuda_graphs(resolve_budgets(config.cuda_graph_budgets, config.max_batch_tokens, model.spec.merge_unit))
    if model.graphs is not None:
        log.info("CUDA graphs on %s: token budgets %s (patches), captured at start-up", model.device,
                 ",".join(map(str, model.graphs.budgets)))
    else:
        log.info("CUDA graphs on %s: off (cuda-graphs %s, attention backend %s)", model.device,
                 config.cuda_graphs, model.attn_backend)
    return model
