"""Imported by a video decode process before it says it is ready (``VideoDecodePool(preload=...)``): a decoder
that takes seconds to start, as a cold one does on a busy host (tests/video/test_video_decode.py)."""

import time

time.sleep(4.0)
