"""Which kind of input an embedding comes from, one name for one concept: the modality is ``"image"``
or ``"video"`` everywhere in code (the input kind, the metric label, the argument that says which
rule applies), and "clip" is only the English noun for one video input in messages and docstrings.

A leaf module (it imports nothing of the package) so that every layer, from the metrics down to
the models, names the modality with the same type.
"""

from __future__ import annotations

from typing import Literal, get_args

Modality = Literal["image", "video"]
MODALITIES: tuple[Modality, ...] = get_args(Modality)
