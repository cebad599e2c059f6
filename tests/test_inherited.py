"""What a merge inherits from model A: copied only from inside A's folder, checked against B's,
and named in a card that holds no path of this machine."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from hf_lmc.canonical.adapters import informational_differences, read_config
from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.canonical.widths import check_mergeable
from hf_lmc.cli import main
from hf_lmc.io.inherit import InheritanceError, UnsafeFileError, check_inherited, copy_model_file
from hf_lmc.merging.pipeline import merge
from hf_lmc.merging.sweep import run_recipe
from tests.models import build_model, char_tokenizer_folder


def _pair(tmp_path: Path, arch: str = "gpt2", tokenizers: bool = True) -> tuple[Path, Path]:
    """Two tiny models of one config saved to ``tmp_path/a`` and ``tmp_path/b`` (with A's char tokenizer in both)."""
    config = tiny_configs()[arch]
    folders = []
    for seed, name in ((1, "a"), (2, "b")):
        folder = tmp_path / name
        build_model(config, seed=seed, dtype=torch.float32).save_pretrained(folder)
        if tokenizers and arch != "vit":
            char_tokenizer_folder(folder, config.vocab_size)
        folders.append(folder)
    return folders[0], folders[1]


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps(data | changes))


def _check(a: Path, b: Path, **options) -> list[str]:
    return check_inherited([a, b], [read_config(a), read_config(b)], ["a", "b"], **options)


