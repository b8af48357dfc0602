"""torch.compile as the models and the ops' providers use it, with one inductor heuristic widened.

Inductor keeps a reduction's whole row in registers (a "persistent" reduction, one read of the row)
only up to 1,024 elements; a longer row is reduced in a loop and read again to normalise it. The
towers' hidden sizes (1,152 for Qwen3-VL and Kimi-K2.5, 1,280 for Qwen2.5-VL) are just over that, so
each compiled LayerNorm read its row twice: in Qwen3-VL-8B at 8 x 1024x1024 on an H200 the 54 fused
residual + LayerNorm kernels took 9.7 ms of a 125 ms forward, about three times their bytes at the
memory's speed (bench/RESULTS.md). Rows of up to ``PERSISTENT_ROW_LIMIT`` elements are now persistent.
The choice is inductor's own hook (``config.inductor_choices_class``); a torch without it compiles
as before. The hook is process-wide: every torch.compile in a process that served a model (a bench
run in the same process too) compiles with it. A choices class installed by someone else is left
alone, and then rows over 1,024 loop as before.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

PERSISTENT_ROW_LIMIT = 2048
# Part of the uuid that inductor's cache keys take from the choices: change it with the logic below,
# so that kernels compiled under other logic are not served from a persistent cache.
CHOICES_VERSION = 1
_installed: bool | None = None


def _wide_row_choices():
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class WideRowChoices(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features, cooperative_reduction) -> bool:
            if InductorChoices.should_use_persistent_reduction(features, cooperative_reduction):
                return True
            return (not cooperative_reduction and config.triton.persistent_reductions
                    and features.get_reduction_hint() == ReductionHint.INNER
                    and V.graph.sizevars.statically_known_leq(features.reduction_numel, PERSISTENT_ROW_LIMIT))

        def uuid(self) -> str:  # part of inductor's cache key for the kernels it compiles
            return f"encoder-service-persistent-rows-{PERSISTENT_ROW_LIMIT}-v{CHOICES_VERSION}"

    return WideRowChoices()


def install_inductor_choices() -> bool:
    """Once per process, before the first compile: whether inductor takes the widened heuristic."""
    global _installed
    if _installed is None:
        from torch._inductor import config

        if not hasattr(config, "inductor_choices_class"):
            log.info("torch %s has no inductor choices hook: LayerNorms over rows longer than 1,024 "
                     "compile as loops", torch.__version__)
            _installed = False
        elif config.inductor_choices_class not in (None, _wide_row_choices):
            log.info("inductor's choices are already set (%s): leaving them", config.inductor_choices_class)
            _installed = False
        else:
            config.inductor_choices_class = _wide_row_choices
            _installed = True
    return _installed


def compiled(fn, mode: str | None = None):
    """``torch.compile(fn, fullgraph=True, mode=mode)``, inductor's choices installed first.

    Automatic dynamic shapes (dynamic=None): the first batch compiles with static sizes, the first
    different token count recompiles once with only that dimension symbolic. Marking every dimension
    dynamic up front measured 18% slower on the H100 (bench/RESULTS.md)."""
    install_inductor_choices()
    return torch.compile(fn, fullgraph=True, mode=mode)
