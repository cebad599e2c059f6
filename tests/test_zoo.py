"""The offline zoo and ``hf-lmc demo`` (tiny settings: a few training steps)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast, pipeline

from hf_lmc.cli import main
from hf_lmc.config.options import EvalOptions
from hf_lmc.config.recipe import parse_zoo_member
from hf_lmc.evaluation.batches import load_batches
from hf_lmc.evaluation.loss import evaluate
from hf_lmc.io import zoo
from hf_lmc.io.loading import load_model


def test_shipped_corpus_splits_by_whole_play():
    train, held = zoo.shakespeare()
    assert len(train) >= 10 and len(held) == 2
    assert not set(train) & set(held)
    tokenizer = zoo.char_tokenizer()
    text = held[0][:500]
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # no unknowns, nothing inserted
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
    trained = json.loads((a / "zoo.json").read_text())
    assert trained["device"] == "cpu" and trained["seconds"] > 0  # where it trained and how long, in its record

    def no_training(*args, **kwargs):
        raise AssertionError("a cached member must not be retrained")

    monkeypatch.setattr(torch.optim, "AdamW", no_training)
    assert zoo.train(entry, 1, cache=tmp_path, progress=False) == b
    torch.manual_seed(0)
    untrained = type(model_a)(zoo.build_config(entry)).eval()  # member 0 before its first step
    batches = load_batches(zoo.held_out(entry, size=4096), model_a.config, a, EvalOptions(batch_size=8))
    trained_loss, untrained_loss = evaluate(model_a, batches).loss, evaluate(untrained, batches).loss
    assert trained_loss < untrained_loss - (0.01 if name == "vit" else 0.3), (
        trained_loss,
        untrained_loss,
    )  # it learned


@pytest.mark.slow
def test_training_is_reproducible(tmp_path):
    entry = zoo.ZOO["llama"].scaled(steps=2, warmup=1)
    first = zoo.train(entry, 3, cache=tmp_path / "one", progress=False)
    second = zoo.train(entry, 3, cache=tmp_path / "two", progress=False)
    for (name, p), (_, q) in zip(
        AutoModelForCausalLM.from_pretrained(first).named_parameters(),
        AutoModelForCausalLM.from_pretrained(second).named_parameters(),
    ):
        assert torch.equal(p, q), name


@pytest.mark.slow
def test_demo_writes_a_merge_with_card_plot_and_barrier_table(tmp_path, capsys):
    out = tmp_path / "demo"
    args = [
        "demo",
        "--output",
        str(out),
        "--train-steps",
        "3",
        "--eval-chars",
        "4096",
        "--cache-dir",
        str(tmp_path / "zoo"),
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| average |" in printed and "| weight |" in printed and str(out) in printed
    card = (out / "README.md").read_text()
    assert "loss_along_path.png" in card and (out / "loss_along_path.png").is_file()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert (
        model.config.model_type == "gpt2"
        and AutoTokenizer.from_pretrained(out).get_vocab() == zoo.char_tokenizer().get_vocab()
    )
    tokenizer, text = AutoTokenizer.from_pretrained(out), zoo.held_out("gpt2", size=2048)[0]
    assert (
        tokenizer.decode(tokenizer(text)["input_ids"]) == text
        and tokenizer.model_max_length == model.config.n_positions
    )
    assert pipeline("text-generation", model=str(out))("ROMEO:")[0]["generated_text"].startswith(
        "ROMEO:"
    )  # stops in bounds
    assert main(args) == 0  # re-running replaces its own earlier output


def test_demo_refuses_to_replace_a_folder_it_did_not_write(tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert (
        main(["demo", "--output", str(tmp_path / "mine"), "--train-steps", "1", "--cache-dir", str(tmp_path / "zoo")])
        == 2
    )
    err = capsys.readouterr().err
    assert str(tmp_path / "mine") in err and err.count("\n") == 1, err  # names the folder it refuses, in one line
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


# -- members used as Hub models --------------------------------------------------------------------

TINY_GPT2 = zoo.ZOO["gpt2"].scaled(steps=1, warmup=1)


@pytest.fixture(scope="module")
def member(tmp_path_factory):
    """One tiny GPT-2 zoo member (a single training step), shared by the tests below."""
    return zoo.train(TINY_GPT2, 0, cache=tmp_path_factory.mktemp("zoo"), progress=False)


def test_tokenizer_decodes_corpus_text_as_written(member):
    """Every character, newline and punctuation mark comes back exactly, and ids stay one per character."""
    text = zoo.held_out("gpt2", size=4096)[0]
    vocab = zoo.char_tokenizer().get_vocab()
    for tokenizer in (zoo.char_tokenizer(), AutoTokenizer.from_pretrained(member)):
        ids = tokenizer(text)["input_ids"]
        assert ids == [vocab[c] for c in text]  # the ids the published models were trained on
        assert tokenizer.decode(ids) == text


def test_member_files_are_bounded_by_the_model_context(member):
    context = TINY_GPT2.config["n_positions"]
    assert AutoTokenizer.from_pretrained(member).model_max_length == context
    assert GenerationConfig.from_pretrained(member).max_length == context


def test_text_generation_pipeline_runs_on_a_member_with_defaults(member):
    """Used as a Hub model: a short prompt, default arguments, text as written (no spaces inserted)."""
    generator, prompt = pipeline("text-generation", model=str(member)), "ROMEO:\nAnd"
    torch.manual_seed(0)  # the pipeline samples by default: the same seed draws the same tokens twice
    ids = generator(prompt, return_tensors=True)[0]["generated_token_ids"]
    assert len(ids) == TINY_GPT2.config["n_positions"]  # generation stops where the positions end
    chars = {i: c for c, i in zoo.char_tokenizer().get_vocab().items() if c != "<unk>"}
    continuation = "".join(chars.get(i, "") for i in ids[len(prompt) :])  # an unknown is a special token: skipped
    torch.manual_seed(0)
    assert generator(prompt)[0]["generated_text"] == prompt + continuation


def _write_old_style_files(folder):
    """The tokenizer and generation config an older version wrote: no decoder, no length bound."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab=zoo.char_tokenizer().get_vocab(), unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", model_max_length=10**6).save_pretrained(
        folder
    )
    GenerationConfig().save_pretrained(folder)


