"""Checks that canonicalisation, a random symmetry and export preserve a model's function.

``hf-lmc check`` runs these on user models (or on the embedded tiny configs below), so a user
can see, on their own checkpoint, that the rewrite ``hf_lmc`` merges through is exact.
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.models.llama import modeling_llama
from transformers.utils import logging as hf_logging

from hf_lmc.canonical.adapters import ADAPTERS, adapter_for
from hf_lmc.canonical.form import canonicalize, to_hf
from hf_lmc.config.options import DEFAULT_SYMMETRIES
from hf_lmc.symmetry import random_symmetry


def tiny_configs() -> dict[str, PretrainedConfig]:
    """One small config per registered family, by model type: each adapter's
    :attr:`~hf_lmc.canonical.adapters.base.Adapter.tiny_config` (GQA, partial rotary and biases included)."""
    families = {}
    for model_type, adapter in ADAPTERS.items():
        families.setdefault(type(adapter), (model_type, adapter))
    return {model_type: adapter.tiny() for model_type, adapter in families.values()}


def sample_inputs(
    config: PretrainedConfig, seed: int = 0, dtype: torch.dtype = torch.float32, batch: int = 2, length: int = 9
):
    """Random model inputs: token ids for language models, pixels for ViT."""
    g = torch.Generator().manual_seed(seed)
    if adapter_for(config).takes_images:
        shape = (batch, config.num_channels, config.image_size, config.image_size)
        return {"pixel_values": torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)}
    return {"input_ids": torch.randint(0, config.vocab_size, (batch, length), generator=g)}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |actual - expected| / max |expected|``."""
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def _rmsnorm_without_downcast(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@contextlib.contextmanager
def float64_rmsnorm():
    """HF's LlamaRMSNorm computes in float32 even for float64 inputs (a 1e-7 floor on any
    comparison of two different parameterisations). For float64 exactness tests, run the same
    formula without the downcast; float32 tests use the stock module unchanged."""
    original = modeling_llama.LlamaRMSNorm.forward
    modeling_llama.LlamaRMSNorm.forward = _rmsnorm_without_downcast
    try:
        yield
    finally:
        modeling_llama.LlamaRMSNorm.forward = original


@torch.no_grad()
def _logits(model: PreTrainedModel, inputs) -> torch.Tensor:
    return model(**inputs).logits


@dataclass(frozen=True)
class ExactnessReport:
    """Relative logit errors of each rewrite against the original model."""

    model_type: str
    parameters: int
    canonical: float
    symmetry: float
    reloaded: float

    @property
    def worst(self) -> float:
        return max(self.canonical, self.symmetry, self.reloaded)


def check_exactness(model: PreTrainedModel, *, seed: int = 0, symmetries: str = DEFAULT_SYMMETRIES) -> ExactnessReport:
    """Compare ``model``'s logits with those of its canonical export, of a random symmetry of
    it, and of that symmetry after ``save_pretrained`` + ``from_pretrained``."""
    model = model.eval()
    dtype = next(model.parameters()).dtype
    exact = float64_rmsnorm() if dtype == torch.float64 else contextlib.nullcontext()
    with exact, _quiet_transformers():
        return _check(model, dtype, seed, symmetries)


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' own per-file progress bars and config warnings would drown the report."""
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(verbosity)


def _check(model: PreTrainedModel, dtype: torch.dtype, seed: int, symmetries: str) -> ExactnessReport:
    inputs = sample_inputs(model.config, seed=seed, dtype=dtype)
    expected = _logits(model, inputs)
    canonical = canonicalize(model)
    transform = random_symmetry(canonical.spec, seed=seed, kinds=symmetries, dtype=dtype)
    plain = relative_error(_logits(to_hf(canonical), inputs), expected)
    moved = to_hf(transform.apply(canonical))
    symmetric = relative_error(_logits(moved, inputs), expected)
    with tempfile.TemporaryDirectory() as folder:
        moved.save_pretrained(folder)
        reloaded = type(moved).from_pretrained(Path(folder), dtype=dtype).eval()
        reload_err = relative_error(_logits(reloaded, inputs), expected)
    return ExactnessReport(
        model.config.model_type, sum(p.numel() for p in model.parameters()), plain, symmetric, reload_err
    )
