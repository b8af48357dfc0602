"""Stage timestamps inside a server process, for bench/stage_trace.py (a diagnostic; not imported otherwise).

With ``STAGE_TRACE_OUT`` set and this folder on PYTHONPATH, a process that imports the service wraps the
functions of a request's path listed in ``STAGES`` and appends ``perf_counter_ns tag thread`` lines to
``STAGE_TRACE_OUT`` after each Encode call (``>`` entered, ``<`` left, ``-yield`` / ``-resume`` around a
generator's items). perf_counter is the host's monotonic clock, so a client's own timestamps line up. The
wrappers go in once every module they name is imported (checked at each import), before the server runs.
"""

from __future__ import annotations

import builtins
import functools
import importlib
import inspect
import os
import sys
import threading
import time

# (module, attribute path, tag)
STAGES = (
    ("encoder_service.api.service_interceptor", "ServiceInterceptor.intercept_service", "intercept"),
    ("encoder_service.api.servicer", "VisionEncoderServicer.Encode", "Encode"),
    ("encoder_service.engine.engine", "Engine.encode", "engine"),
    ("encoder_service.engine.engine", "content_keys", "hash"),
    ("encoder_service.engine.engine", "Engine._prepare_sync", "prepare"),
    ("encoder_service.engine.engine", "Engine._enqueue", "enqueue"),
    ("encoder_service.engine.batch_queue", "BatchQueue.take_batch", "take"),
    ("encoder_service.models.base", "VisionModel.encode_inputs_async", "launch"),
    ("encoder_service.models.base", "VisionModel.pixel_values", "pixels"),
    ("encoder_service.models.cuda_graphs", "BudgetGraphs.run", "graph"),
    ("encoder_service.models.base", "PendingEmbeddings.wait_packed", "wait"),
    ("encoder_service.engine.warm_memory", "WarmBuffers.copies", "warm_copy"),
    ("encoder_service.engine.engine", "Engine._on_batch_done", "batch_done"),
    ("encoder_service.engine.types", "ImageResult.wire_bytes", "wire_bytes"),
    ("encoder_service.api.servicer", "_response_chunks", "chunks"),
    ("encoder_service.api.shared_memory", "RegionWriter.place", "region_copy"),
)

_events: list[tuple[int, str, str]] = []
_flushed = 0


def record(tag: str) -> None:
    global _flushed
    _events.append((time.perf_counter_ns(), tag, threading.current_thread().name))
    if tag == "Encode<":
        with open(os.environ["STAGE_TRACE_OUT"], "a") as out:
            out.writelines(f"{t} {name} {thread}\n" for t, name, thread in _events[_flushed:])
        _flushed = len(_events)


def _wrapped(fn, tag: str):
    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def agen(*args, **kwargs):
            record(tag + ">")
            inner = fn(*args, **kwargs)
            try:
                async for item in inner:
                    record(tag + "-yield")
                    yield item
                    record(tag + "-resume")
            finally:
                await inner.aclose()
                record(tag + "<")
        return agen
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def coro(*args, **kwargs):
            record(tag + ">")
            try:
                return await fn(*args, **kwargs)
            finally:
                record(tag + "<")
        return coro
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def gen(*args, **kwargs):
            record(tag + ">")
            for item in fn(*args, **kwargs):
                record(tag + "-yield")
                yield item
            record(tag + "<")
        return gen

    @functools.wraps(fn)
    def plain(*args, **kwargs):
        record(tag + ">")
        try:
            return fn(*args, **kwargs)
        finally:
            record(tag + "<")
    return plain


def _ready() -> bool:
    for module, path, _ in STAGES:
        owner = sys.modules.get(module)
        for name in path.split(".")[:-1]:
            owner = getattr(owner, name, None)
        if owner is None or not hasattr(owner, path.split(".")[-1]):
            return False
    return True


def _install() -> None:
    for module, path, tag in STAGES:
        owner = importlib.import_module(module)
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        setattr(owner, name, _wrapped(getattr(owner, name), tag))
    sys.stderr.write("stage trace: installed\n")


if os.environ.get("STAGE_TRACE_OUT"):
    _import = builtins.__import__

    def _import_then_install(*args, **kwargs):
        module = _import(*args, **kwargs)
        if builtins.__import__ is _import_then_install and _ready():
            builtins.__import__ = _import
            _install()
        return module

    builtins.__import__ = _import_then_install
