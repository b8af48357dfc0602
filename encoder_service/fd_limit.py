"""Raises the soft limit on open files at start-up, as vLLM and SGLang do.

A server holds descriptors by the request, not by the process: a gRPC connection each, a relay region
each, and, before Python 3.13 (whose ``mmap`` can do without), one per decoded clip whose frames wait
for a forward (``preprocess/decoder_channel.py``: the frames are mapped, and ``mmap`` keeps a duplicate
of the descriptor it maps). The soft limit many hosts start
processes with is 1024, far under the hard limit; a server at the soft limit fails calls with
"Too many open files" while the host has room.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

TARGET = 65536  # enough for every descriptor the server holds by the request; no more is asked for


def raise_open_file_limit(target: int = TARGET) -> int:
    """Raises the soft RLIMIT_NOFILE towards ``target``, never past the hard limit nor lowering it;
    returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (OSError, ValueError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, wanted, e)
            return soft
        return wanted
    return soft