def test_a_member_cached_with_old_tokenizer_files_is_repaired_on_load(tmp_path, monkeypatch):
    folder = zoo.train(TINY_GPT2, 0, cache=tmp_path, progress=False)
    weights = (folder / "model.safetensors").read_bytes()
    _write_old_style_files(folder)
    assert AutoTokenizer.from_pretrained(folder).decode([1, 2]) != "".join(
        zoo.char_tokenizer().convert_ids_to_tokens([1, 2])
    )

    def no_training(*args, **kwargs):
        raise AssertionError("repairing a cached member must not retrain it")

    monkeypatch.setattr(torch.optim, "AdamW", no_training)
    assert zoo.train(TINY_GPT2, 0, cache=tmp_path, progress=False) == folder
    text = zoo.held_out("gpt2", size=2048)[0]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert (
        tokenizer.model_max_length
        == GenerationConfig.from_pretrained(folder).max_length
        == TINY_GPT2.config["n_positions"]
    )
    assert (folder / "model.safetensors").read_bytes() == weights and json.loads((folder / "zoo.json").read_text())[
        "seed"
    ] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]  # no staging folder left behind
    modified = (folder / "tokenizer.json").stat().st_mtime_ns
    zoo.train(TINY_GPT2, 0, cache=tmp_path, progress=False)
    assert (folder / "tokenizer.json").stat().st_mtime_ns == modified  # an up-to-date member is left alone


@pytest.mark.slow
def test_an_entry_with_patience_stops_when_its_validation_loss_stops_improving_and_keeps_its_best_weights(tmp_path):
    """Validation batches come from the end of the training split (never the held-out plays);
    the member saved is the best one seen, and zoo.json says how training ended."""
    entry = zoo.ZOO["gpt2"].scaled(
        name="patient",
        config={"n_layer": 1, "n_embd": 32, "n_head": 2},
        steps=400,
        warmup=5,
        lr=3e-2,
        patience=2,
        eval_every=10,
    )
    folder = zoo.train(entry, 0, cache=tmp_path, progress=False)
    record = json.loads((folder / "zoo.json").read_text())
    assert record["stopped"] in ("plateau", "budget") and record["best_step"] <= record["steps"] <= 400
    if record["stopped"] == "plateau":
        assert record["steps"] == record["best_step"] + 2 * 10  # two checks without improvement
    _, validation = zoo._training_split(entry)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert abs(zoo._validation_loss(model, validation) - record["validation_loss"]) < 1e-4  # the best weights were kept
    train, _ = zoo._training_split(entry)
    assert train.numel() < zoo.train_tokens().numel()  # the validation text is not trained on
    assert zoo.ZOO["gpt2"].key(0) == zoo.ZOO["gpt2"].scaled(patience=None).key(0)  # older caches stay valid


