"""What the benchmark scripts share (a package, not a script: tests/test_scripts_help.py skips it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def time_backends(names: list[str], load_model: Callable[[str], Any], inputs: Mapping[str, tuple],
                  timer: Callable[[Callable[[], Any]], Any], record: Callable[[str, str, Any], None],
                  results: list[dict]) -> None:
    """For each attention backend in names: load_model(name), then record(name, case, timer(encode))
    for every case of inputs (``{case: (grids, pixels, ...)}``, pixels already on the GPU). A backend
    that fails is printed and recorded in results as an error, and the run goes on."""
    import torch

    for name in names:
        try:
            model = load_model(name)
            for c, (grids, pixels, *_) in inputs.items():
                record(name, c, timer(lambda m=model, p=pixels, g=grids: m.encode_packed(p, g)))
            del model
        except Exception as exc:  # one failing contender must not lose the run
            print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
            results.append({"contender": name, "error": f"{type(exc).__name__}: {exc}"})
        torch.cuda.empty_cache()
