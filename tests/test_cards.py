"""Model cards tell the truth, on every route that writes one: the evaluation data is named as
what it is (a Hub dataset by its id, in ``model-index`` and linked; anything else as local data,
in the text alone and never as a dataset link), ``model-index`` holds the merged model's own barrier (the plain average's is the baseline it is measured against), the
Reproduce section gives the command (or recipe, or settings) that made it with user paths
reduced to their last part, and the title names the models as a person named them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from hf_lmc.cli import main
from hf_lmc.commands.demo import run_demo
from hf_lmc.config.options import EvalOptions, MergeRequest
from hf_lmc.config.recipe import load_recipe
from hf_lmc.io.card import DataSource, eval_source, merge_card
from hf_lmc.merging.pipeline import merge
from hf_lmc.merging.sweep import _Source, run_recipe, run_request
from tests.test_inherited import _pair

TEXT = "abc cab bca. " * 40
#: Each kind of card: (method, how the text names the (local) data, words of the Reproduce section, title).
KINDS = {
    "cli": ("weight", "eval.txt", "hf-lmc merge a b -o cli", "Merge of a and b"),
    "python": ("weight", "data passed as a list", "hf_lmc.MergeRequest(**settings)", "Merge of a and b"),
    "average": ("average", "eval.txt", "hf-lmc merge a b -o average -q --method average", "Merge of a and b"),
    "recipe": ("weight", "eval.txt", "hf-lmc run recipe.yaml", "Merge of a and b"),
    "demo": (
        "weight",
        "zoo:shakespeare",
        "hf-lmc demo --output demo --train-steps 1",
        "Merge of zoo:gpt2/seed0 and zoo:gpt2/seed1",
    ),
}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """One folder per kind of card, each written by its own route from one tiny pair (the demo from its zoo pair)."""
    root = tmp_path_factory.mktemp("cards")
    a, b = _pair(root)
    text = root / "eval.txt"
    text.write_text(TEXT)
    data = ["--eval-data", str(text), "--alphas", "3", "--seq-len", "8", "--max-batches", "1"]
    assert main(["merge", str(a), str(b), "-o", str(root / "cli"), "-q", *data]) == 0
    assert main(["merge", str(a), str(b), "-o", str(root / "average"), "-q", "--method", "average", *data]) == 0
    merge(
        a,
        b,
        root / "python",
        eval_data=[TEXT],
        eval_options=EvalOptions(seq_len=8, max_batches=1),
        alphas=3,
        progress=False,
    )
    recipe = {
        "models": [str(a), str(b)],
        "output": {"dir": str(root / "recipe")},
        "eval": {"data": {"files": [str(text)], "seq_len": 8, "max_batches": 1}, "alphas": [0, 0.5, 1]},
    }
    run_recipe(recipe, progress=False)
    run_demo(root / "demo", steps=1, eval_chars=2048, cache=root / "zoo", progress=False)
    return root


def _folder(made: Path, kind: str) -> Path:
    return made / "recipe" / "weight" if kind == "recipe" else made / kind


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_of_card_loads_and_says_what_is_so(made, kind):
    method, data_name, command, title = KINDS[kind]
    card = ModelCard.load(_folder(made, kind) / "README.md")
    assert f"\n# {title}\n" in card.content
    # local data: no model-index result, whose dataset the Hub would link as a dataset page that is not there
    assert "model-index" not in card.data.to_dict() and "huggingface.co/datasets" not in card.content
    body, reproduce = card.text.split("## Reproduce")
    measured_on = re.search(r"^Measured on `([^`]*)` \(local data", body, re.MULTILINE)
    assert measured_on is not None and data_name in measured_on.group(1)
    assert re.search(r"^\| average \|", body, re.MULTILINE)
    assert "baseline" in body
    if method == "average":
        assert "plain average" in body.split("## Merge")[0] and "canonical form" not in body
    else:
        assert "canonical form" in body
    assert re.search(r"Made with `hf-lmc` \S+\.\n\nIt was made ", reproduce)  # whole sentences
    assert command in reproduce
    assert str(made) not in card.content and str(made.resolve()) not in card.content  # no path of this machine


def test_evaluation_data_is_named_as_a_hub_dataset_only_where_it_is_one():
    def named(eval_data, **options) -> DataSource:
        return eval_source(MergeRequest(models=["a", "b"], output="out", eval_data=eval_data, **options))

    assert named("plays.txt") == DataSource("plays.txt")
    assert named("/home/someone/data/plays") == DataSource("plays")  # a path: local, by its last part
    assert named(["some text"]) == DataSource("data passed as a list")
    assert named(["some text"], eval_data_name="zoo:shakespeare (held out)") == DataSource("zoo:shakespeare (held out)")
    hub = named(["text"], eval_data_name="Salesforce/wikitext", eval_options=EvalOptions(name="wikitext-2-raw-v1"))
    assert hub == DataSource("Salesforce/wikitext", "Salesforce/wikitext", "wikitext-2-raw-v1", "test")

    recipe = load_recipe(
        {
            "models": ["a", "b"],
            "output": {"dir": "out"},
            "eval": {"data": {"dataset": "Salesforce/wikitext", "name": "wikitext-2-raw-v1"}},
        }
    )
    sources = [_Source(name, None, name, False) for name in ("a", "b")]
    spec = run_request(recipe, "weight", sources, Path("out/weight"), None, ["loaded text"])
    assert eval_source(spec) == hub  # a recipe's Hub dataset, loaded once, is still named by its id

    card = _measured_card("dual", 0.01, hub)
    (result,) = card.data.to_dict()["model-index"][0]["results"]
    assert result["dataset"] == {
        "name": "Salesforce/wikitext",
        "type": "Salesforce/wikitext",
        "config": "wikitext-2-raw-v1",
        "split": "test",
    }
    assert [(m["name"], m["value"]) for m in result["metrics"]] == [("loss barrier, dual (nats)", 0.01)]
    assert (
        "Measured on the Hub dataset [`Salesforce/wikitext`](https://huggingface.co/datasets/Salesforce/wikitext)"
        in card.text
    )


def _measured_card(method: str, barrier: float, eval_data):
    """The card of a merge of ``a`` and ``b`` by ``method`` whose barrier was measured on ``eval_data``."""
    return merge_card(
        base_models=["a", "b"],
        method=method,
        symmetries=["mlp"],
        alpha_or_weights=0.5,
        license=None,
        model_type="gpt2",
        barriers={"average": 0.5, method: barrier},
        barrier_table="| method | barrier |",
        eval_data=eval_data,
    )


@pytest.mark.parametrize(
    "eval_data", ["plays.txt", "/home/someone/data/plays.txt", DataSource("data passed as a list")]
)
def test_local_evaluation_data_is_named_in_the_text_with_no_dataset_link(eval_data):
    """The Hub renders a model-index dataset as a link to its dataset page: local data has none,
    so the card names it by its file name in the text, and model-index (and any link) is left out."""
    card = _measured_card("weight", 0.1, eval_data)
    metadata = card.data.to_dict()
    assert "model-index" not in metadata and "local" not in str(metadata)
    assert "huggingface.co/datasets" not in card.content and "/home/someone" not in card.content
    name = eval_data.name if isinstance(eval_data, DataSource) else Path(eval_data).name
    assert f"Measured on `{name}` (local data" in card.text


def test_an_aligned_merge_saves_its_transforms_and_its_card_says_how_to_load_them(tmp_path):
    """Beside the weights, one transform per model that moves it exactly as the merge moved it
    (B's carries B onto the merge's aligned B), what it was fitted on, and a card section naming the files."""
    import json

    import torch

    import hf_lmc
    from hf_lmc.symmetry import Transform, load_transforms

    a, b = _pair(tmp_path)
    out = tmp_path / "out"
    assert main(["merge", str(a), str(b), "-o", str(out), "-q", "--method", "weight"]) == 0
    assert {"transforms.safetensors", "transforms.json"} <= {p.name for p in out.iterdir()}
    canonical_b = hf_lmc.canonicalize(b)
    transforms, manifest = load_transforms(out / "transforms.safetensors", canonical_b.spec)
    assert [m.name for m in manifest.models] == ["a", "b"] and manifest.fitted["method"] == "weight"
    assert [m["reference"] for m in manifest.fitted["models"]] == ["a", "b"]
    assert str(tmp_path) not in (out / "transforms.json").read_text()  # no path of this machine
    assert json.loads((out / "transforms.json").read_text())["version"] == 1
    # the merge is the midpoint of the saved transforms applied to A and B (export's exactness tolerance)
    moved_a = transforms[0].apply(hf_lmc.canonicalize(a)).state_dict()
    moved_b = Transform.load(out / "transforms.safetensors", canonical_b.spec, model=1).apply(canonical_b).state_dict()
    merged = hf_lmc.canonicalize(out).state_dict()
    assert any(not torch.equal(moved_b[name], tensor) for name, tensor in canonical_b.state_dict().items())
    d = canonical_b.spec.hidden_size
    centring = torch.eye(d) - torch.full(
        (d, d), 1.0 / d
    )  # GPT-2's stream is centred: a reader's part along ones reads nothing
    for name, tensor in merged.items():
        expected = (moved_a[name] + moved_b[name]) / 2
        if name == "head.weight":
            tensor, expected = tensor @ centring, expected @ centring
        torch.testing.assert_close(tensor, expected, rtol=1e-4, atol=1e-4, msg=name)
    card = ModelCard.load(out / "README.md").text
    assert "## Transforms" in card and "`transforms.safetensors`" in card and "Transform.load(" in card


def test_no_transforms_are_saved_when_opted_out_or_for_the_plain_average(tmp_path):
    a, b = _pair(tmp_path)
    for name, flags in (
        ("opted-out", ["--method", "weight", "--no-save-transforms"]),
        ("average", ["--method", "average"]),
    ):
        out = tmp_path / name
        assert main(["merge", str(a), str(b), "-o", str(out), "-q", *flags]) == 0
        assert not {"transforms.safetensors", "transforms.json"} & {p.name for p in out.iterdir()}, name
        assert "## Transforms" not in ModelCard.load(out / "README.md").text, name
