"""Suite-wide settings.

The suite runs on the CPU wherever it runs: on a GPU machine ``accelerate`` would otherwise place
every ``fit`` on the device, and tests compare against CPU tensors. ``tests/test_cuda.py`` opts
out to test the device path itself.
"""

import pytest


@pytest.fixture(autouse=True)
def cpu_accelerator(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
