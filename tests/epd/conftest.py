"""Fixtures shared by the EPD tests of this folder (tests/epd/):

- ``vllm``: a fake vLLM (fake_vllm.FakeVllm) on a loopback port, one per test module, closed after it
  (test_epd_proxy.py, test_epd_proxy_cache_only.py).

The fake itself and the requests the tests send it are plain helpers in fake_vllm.py.
"""

from __future__ import annotations

import pytest
from fake_vllm import FakeVllm


@pytest.fixture(scope="module")
def vllm():
    fake = FakeVllm()
    yield fake
    fake.served.close()
