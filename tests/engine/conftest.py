"""Fixtures shared by the engine tests of this folder (tests/engine/):

- ``stand_in``: ``--decode nvjpeg`` made available on the CPU, with the Pillow stand-in of
  nvjpeg_stand_in.py as its device decoder (test_nvjpeg_decode.py, test_nvjpeg_devices.py).

Their plain helpers are in modules of their own (nvjpeg_stand_in.py here; ../engine_helpers.py for the
engine around the fake model, which other folders use too).
"""

from __future__ import annotations

import pytest
from nvjpeg_stand_in import PillowStandIn

from encoder_service.preprocess import nvjpeg


@pytest.fixture
def stand_in(monkeypatch):
    """nvjpeg made 'available' on the CPU, with the Pillow stand-in as its device decoder."""
    decoder = PillowStandIn()
    monkeypatch.setattr(nvjpeg, "device_decode", decoder)
    monkeypatch.setattr(nvjpeg, "check_available", lambda device: None)
    return decoder
