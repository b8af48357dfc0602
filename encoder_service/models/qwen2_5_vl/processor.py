"""The preprocessing hooks of ``VisionModel`` for towers fed by transformers' ``Qwen2VLImageProcessor``
(Qwen2.5-VL at patch 14, Qwen3-VL and Qwen3.5 at patch 16): one implementation for every family
that uses that processor (``preprocess.py`` beside this file)."""

from __future__ import annotations

import torch

from ..base import Decoder
from . import preprocess as qwen2_vl


class Qwen2VLProcessorHooks:
    """Mixed in before ``VisionModel``; the model sets ``preprocess_config`` (a Qwen2VLPreprocessConfig)."""

    preprocess_config: qwen2_vl.Qwen2VLPreprocessConfig
    preprocess_mode: str

    def decoder(self) -> Decoder:
        return Decoder(qwen2_vl.decode_qwen2_vl, self.preprocess_config, self.preprocess_mode, qwen2_vl.geometry)

    def _check_preprocess_mode(self, mode: str) -> None:
        qwen2_vl.check_mode(self.preprocess_config, mode)

    def _value_table(self) -> torch.Tensor:
        return qwen2_vl.value_table(self.preprocess_config, self.preprocess_mode)

    def _patchify(self, image: torch.Tensor) -> torch.Tensor:
        return qwen2_vl.patchify(image, self.preprocess_config)