def _one_line_error(args, capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(args)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hf-lmc: error:")]
    assert len(errors) == 1
    return rc, errors[0]


# -- nothing leaks: copies come from inside the model folder ---------------------------------------


def test_a_link_out_of_the_model_folder_is_refused_by_name(tmp_path, capsys):
    a, b = _pair(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("token=hf_not_for_the_hub")
    (a / "tokenizer_config.json").unlink()
    os.symlink(secret, a / "tokenizer_config.json")
    rc, error = _one_line_error(["merge", str(a), str(b), "-o", str(tmp_path / "out"), "-q"], capsys)
    assert rc == 1 and "tokenizer_config.json" in error and str(secret) in error  # the file, and where it points
    assert not (tmp_path / "out").exists()
    with pytest.raises(UnsafeFileError, match="tokenizer_config.json"):
        copy_model_file(a, "tokenizer_config.json", tmp_path / "copy")
    assert not (tmp_path / "copy").exists()


def test_a_hub_snapshot_copies_its_blob_links_and_refuses_links_out_of_its_repo(tmp_path):
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "0a1b").write_text('{"unk_token": "."}')
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    os.symlink("../../blobs/0a1b", snapshot / "tokenizer_config.json")  # how huggingface_hub lays a snapshot out
    assert copy_model_file(snapshot, "tokenizer_config.json", tmp_path / "copied.json")
    copied = tmp_path / "copied.json"
    assert not copied.is_symlink() and copied.read_text() == '{"unk_token": "."}'
    assert not copy_model_file(snapshot, "vocab.json", tmp_path / "none")  # absent: nothing copied
    (tmp_path / "hub" / "elsewhere").write_text("secret")
    os.symlink("../../../elsewhere", snapshot / "vocab.json")
    with pytest.raises(UnsafeFileError, match="vocab.json"):
        copy_model_file(snapshot, "vocab.json", tmp_path / "leak")
    assert not (tmp_path / "leak").exists()


@pytest.mark.slow
def test_no_card_names_a_path_of_this_machine_on_any_route(tmp_path):
    a, b = _pair(tmp_path)
    text = tmp_path / "eval.txt"
    text.write_text("abc cab bca. " * 40)
    here = {str(tmp_path), str(tmp_path.resolve())} | ({os.path.expanduser("~")} - {"/", "~"})
    data = ["--eval-data", str(text), "--alphas", "3", "--seq-len", "8", "--max-batches", "1"]
    assert main(["merge", str(a), str(b), "-o", str(tmp_path / "cli"), "-q", *data]) == 0
    merge(a, b, tmp_path / "python", eval_data=str(text), alphas=3, progress=False)
    learned = ["--method", "learned", "--data", str(text), "--steps", "1", "--batch-size", "2"]  # the training table
    assert main(["merge", str(a), str(b), "-o", str(tmp_path / "learned"), "-q", *data[2:], *learned]) == 0
    recipe = {
        "models": [str(a), str(b)],
        "output": {"dir": str(tmp_path / "recipe")},
        "eval": {"data": {"files": [str(text)], "seq_len": 8, "max_batches": 1}, "alphas": [0, 0.5, 1]},
    }
    run_recipe(recipe, progress=False)
    summary = (tmp_path / "recipe" / "summary.json").read_text()  # the recipe as run, beside the merges
    assert not [place for place in here if place in summary] and '"eval.txt"' in summary
    for card in (
        tmp_path / "cli" / "README.md",
        tmp_path / "python" / "README.md",
        tmp_path / "learned" / "README.md",
        tmp_path / "recipe" / "weight" / "README.md",
    ):
        body = card.read_text()
        assert not [place for place in here if place in body], card
        assert "eval.txt" in body and "`a` (a local model)" in body  # named, by the final component
    assert "hf-lmc merge a b -o cli -q --eval-data eval.txt" in (tmp_path / "cli" / "README.md").read_text()


# -- everything the merge inherits is checked --------------------------------------------------------


def test_tokenizers_of_one_size_and_other_strings_are_refused_unless_a_is_accepted(tmp_path, capsys):
    a, b = _pair(tmp_path)
    tokenizer = json.loads((b / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"] = {"x": 0, "b": 1, "c": 2, " ": 3, ".": 4, "\n": 5}  # same size, token 0 another string
    (b / "tokenizer.json").write_text(json.dumps(tokenizer))
    out = str(tmp_path / "out")
    rc, error = _one_line_error(["merge", str(a), str(b), "-o", out, "-q"], capsys)
    assert rc == 2 and "tokenizer.json's vocabulary" in error and "'a' vs 'x'" in error and "--tokenizer-from" in error
    assert not (tmp_path / "out").exists()
    assert main(["merge", str(a), str(b), "-o", out, "-q", "--inherit-from-a"]) == 0
    card = (tmp_path / "out" / "README.md").read_text()
    assert re.search(r"- b differs from a in tokenizer.json's vocabulary .*inherit_from_a was set", card)
    assert "--inherit-from-a" in card  # the command that accepted A's
    assert json.loads((tmp_path / "out" / "tokenizer.json").read_text())["model"]["vocab"]["a"] == 0  # A's


def test_one_vocabulary_in_two_file_formats_is_one_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab, end = {"a": 0, "b": 1, "ab": 2, "ba": 3, "<|endoftext|>": 4}, "<|endoftext|>"
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")])),
        eos_token=end,
        bos_token=end,
        unk_token=end,
    )
    fast.save_pretrained(tmp_path / "a")  # A: tokenizer.json
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "vocab.json").write_text(json.dumps(vocab))  # B: the same BPE as vocab.json and merges.txt
    (tmp_path / "b" / "merges.txt").write_text("#version: 0.2\na b\n")
    for name in ("a", "b"):
        tiny_configs()["gpt2"].save_pretrained(tmp_path / name)
    notes = _check(tmp_path / "a", tmp_path / "b")  # not refused: one vocabulary, merges and special tokens
    assert not [note for note in notes if re.search("vocabulary|merges|special", note)]
    (tmp_path / "b" / "merges.txt").write_text("#version: 0.2\nb a\n")
    with pytest.raises(
        InheritanceError, match=r"merges of the tokenizer in vocab.json, merges.txt \(id 0: 'a b' vs 'b a'\)"
    ):
        _check(tmp_path / "a", tmp_path / "b")


def test_permuted_labels_are_refused_by_name(tmp_path):
    a, b = _pair(tmp_path, "vit")
    _edit_json(
        a / "config.json", id2label={"0": "cat", "1": "dog", "2": "fish"}, label2id={"cat": 0, "dog": 1, "fish": 2}
    )
    _edit_json(
        b / "config.json", id2label={"0": "dog", "1": "cat", "2": "fish"}, label2id={"dog": 0, "cat": 1, "fish": 2}
    )
    with pytest.raises(InheritanceError, match=r"id2label \(label 0: 'cat' vs 'dog'\)") as info:
        merge(a, b, tmp_path / "out", progress=False)
    assert "\n" not in str(info.value) and "inherit_from_a" in str(info.value)
    assert not (tmp_path / "out").exists()
    assert any("id2label" in note and "inherit_from_a was set" in note for note in _check(a, b, inherit_from_a=True))


def test_default_labels_on_both_models_are_no_difference(tmp_path):
    a, b = _pair(tmp_path, "vit")
    assert _check(a, b) == []


def test_an_image_processor_that_changes_the_pixels_is_refused_a_harmless_field_noted(tmp_path):
    a, b = _pair(tmp_path, "vit")
    processor = {
        "image_processor_type": "ViTImageProcessor",
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"height": 8, "width": 8},
    }
    _edit_json(a / "preprocessor_config.json", **processor)
    _edit_json(b / "preprocessor_config.json", **processor | {"image_processor_type": "ViTImageProcessorFast"})
    assert any("preprocessor_config.json's image_processor_type" in note for note in _check(a, b))
    _edit_json(b / "preprocessor_config.json", image_mean=[0.485, 0.456, 0.406])
    with pytest.raises(InheritanceError, match=r"preprocessor_config.json's image_mean \(\[0.5, 0.5, 0.5\] vs \[0.485"):
        _check(a, b)


