"""A callback that code running on a thread calls where the code that started it set one: how a long
CPU step learns, without a parameter through every call between, that it should stop
(``interrupt.py``), that a clip is over the server's budgets (``staged.clip_budget``), or where a
decode may write its pixels (``decode.decode_into``)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class ThreadHook:
    """``with hook.set(fn):`` on a thread, ``hook(*args)`` there calls ``fn(*args)`` and returns what it
    returns; a no-op (None) outside such a block. Per thread, so that concurrent steps each have their
    own; blocks nest."""

    def __init__(self) -> None:
        self._local = threading.local()

    @contextlib.contextmanager
    def set(self, fn: Callable[..., None]) -> Iterator[None]:
        previous = getattr(self._local, "fn", None)
        self._local.fn = fn
        try:
            yield
        finally:
            self._local.fn = previous

    def __call__(self, *args: object) -> object:
        fn = getattr(self._local, "fn", None)
        return None if fn is None else fn(*args)
