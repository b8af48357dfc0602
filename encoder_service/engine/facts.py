"""What the engine states about what it serves: the pixel limit in force and where it comes from,
and the served model's facts as one ``ModelInfo`` (GetModelInfo's answer, the start-up log)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from encoder_client.protocol.model_info import ModelInfo

from ..preprocess import decode


@dataclass(frozen=True)
class PixelLimits:
    """The pixel limit in force (--max-image-pixels; -1: derived from the model's max_pixels) and
    the size above which an image decodes in the expensive pool (the derived default)."""

    configured: int  # --max-image-pixels as given
    model_max_pixels: int | None  # the model's preprocessing max_pixels, when it states one
    ordinary: int  # the derived limit: larger images decode in the expensive pool
    in_force: int

    @classmethod
    def derive(cls, configured: int, front: object | None) -> PixelLimits:
        max_pixels = None
        if front is not None:
            max_pixels = decode.model_max_pixels(getattr(front.decoder, "config", None))
        ordinary = decode.derived_pixel_limit(max_pixels)
        return cls(configured, max_pixels, ordinary, ordinary if configured == -1 else configured)

    def rule(self) -> str:
        """The pixel limit in force and where it comes from, for the start-up log."""
        if self.configured != -1:
            return f"{self.in_force} (--max-image-pixels)"
        if self.model_max_pixels is None:
            return f"{self.in_force} (the model states no max_pixels)"
        multiple = decode.PIXEL_LIMIT_MAX_PIXELS_MULTIPLE
        if self.in_force < multiple * self.model_max_pixels:
            return (f"{self.in_force} (the cap: {multiple} x the model's max_pixels "
                    f"{self.model_max_pixels} is more)")
        return f"{self.in_force} ({multiple} x the model's max_pixels {self.model_max_pixels})"


def model_info(*sources, info_type: type[ModelInfo] = ModelInfo) -> ModelInfo:
    """A ``ModelInfo`` whose fields are read by name from ``sources`` (mappings or objects), the
    first that has a field winning; a field no source has keeps its default (TypeError without one)."""
    values = {}
    for field in fields(info_type):
        for source in sources:
            if isinstance(source, dict):
                if field.name in source:
                    values[field.name] = source[field.name]
                    break
            elif hasattr(source, field.name):
                values[field.name] = getattr(source, field.name)
                break
    return info_type(**values)
