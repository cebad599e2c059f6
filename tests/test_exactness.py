"""Canonicalisation, every symmetry and export are function-preserving, for every architecture.

Each example draws a random small config, builds a stock HF model perturbed away from init,
and compares its logits with those of:
  * ``to_hf(canonicalize(m))``,
  * ``to_hf(random_symmetry.apply(canonicalize(m)))``,
  * both after ``save_pretrained`` + ``from_pretrained``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hf_lmc
from tests.models import (
    ARCHITECTURES,
    CONFIGS,
    MODEL_CLASSES,
    build_model,
    float64_rmsnorm,
    logits,
    relative_error,
    sample_inputs,
)

PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}


def check_function_preserved(config, seed: int, dtype: torch.dtype, tmp_path) -> None:
    exact = contextlib.nullcontext() if dtype == torch.float32 else float64_rmsnorm()
    with exact:
        model = build_model(config, seed=seed, dtype=dtype)
        inputs = sample_inputs(config, seed=seed, dtype=dtype)
        expected = logits(model, inputs)
        canonical = hf_lmc.canonicalize(model)
        transform = hf_lmc.random_symmetry(canonical.spec, seed=seed, dtype=dtype)
        for label, candidate in (("canonical", canonical), ("symmetry", transform.apply(canonical))):
            exported = hf_lmc.to_hf(candidate)
            assert type(exported) is type(model)
            err = relative_error(logits(exported, inputs), expected)
            assert err < TOLERANCE[dtype], f"{label}: relative error {err:.2e}"

            folder = tmp_path / f"{label}-{seed}"
            exported.save_pretrained(folder)
            reloaded = MODEL_CLASSES[config.model_type].from_pretrained(folder, dtype=dtype).eval()
            err = relative_error(logits(reloaded, inputs), expected)
            assert err < TOLERANCE[dtype], f"{label} after save/load: relative error {err:.2e}"


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize(
    "dtype", [torch.float64, pytest.param(torch.float32, marks=pytest.mark.slow)], ids=["float64", "float32"]
)  # float64: the fast tier
def test_canonical_symmetry_and_export_preserve_logits(arch, dtype, tmp_path_factory):
    @PROPERTY
    @given(config=CONFIGS[arch](), seed=st.integers(0, 2**16))
    def run(config, seed):
        check_function_preserved(config, seed, dtype, tmp_path_factory.mktemp(arch))

    run()


def test_every_registered_family_is_exercised_by_the_exactness_suite():
    """A family is tested once its adapter is registered: its tiny config comes from the adapter
    (``ARCHITECTURES``, over which this suite is parametrised), and the randomised configs must
    name it (a new adapter without a strategy fails here, not silently untested)."""
    from hf_lmc.canonical.adapters import ADAPTERS
    from tests.models import ARCHITECTURES, CONFIGS

    families = {type(adapter) for adapter in ADAPTERS.values()}
    covered = {type(ADAPTERS[model_type]) for model_type in ARCHITECTURES}
    assert covered == families and set(CONFIGS) == set(ARCHITECTURES)
