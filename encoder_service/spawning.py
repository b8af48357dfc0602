"""One lock around every child process start of the server: worker processes are started with
CUDA_VISIBLE_DEVICES set in this process's environment for the moment of their spawn
(engine/process_worker.py), and any other child started meanwhile (a video decoder process,
preprocess/video_pool.py) would inherit that one-GPU view."""

from __future__ import annotations

import threading

SPAWN_LOCK = threading.Lock()