def test_a_bpe_entry_reads_the_plays_through_its_own_vocabulary(tmp_path):
    """An entry with a vocab_size trains on, saves and is evaluated with a byte-level BPE of that
    size: the member's saved tokenizer is the one its fitting batches are drawn with, it decodes
    text exactly, and the entry caches apart from its character twin, whose key does not change."""
    char_entry = zoo.ZOO["llama"].scaled(steps=3, warmup=1)
    entry = dataclasses.replace(char_entry, vocab_size=300)
    assert entry.key(0) != char_entry.key(0)
    assert char_entry.key(0) == dataclasses.replace(char_entry, vocab_size=None).key(0)
    member = zoo.train(entry, 0, cache=tmp_path, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(member)
    assert len(tokenizer) == 300 == load_model(member).model.config.vocab_size
    assert tokenizer.get_vocab() == zoo.lm_tokenizer(entry).get_vocab()
    text = zoo.shakespeare()[1][0][:500]
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert len(tokenizer(text)["input_ids"]) < len(text)  # merges, not characters
    batch = zoo.fit_batches(entry, 1, batch_size=2)[0]["input_ids"]
    assert 0 <= int(batch.min()) and int(batch.max()) < 300
    ids = zoo.train_tokens(300)[:200].tolist()
    assert tokenizer.decode(ids) == "\n\n".join(zoo.shakespeare()[0])[: len(tokenizer.decode(ids))]
    with pytest.raises(ValueError, match="more than the 256 bytes"):
        zoo.bpe_tokenizer(256)
    # a cached member whose BPE differs from the one built now is refused, not given the new tokens
    zoo.bpe_tokenizer(320).save_pretrained(member)
    with pytest.raises(RuntimeError, match="another BPE"):
        zoo.train(entry, 0, cache=tmp_path, progress=False)


# -- the pair the package ships --------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_the_shipped_demo_pair_is_the_zoo_entry_trained_from_its_seeds(seed):
    """Each shipped file is named by, and records, the member train() makes: the gpt2 entry as it
    is now (its steps and settings), the seed, the hf_lmc version; its tensors are that model's."""
    entry = zoo.ZOO["gpt2"]
    path = zoo.shipped_file(entry, seed)
    assert path is not None and path.name.startswith(entry.key(seed))
    tensors, metadata = zoo.read_shipped(path)
    record = json.loads(metadata["zoo.json"])
    assert metadata["key"] == entry.key(seed) and metadata["hf_lmc"]
    assert zoo.ZooEntry(**record["entry"]) == entry and record["entry"]["steps"] == 600 and record["seed"] == seed
    assert math.isfinite(record["train_loss"]) and "shipped" not in record
    model = zoo.adapter_for(zoo.build_config(entry)).model_class(zoo.build_config(entry))
    state = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    assert {name: tuple(value.shape) for name, value in tensors.items()}.items() <= state.items()
    assert set(state) - set(tensors) == {"lm_head.weight"}  # tied to the input embedding, saved once
    assert all(value.dtype == torch.float32 for value in tensors.values())  # as trained, not rounded
    assert zoo.shipped_file(entry.scaled(steps=599), seed) is None  # other settings: trained, not shipped


@pytest.fixture(scope="module")
def packed(member, tmp_path_factory):
    """The tiny member packed as the package ships its members."""
    return zoo.ship(member, tmp_path_factory.mktemp("shipped"))


def test_a_shipped_member_unpacks_as_training_wrote_it_and_train_false_retrains_it(
    member, packed, tmp_path, monkeypatch
):
    """Unpacked into an empty cache, a shipped member's folder is file for file the trained one
    (zoo.json adds where it came from), without a training step; shipped=False trains it here."""
    monkeypatch.setattr(
        zoo, "shipped_file", lambda entry, seed: packed if zoo._entry(entry).key(seed) == member.name else None
    )
    real_adamw = torch.optim.AdamW

    def no_training(*args, **kwargs):
        raise AssertionError("a shipped member must not be trained")

    monkeypatch.setattr(torch.optim, "AdamW", no_training)
    unpacked = zoo.train(TINY_GPT2, 0, cache=tmp_path / "cache", progress=False)
    assert unpacked.name == member.name and zoo.was_shipped(unpacked) and not zoo.was_shipped(member)
    files = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
    for name in files:
        assert (unpacked / name).read_bytes() == (member / name).read_bytes(), name
    record = json.loads((unpacked / "zoo.json").read_text())
    assert record.pop("shipped")["file"] == packed.name and record == json.loads((member / "zoo.json").read_text())
    monkeypatch.setattr(torch.optim, "AdamW", real_adamw)
    assert zoo.train(TINY_GPT2, 0, cache=tmp_path / "cache", progress=False, shipped=False) == unpacked
    assert not zoo.was_shipped(unpacked)  # trained here, in place of the unpacked copy


def test_a_shipped_file_that_holds_another_member_is_refused_in_one_line(packed, tmp_path, monkeypatch):
    monkeypatch.setattr(zoo, "shipped_file", lambda entry, seed: packed)
    with pytest.raises(ValueError, match=packed.name) as refused:
        zoo.train(TINY_GPT2, 1, cache=tmp_path / "cache", progress=False)  # seed 1 asked, seed 0 shipped
    assert "\n" not in str(refused.value) and "--train" in str(refused.value)
    assert not (tmp_path / "cache").exists()  # nothing written


@pytest.mark.slow
def test_demo_merges_the_shipped_pair_without_training_and_says_so(tmp_path, capsys, monkeypatch):
    """No training step; the plan of the run is one line on stderr before the imports, and
    --quiet silences it with the bars; torch's thread count is given back."""

    def no_training(*args, **kwargs):
        raise AssertionError("the demo must not train the shipped pair")

    monkeypatch.setattr(torch.optim, "AdamW", no_training)
    threads = torch.get_num_threads()
    args = ["demo", "--output", str(tmp_path / "demo"), "--eval-chars", "2048", "--cache-dir", str(tmp_path / "zoo")]
    assert main(args) == 0
    printed = capsys.readouterr()
    assert "shipped with hf_lmc" in printed.out and "| weight |" in printed.out
    assert printed.err.startswith("hf-lmc demo: ") and "shipped" in printed.err.splitlines()[0]
    assert all(zoo.was_shipped(folder) for folder in (tmp_path / "zoo").iterdir())
    assert torch.get_num_threads() == threads
    assert main([*args, "--quiet"]) == 0
    assert "hf-lmc demo:" not in capsys.readouterr().err


def test_demo_train_trains_the_pair_instead_of_unpacking_it(tmp_path, capsys, monkeypatch):
    asked = {}

    def pair(entry, **options):
        asked.update(options)
        raise OSError("stop here")

    monkeypatch.setattr(zoo, "pair", pair)
    args = ["demo", "--train", "--output", str(tmp_path / "demo"), "--cache-dir", str(tmp_path / "zoo"), "-q"]
    assert main(args) == 1
    assert asked["shipped"] is False and "stop here" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_every_library_zoo_entry_is_one_a_recipe_can_name(name):
    """The library's zoo holds what users reach (``zoo:NAME/seedN`` in a recipe, the demo pair);
    entries only a benchmark trains are the benchmark's own."""
    assert parse_zoo_member(f"zoo:{name}/seed0") == (name, 0)


def test_shifted_images_are_their_digits_moved_within_the_shift_on_the_background():
    """``shift`` moves each training image by whole pixels (at most ``shift`` each way), keeps
    its label, fills what it uncovers with the background, and draws the moves from the seed's
    generator: the same stream again from the same seed."""
    pixels = torch.full((64, 1, 10, 10), -1.0)
    pixels[:, 0, 3:7, 4:6] = torch.rand(64, 4, 2) + 0.5  # a blob away from the border, on the background
    moved = zoo.shifted(pixels, 2, torch.Generator().manual_seed(0))
    assert torch.equal(moved, zoo.shifted(pixels, 2, torch.Generator().manual_seed(0)))
    seen = set()
    for before, after in zip(pixels, moved):
        found = [
            (dy, dx)
            for dy in range(-2, 3)
            for dx in range(-2, 3)
            if torch.equal(after, torch.roll(before, (dy, dx), dims=(1, 2)))
        ]
        assert len(found) == 1  # exactly one move within the shift (the roll wraps only background)
        seen.add(found[0])
    assert len(seen) > 10  # the moves vary from image to image

    entry = zoo.ZooEntry("shifted", "vit", {}, batch_size=8, data="mnist", shift=2)
    train = {"pixel_values": pixels[:16], "labels": torch.arange(16)}
    plain = next(zoo._image_batches(entry, train, torch.Generator().manual_seed(1)))
    shifted = next(zoo._image_batches(entry, train, torch.Generator().manual_seed(1), shift=2))
    assert torch.equal(plain["labels"], shifted["labels"])  # the same images, in the same order
    assert not torch.equal(plain["pixel_values"], shifted["pixel_values"])


def test_an_entry_names_the_data_it_trains_on_and_a_shift_is_part_of_its_key():
    plain = zoo.ZooEntry("v", "vit", {}, data="mnist")
    assert plain.key(0) == zoo.ZooEntry("v", "vit", {}, data="mnist", shift=0).key(0)  # older caches stay valid
    assert plain.key(0) != dataclasses.replace(plain, shift=2).key(0)
    assert "shifted up to 2 px" in zoo.data_text(dataclasses.replace(plain, shift=2))
    assert "shifted" not in zoo.data_text(plain) and "MNIST" in zoo.data_text(plain)
    assert zoo.data_text(zoo.ZOO["gpt2"]) != zoo.data_text(dataclasses.replace(zoo.ZOO["gpt2"], vocab_size=512))