_VIT_PROCESSOR = {
    "image_processor_type": "ViTImageProcessor",
    "do_resize": True,
    "size": {"height": 8, "width": 8},
    "image_std": [0.5, 0.5, 0.5],
}


@pytest.mark.parametrize(
    ("a_changes", "b_changes", "refused"),
    [
        ({}, {"size": {"height": 16, "width": 16}}, "size"),  # a dict value in a one-line message
        ({}, {"image_mean": [0.1, 0.1, 0.1]}, "image_mean"),  # A's file leaves it to the class default
        ({}, {"do_center_crop": True, "crop_size": {"height": 6, "width": 6}}, "crop_size"),  # only B crops
        ({"size": {"height": 8, "width": 8}}, {"size": 8}, None),  # one size, two spellings
    ],
)
def test_image_processors_are_compared_as_they_run_defaults_included(tmp_path, a_changes, b_changes, refused):
    a, b = _pair(tmp_path, "vit")
    _edit_json(a / "preprocessor_config.json", **_VIT_PROCESSOR | a_changes)
    _edit_json(b / "preprocessor_config.json", **_VIT_PROCESSOR | b_changes)
    if refused is None:
        assert not [note for note in _check(a, b) if "size" in note]
        return
    with pytest.raises(InheritanceError, match=f"preprocessor_config.json's {refused} ") as info:
        _check(a, b)
    assert "\n" not in str(info.value) and "inherit_from_a" in str(info.value)


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja", "only b"])
def test_a_chat_template_that_differs_is_named_in_the_card(tmp_path, where):
    a, b = _pair(tmp_path)
    if where == "tokenizer_config.json":
        _edit_json(a / where, chat_template="{{ a }}")
        _edit_json(b / where, chat_template="{{ b }}")
    else:
        if where != "only b":
            (a / "chat_template.jinja").write_text("{{ a }}")
        (b / "chat_template.jinja").write_text("{{ b }}")
    (note,) = [note for note in _check(a, b) if "chat template" in note]
    assert "a's is kept" in note
    assert not [note for note in _check(a, a) if "chat template" in note]


