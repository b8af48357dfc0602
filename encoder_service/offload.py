"""Blocking work run in a thread that stops, and is waited for, when its caller is cancelled.

``loop.run_in_executor`` alone leaves the thread running when the awaiting task is cancelled: the
request is gone, but its decode goes on holding a decoder (and whatever slot its caller held is
given back while the work still runs, so the next caller's work queues behind it unseen). Here the
work is told to stop (``stop``, which it checks between pieces) and the cancelled caller returns
only once the thread is done, so a slot held around it is given back exactly when it frees up."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TypeVar

T = TypeVar("T")


async def run_to_the_end(executor: Executor, fn: Callable[..., T], *args, stop: threading.Event) -> T:
    """``fn(*args)`` in ``executor``. Cancelled while it runs: sets ``stop``, waits until ``fn``
    returns (it must check ``stop`` and return soon), then raises the CancelledError."""
    future = asyncio.get_running_loop().run_in_executor(executor, fn, *args)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        stop.set()
        while not future.done():
            try:
                await asyncio.wait({future})
            except asyncio.CancelledError:  # cancelled again: still wait, the thread is about to end
                continue
        if not future.cancelled():
            future.exception()  # retrieved: nobody else will look at it
        # The CancelledError's traceback keeps this frame: without the future, it keeps no error of the
        # thread's (whose traceback holds the work's frames and the bytes they held).
        del future
        raise
