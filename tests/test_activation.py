"""Activation matching: restrictions, calibration data forms, padding (twin recovery: test_matching)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import hf_lmc
from hf_lmc.canonical.exactness import tiny_configs
from tests.models import LargestOutput, build_model, sample_inputs


def _calibration(config, batches: int = 4):
    return [sample_inputs(config, seed=100 + s) for s in range(batches)]


@pytest.mark.slow
def test_permutation_only_matching_recovers_a_permuted_twin():
    config = tiny_configs()["gpt_neox"]
    a = hf_lmc.canonicalize(build_model(config, dtype=torch.float64))
    b = hf_lmc.random_symmetry(a.spec, seed=3, kinds="permutation").apply(a).materialize()
    transform = hf_lmc.ActivationMatcher(_calibration(config), "permutation", progress=False).match(a, b)
    for name, tensor in transform.apply(b).state_dict().items():
        torch.testing.assert_close(tensor, a[name], msg=name)


@pytest.mark.parametrize("form", ["tensor", "dict", "dataloader", "generator"])
def test_calibration_data_forms(form):
    config = tiny_configs()["llama"]
    a = hf_lmc.canonicalize(build_model(config, dtype=torch.float64))
    b = hf_lmc.random_symmetry(a.spec, seed=5, kinds="permutation").apply(a).materialize()
    ids = torch.cat([batch["input_ids"] for batch in _calibration(config)])
    data = {
        "tensor": ids,
        "dict": {"input_ids": ids},
        "dataloader": DataLoader([{"input_ids": row} for row in ids], batch_size=3),
        "generator": ({"input_ids": chunk} for chunk in ids.split(2)),
    }[form]
    transform = hf_lmc.ActivationMatcher(data, "permutation", progress=False).match(a, b)
    for name, tensor in transform.apply(b).state_dict().items():
        torch.testing.assert_close(tensor, a[name], msg=name)


def test_padding_tokens_are_ignored():
    """Statistics come only from tokens the attention mask keeps."""
    config = tiny_configs()["gpt2"]
    a = hf_lmc.canonicalize(build_model(config, seed=1))
    b = hf_lmc.canonicalize(build_model(config, seed=2))
    batch = sample_inputs(config, seed=7)
    mask = torch.ones_like(batch["input_ids"])
    mask[:, -3:] = 0
    masked = hf_lmc.ActivationMatcher({**batch, "attention_mask": mask}, progress=False)
    stats = masked._collect(a.spec, a, b)
    assert stats.tokens == int(mask.sum())


def test_empty_calibration_data_is_an_error():
    config = tiny_configs()["gpt2"]
    a = hf_lmc.canonicalize(build_model(config))
    with pytest.raises(ValueError, match="no calibration tokens"):
        hf_lmc.ActivationMatcher([], progress=False).match(a, a)


def test_calibration_never_holds_the_tokens_by_vocabulary_logits():
    """The calibration forward runs the base model: activation matching of a causal LM whose
    vocabulary is far wider than the model returns no tensor of tokens x vocabulary elements."""
    config = tiny_configs()["llama"]
    config.vocab_size = 2048
    a, b = (hf_lmc.canonicalize(build_model(config, seed=s, dtype=torch.float32)) for s in (1, 2))
    ids = torch.randint(0, 2048, (4, 16), generator=torch.Generator().manual_seed(0))
    with LargestOutput() as watch:
        hf_lmc.ActivationMatcher(ids, progress=False).match(a, b)
    assert watch.largest < ids.numel() * config.vocab_size / 4