def test_an_end_of_text_id_is_refused_sampling_defaults_noted(tmp_path):
    a, b = _pair(tmp_path, tokenizers=False)
    _edit_json(a / "generation_config.json", eos_token_id=0, temperature=1.0)
    _edit_json(b / "generation_config.json", eos_token_id=0, temperature=0.7, top_k=5)
    assert any("sampling defaults (temperature, top_k)" in note for note in _check(a, b))
    _edit_json(b / "generation_config.json", eos_token_id=3)
    with pytest.raises(InheritanceError, match=r"generation_config.json's eos_token_id \(0 vs 3\)"):
        _check(a, b)


# -- config fields: classified by the adapters' tables --------------------------------------------


def test_a_free_text_field_and_a_legacy_n_ctx_proceed_with_a_note(tmp_path):
    a, b = _pair(tmp_path, tokenizers=False)
    _edit_json(b / "config.json", note="fine-tuned on my notes", n_ctx=1024)
    config_a, config_b = read_config(a), read_config(b)
    assert check_mergeable(config_a, config_b) == []  # no refusal, no width note
    (note,) = _check(a, b)
    assert "n_ctx" in note and "note" in note and "a's is kept" in note


def test_a_setting_that_changes_the_function_is_refused_and_long_values_stay_short(tmp_path):
    a, b = _pair(tmp_path, tokenizers=False)
    _edit_json(b / "config.json", activation_function="relu", note="x" * 5_000_000)
    with pytest.raises(ValueError, match="compute differently.*activation_function 'gelu_new' vs 'relu'") as info:
        check_mergeable(read_config(a), read_config(b))
    assert len(str(info.value)) < 300
    (note,) = _check(a, b)
    assert len(note) < 400 and "note" in note
    _edit_json(b / "config.json", activation_function="y" * 5_000_000)
    with pytest.raises(ValueError, match="activation_function 'gelu_new' vs 'yyy") as info:
        check_mergeable(read_config(a), read_config(b))
    assert len(str(info.value)) < 300


@pytest.mark.parametrize(
    ("arch", "key", "value"),
    [
        ("gpt2", "scale_attn_weights", False),
        ("gpt_neox", "use_parallel_residual", False),
        ("llama", "rope_parameters", {"rope_type": "default", "rope_theta": 500.0}),
        ("vit", "hidden_act", "relu"),
    ],
)
def test_every_family_refuses_a_function_key_and_notes_an_unknown_one(arch, key, value):
    config = tiny_configs()[arch]
    changed = type(config).from_dict({**config.to_dict(), key: value})
    with pytest.raises(ValueError, match=f"compute differently \\({key} "):
        check_mergeable(config, changed)
    noted = type(config).from_dict({**config.to_dict(), "trained_by": "me"})
    assert check_mergeable(config, noted) == [] and informational_differences(config, noted) == ["trained_by"]


def test_a_recipe_takes_inherit_from_a_as_an_output_key():
    from hf_lmc.config.recipe import load_recipe
    from hf_lmc.merging.sweep import _Source, run_request

    recipe = load_recipe({"models": ["a", "b"], "output": {"dir": "out", "inherit_from_a": True}})
    sources = [_Source(name, None, name, False) for name in ("a", "b")]
    assert run_request(recipe, "weight", sources, Path("out/weight"), None, None).inherit_from_a
    assert not run_request(
        load_recipe({"models": ["a", "b"], "output": {"dir": "out"}}), "weight", sources, Path("o"), None, None
    ).inherit_from_a


def test_a_card_note_that_names_a_local_model_names_it_by_its_label(tmp_path):
    from hf_lmc.io.card import ModelSource, merge_card

    a, b = tmp_path / "models" / "a", tmp_path / "models" / "b"
    card = merge_card(
        base_models=[ModelSource.of(str(a)), ModelSource.of(str(b), label="mine")],
        method="weight",
        symmetries=["mlp"],
        alpha_or_weights=0.5,
        license=None,
        model_type="gpt2",
        notes=[f"{b} was embedded exactly into the common shape."],
    )
    assert (
        str(tmp_path) not in card.text
        and "- mine was embedded exactly" in card.text
        and "`a` (a local model)" in card.text
    )
