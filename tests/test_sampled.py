"""Fitting data sampled from the models themselves (``--data sampled``): sequences drawn from
each model's own next-token distribution, in equal shares, reproducible, and refused where it
cannot mean anything (image models, evaluation data)."""

from __future__ import annotations

import pytest
import torch

from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.cli import main
from hf_lmc.config.options import EvalOptions
from hf_lmc.config.recipe import load_recipe
from hf_lmc.evaluation.batches import SAMPLED, DataError, fitting_batches, load_batches, sample_batches
from hf_lmc.merging.sweep import load_data
from tests.models import MODEL_CLASSES, build_model, char_tokenizer_folder

LANGUAGE_MODELS = ("gpt2", "gpt_neox", "llama")


def _reference_draws(model, first: torch.Tensor, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """The same draws as the sampler, each step from a full forward over the sequence so far (no cache)."""
    ids = first
    with torch.no_grad():
        for _ in range(seq_len - 1):
            probabilities = model(input_ids=ids).logits[:, -1].float().softmax(-1)
            ids = torch.cat([ids, torch.multinomial(probabilities, 1, generator=generator)], dim=1)
    return ids


@pytest.mark.parametrize("arch", LANGUAGE_MODELS)
def test_the_cached_draws_are_those_of_the_model_read_whole(arch):
    """The key-value cache changes nothing: every token is drawn from the distribution a full
    forward over the sequence so far gives (float64 models, one generator seed)."""
    config = tiny_configs()[arch]
    config.bos_token_id = None  # a uniformly drawn first token
    model = build_model(config)
    seq_len = 7
    (batch,) = sample_batches([model], seq_len, EvalOptions(batch_size=5, max_batches=1), seed=3, progress=False)
    generator = torch.Generator().manual_seed(3)
    first = torch.randint(0, config.vocab_size, (5, 1), generator=generator)
    expected = _reference_draws(model, first, seq_len, generator)
    drawn = batch["input_ids"]
    assert drawn.shape == (5, seq_len) and drawn.dtype == torch.long
    assert sorted(map(tuple, drawn.tolist())) == sorted(map(tuple, expected.tolist()))


def test_draws_follow_the_models_distribution_with_no_token_left_out():
    """``generate`` would fold in a checkpoint's generation config (top-k, an end-of-sequence
    token that min-length rules suppress); the sampler draws every token at its own probability."""
    config = tiny_configs()["llama"]
    config.bos_token_id, config.eos_token_id = 1, 2
    model = build_model(config)
    model.generation_config.top_k, model.generation_config.eos_token_id = 2, 2
    (batch,) = sample_batches([model], 2, EvalOptions(batch_size=20000, max_batches=1), progress=False)
    assert (batch["input_ids"][:, 0] == 1).all()  # every sequence starts at BOS
    with torch.no_grad():
        probabilities = model(input_ids=torch.tensor([[1]])).logits[0, -1].float().softmax(-1)
    frequencies = torch.bincount(batch["input_ids"][:, 1], minlength=config.vocab_size).float() / 20000
    sigma = (probabilities * (1 - probabilities) / 20000).sqrt()
    assert ((frequencies - probabilities).abs() <= 5 * sigma + 1e-4).all(), (frequencies, probabilities)


def test_equal_shares_shuffled_reproducible_and_the_callers_rng_untouched():
    config = tiny_configs()["gpt2"]
    config.bos_token_id = None
    models = [build_model(config, seed=1), build_model(config, seed=2)]
    loads = []

    def loader(k):
        def load():
            loads.append(k)
            return models[k]

        return load

    state = torch.get_rng_state()
    options = EvalOptions(batch_size=4, max_batches=3)
    first = sample_batches([loader(0), loader(1)], 5, options, seed=0, progress=False)
    assert torch.equal(torch.get_rng_state(), state)
    assert loads == [0, 1]  # each model loaded when its turn came
    assert [b["input_ids"].shape for b in first] == [(4, 5)] * 3
    again = sample_batches(models, 5, options, seed=0, progress=False)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(first, again))
    other = sample_batches(models, 5, options, seed=1, progress=False)
    assert not all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(first, other))
    # each model's own six sequences, as it draws them alone
    rows = {tuple(r) for b in first for r in b["input_ids"].tolist()}
    for k, model in enumerate(models):
        (alone,) = sample_batches([model], 5, EvalOptions(batch_size=6, max_batches=1), seed=k, progress=False)
        assert {tuple(r) for r in alone["input_ids"].tolist()} <= rows


def test_the_default_count_and_the_sequence_length_follow_the_fitting_options():
    config = tiny_configs()["gpt_neox"]
    model = build_model(config, dtype=torch.float32)
    batches = fitting_batches(
        SAMPLED,
        config,
        None,
        EvalOptions(batch_size=4, max_batches=2, seq_len=6),
        models=[model, model],
        progress=False,
    )
    assert [b["input_ids"].shape for b in batches] == [(4, 6), (4, 6)]
    with pytest.raises(DataError, match="context"):
        fitting_batches(SAMPLED, config, None, EvalOptions(seq_len=10_000), models=[model], progress=False)


def test_sampled_data_is_refused_for_images_for_evaluation_and_beside_a_folder_of_that_name(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="image"):
        fitting_batches(SAMPLED, tiny_configs()["vit"], None, EvalOptions(), models=[], progress=False)
    with pytest.raises(DataError, match="held-out"):
        load_batches(SAMPLED, tiny_configs()["gpt2"], None)
    monkeypatch.chdir(tmp_path)
    (tmp_path / SAMPLED).mkdir()
    with pytest.raises(DataError, match=f"./{SAMPLED}"):
        fitting_batches(SAMPLED, tiny_configs()["gpt2"], None, EvalOptions(), models=[], progress=False)


def test_a_recipe_names_sampled_fitting_data_and_not_sampled_evaluation_data():
    models = {"models": ["./a", "./b"], "method": "learned", "output": {"dir": "out"}}
    recipe = load_recipe({**models, "data": {"sampled": True, "samples": 64}})
    assert recipe.data.options(EvalOptions(batch_size=32)).max_batches == 2
    assert load_data(recipe.data, "train") == SAMPLED  # what the pipeline then samples
    for bad in (
        {"data": {"sampled": True, "zoo": "shakespeare"}},
        {"data": {"zoo": "shakespeare"}, "eval": {"data": {"sampled": True}}},
    ):
        with pytest.raises(ValueError, match="sampled"):
            load_recipe({**models, **bad})


@pytest.mark.slow
def test_learned_merge_on_sampled_data_from_the_command_line(tmp_path):
    """``hf-lmc merge --method learned --data sampled``: no data of one's own, and the card says what it trained on."""
    config = tiny_configs()["llama"]
    folders = []
    for seed, name in ((1, "a"), (2, "b")):
        build_model(config, seed=seed, dtype=torch.float32).save_pretrained(tmp_path / name)
        folders.append(str(char_tokenizer_folder(tmp_path / name, config.vocab_size)))
    rc = main(
        [
            "merge",
            *folders,
            "-o",
            str(tmp_path / "m"),
            "--method",
            "learned",
            "--data",
            SAMPLED,
            "--max-batches",
            "3",
            "--batch-size",
            "4",
            "--seq-len",
            "8",
            "--steps",
            "3",
            "--quiet",
        ]
    )
    assert rc == 0
    MODEL_CLASSES["llama"].from_pretrained(tmp_path / "m")
    card = (tmp_path / "m" / "README.md").read_text()
    assert "sequences sampled from the models" in card and "12 sequences drawn at temperature 1" in card
