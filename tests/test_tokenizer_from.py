"""Choosing the tokenizer a merge carries (``tokenizer_from``, ``--tokenizer-from``,
``output.tokenizer_from``): its files are copied, every other model's tokenizer is compared with
it, and naming it accepts a difference, which the card records; a name that fits no model, or a
model without a tokenizer, is refused by the option's name before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from hf_lmc.cli import main
from hf_lmc.config.options import MergeRequest
from hf_lmc.config.recipe import load_recipe
from hf_lmc.io.inherit import InheritanceError
from hf_lmc.merging.pipeline import merge
from hf_lmc.merging.sweep import _Source, run_request
from tests.test_inherited import _one_line_error, _pair


def _other_vocabulary(folder: Path) -> None:
    """``folder``'s tokenizer with token 0 another string (the same size)."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"] = {"x": 0, "b": 1, "c": 2, " ": 3, ".": 4, "\n": 5}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))


def test_naming_b_carries_its_tokenizer_and_the_card_says_what_differs(tmp_path):
    a, b = _pair(tmp_path)
    _other_vocabulary(b)
    assert main(["merge", str(a), str(b), "-o", str(tmp_path / "out"), "-q", "--tokenizer-from", "b"]) == 0
    out = tmp_path / "out"
    assert (out / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()  # B's files, not A's
    card = (out / "README.md").read_text()
    assert "The tokenizer is b's (tokenizer_from)." in card
    assert "a differs from b in tokenizer.json's vocabulary" in card and "as tokenizer_from chose" in card
    assert "--tokenizer-from b" in card  # the command that chose it


def test_tokenizer_from_a_accepts_a_difference_and_keeps_a_files(tmp_path):
    a, b = _pair(tmp_path)
    _other_vocabulary(b)
    result = merge(a, b, tmp_path / "out", tokenizer_from="A", progress=False)  # as typed: a letter in either case
    assert (result.output / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()
    assert "as tokenizer_from chose" in (result.output / "README.md").read_text()


def test_a_name_that_fits_no_model_or_a_model_without_a_tokenizer_is_refused_by_the_option(tmp_path, capsys):
    a, b = _pair(tmp_path)
    rc, error = _one_line_error(["merge", str(a), str(b), "-o", str(tmp_path / "out"), "--tokenizer-from", "3"], capsys)
    assert rc == 2 and "--tokenizer-from" in error and "2 models" in error
    tokenizer = json.loads((b / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["z"] = 17  # an id past the 17 rows the tiny models embed
    (b / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(InheritanceError, match=r"tokenizer_from names b, whose tokenizer has ids up to 17.*vocab_size"):
        merge(a, b, tmp_path / "out", tokenizer_from="b", progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (b / name).unlink(missing_ok=True)
    with pytest.raises(InheritanceError, match="tokenizer_from names b, which has no tokenizer"):
        merge(a, b, tmp_path / "out", tokenizer_from="b", progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValidationError, match="tokenizer_from"):
        MergeRequest(models=["a", "b"], output="out", tokenizer_from="c")


def test_a_recipe_takes_tokenizer_from_as_an_output_key():
    sources = [_Source(name, None, name, False) for name in ("a", "b")]
    for written, index in (("b", 1), (2, 1), ("1", 0)):
        recipe = load_recipe({"models": ["a", "b"], "output": {"dir": "out", "tokenizer_from": written}})
        assert run_request(recipe, "weight", sources, Path("out/weight"), None, None).tokenizer_model == index
    assert (
        run_request(
            load_recipe({"models": ["a", "b"], "output": {"dir": "out"}}), "weight", sources, Path("o"), None, None
        ).tokenizer_from
        is None
    )
