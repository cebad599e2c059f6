"""The offline zoo and ``hf-lmc demo`` (tiny settings: a few training steps)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_lmc import zoo
from hf_lmc.cli import main
from hf_lmc.evaluation import EvalOptions, evaluate, load_batches
from hf_lmc.loading import load_model
from hf_lmc.widths import spec_of


def test_shipped_corpus_splits_by_whole_play():
    train, held = zoo.shakespeare()
    assert len(train) >= 10 and len(held) == 2
    assert not set(train) & set(held)
    tokenizer = zoo.char_tokenizer()
    text = held[0][:500]
    assert tokenizer.decode(tokenizer(text)["input_ids"]).replace(" ", "") == text.replace(" ", "")  # no unknowns
    assert sum(map(len, zoo.held_out("gpt2", size=8192))) == 8192
    with pytest.raises(ValueError, match="no zoo entry 'bert'"):
        zoo.held_out("bert")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "pythia", "llama", "vit"])
def test_members_train_from_their_seed_and_are_cached(name, tmp_path, monkeypatch):
    entry = zoo.ZOO[name].scaled(steps=20 if name == "vit" else 3, warmup=1)  # the digits ViT needs more steps to learn
    a, b = zoo.pair(entry, cache=tmp_path, progress=False)
    again = zoo.train(entry, 0, cache=tmp_path, progress=False)
    assert again == a
    model_a, model_b = load_model(a).model, load_model(b).model
    assert type(model_a).__name__ == zoo.adapter_for(model_a.config).model_class.__name__
    assert not torch.equal(next(model_a.parameters()), next(model_b.parameters()))  # different seeds
    assert json.loads((a / "zoo.json").read_text())["seed"] == 0 and math.isfinite(zoo.train_loss(a))

    def no_training(*args, **kwargs):
        raise AssertionError("a cached member must not be retrained")

    monkeypatch.setattr(torch.optim, "AdamW", no_training)
    assert zoo.train(entry, 1, cache=tmp_path, progress=False) == b
    torch.manual_seed(0)
    untrained = type(model_a)(zoo.build_config(entry)).eval()  # member 0 before its first step
    batches = load_batches(zoo.held_out(entry, size=4096), model_a.config, a, EvalOptions(batch_size=8))
    trained_loss, untrained_loss = evaluate(model_a, batches).loss, evaluate(untrained, batches).loss
    assert trained_loss < untrained_loss - (0.01 if name == "vit" else 0.3), (trained_loss, untrained_loss)  # it learned


@pytest.mark.parametrize("variants, ratio", [(zoo.NARROW, None), (zoo.WIDE, 2)])
def test_width_variants_change_only_the_width(variants, ratio):
    """Narrow and wide entries keep the family, depth, head size and training; only the width moves."""
    for base, variant in variants.items():
        spec, other = (spec_of(zoo.build_config(zoo.ZOO[name])) for name in (base, variant))
        assert (other.num_layers, other.head_dim, other.model_type) == (spec.num_layers, spec.head_dim, spec.model_type)
        assert zoo.ZOO[variant].scaled(name=base, config=zoo.ZOO[base].config) == zoo.ZOO[base]  # same training
        if ratio is not None:
            assert (other.hidden_size, other.intermediate_size, other.num_heads, other.num_kv_heads) == (
                ratio * spec.hidden_size, ratio * spec.intermediate_size, ratio * spec.num_heads, ratio * spec.num_kv_heads,
            )
        else:
            assert other.hidden_size < spec.hidden_size


@pytest.mark.slow
def test_training_is_reproducible(tmp_path):
    entry = zoo.ZOO["llama"].scaled(steps=2, warmup=1)
    first = zoo.train(entry, 3, cache=tmp_path / "one", progress=False)
    second = zoo.train(entry, 3, cache=tmp_path / "two", progress=False)
    for (name, p), (_, q) in zip(AutoModelForCausalLM.from_pretrained(first).named_parameters(), AutoModelForCausalLM.from_pretrained(second).named_parameters()):
        assert torch.equal(p, q), name


@pytest.mark.slow
def test_demo_writes_a_merge_with_card_plot_and_barrier_table(tmp_path, capsys):
    out = tmp_path / "demo"
    args = ["demo", "--output", str(out), "--steps", "3", "--eval-chars", "4096", "--cache-dir", str(tmp_path / "zoo")]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| average |" in printed and "| weight |" in printed and str(out) in printed
    card = (out / "README.md").read_text()
    assert "loss_along_path.png" in card and (out / "loss_along_path.png").is_file()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "gpt2" and AutoTokenizer.from_pretrained(out).get_vocab() == zoo.char_tokenizer().get_vocab()
    assert main(args) == 0  # re-running replaces its own earlier output


def test_demo_refuses_to_replace_a_folder_it_did_not_write(tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert main(["demo", "--output", str(tmp_path / "mine"), "--steps", "1", "--cache-dir", str(tmp_path / "zoo")]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "mine") in err and err.count("\n") == 1, err  # names the folder it refuses, in one line
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
