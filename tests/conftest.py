"""Suite-wide settings.

The suite runs on the CPU wherever it runs: on a GPU machine ``accelerate`` would otherwise place
every ``fit`` on the device, and tests compare against CPU tensors. ``tests/test_cuda.py`` opts
out to test the device path itself.
"""

import os

import pytest
from hypothesis import settings

from hf_lmc.utils.progress import SILENCING

# CI draws the same examples on every run (Hypothesis's advice for CI): a red CI is then a
# regression, reproducible, not a fresh draw. Local runs keep drawing new examples, which is how
# ill-conditioned corners are found: so far a GPT-2 of width 2 (its centred stream is one-
# dimensional, so LayerNorm is a sign function there) past float32's 1e-4, not float64's 1e-9.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True)
def cpu_accelerator(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")


@pytest.fixture(autouse=True)
def unsilenced(monkeypatch):
    """Each test starts with progress and announcements on, whatever the shell running the suite
    sets (``TQDM_DISABLE=1`` there once hid the line ``explain`` prints before its passes); a test
    of silencing sets the variables itself."""
    for name in SILENCING:
        monkeypatch.delenv(name, raising=False)
