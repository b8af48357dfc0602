"""Stopping a long CPU step (a clip's decode, its frames' resize) between two of its pieces.

A thread cannot be killed, and a decode or resize may run for seconds: long after its request was
cancelled or its time bound passed. The code doing it calls ``check()`` between pieces (a frame, a
group of frames); the code that started it says, with ``interrupt_when(fn)``, what stops it: ``fn``
raises (a ``Cancelled``, a ``DecodeTimeout``) when the work is no longer wanted. Per thread, so
that concurrent steps each have their own."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

from .thread_hook import ThreadHook

_stop = ThreadHook()


def interrupt_when(stop: Callable[[], None]) -> AbstractContextManager[None]:
    """Within the block, ``check()`` on this thread calls ``stop`` (which raises to stop the work)."""
    return _stop.set(stop)


def check() -> None:
    """Raises what this thread's ``interrupt_when`` says, if anything; a no-op outside of one."""
    _stop()
