"""``hf-lmc inspect`` (:mod:`hf_lmc.commands.inspect`): what it reads from configs and weights, on pairs whose
relation is known: the shipped zoo pair (independent trainings), twins (one model moved by a
symmetry), fine-tunes of one model, and pairs the merge refuses."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_lmc.io.loading
from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.cli import main
from hf_lmc.commands.inspect import FINE_TUNE_COSINE, SAME_GRAM, inspect_models
from hf_lmc.config.options import MergeRequest
from hf_lmc.io import zoo
from hf_lmc.merging.pipeline import plan
from hf_lmc.symmetry import resolve_kinds
from tests.models import build_model, twin_folders


@pytest.fixture(scope="module")
def zoo_pair(tmp_path_factory):
    """The gpt2 zoo pair the package ships (seeds 0 and 1: independent trainings)."""
    return zoo.pair("gpt2", cache=tmp_path_factory.mktemp("zoo"), progress=False)


@pytest.fixture(autouse=True)
def no_whole_model(monkeypatch):
    """Inspect streams the weights: loading a whole model fails the test."""
    monkeypatch.setattr(hf_lmc.io.loading, "load_model", lambda *args, **kwargs: pytest.fail("a model was loaded"))


def _saved(model, folder):
    model.save_pretrained(folder)
    return folder


@pytest.mark.slow  # the zoo pair: unpacked, then streamed
def test_the_zoo_pair_reads_as_independent_trainings_and_weight_matching_is_recommended(zoo_pair):
    a, b = zoo_pair
    report = inspect_models([a, b])
    assert report.mergeable and report.refusal is None and not report.differences
    (similarity,) = report.similarities
    assert similarity.relation == report.relation == "independent"
    assert similarity.lowest < FINE_TUNE_COSINE and similarity.gram > SAME_GRAM
    assert [g for g, _, _ in similarity.groups] == ["embed", "0", "1", "2", "3", "head"]
    assert "merge" in report.recommended and "--method" not in report.recommended  # the default, weight matching
    assert {c.method for c in report.costs} == {"average", "weight", "activation", "learned", "dual"}


@pytest.mark.slow  # the zoo pair: unpacked, then streamed
def test_a_few_sgd_steps_from_a_read_as_fine_tunes_and_the_average_is_recommended(zoo_pair, tmp_path):
    a, _ = zoo_pair
    model = AutoModelForCausalLM.from_pretrained(a).train()
    optimiser = torch.optim.SGD(model.parameters(), lr=0.05)
    text = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 2
    ids = AutoTokenizer.from_pretrained(a)(text, return_tensors="pt").input_ids[:, :64]
    for _ in range(5):
        model(input_ids=ids, labels=ids).loss.backward()
        optimiser.step()
        optimiser.zero_grad()
    tuned = _saved(model, tmp_path / "tuned")
    assert not torch.equal(
        model.transformer.h[0].mlp.c_fc.weight, AutoModelForCausalLM.from_pretrained(a).transformer.h[0].mlp.c_fc.weight
    )
    report = inspect_models([a, tuned])
    (similarity,) = report.similarities
    assert report.relation == "fine-tunes" and similarity.lowest >= FINE_TUNE_COSINE
    assert all(distance > 0 for _, _, distance in similarity.groups)  # not the same weights: a fine-tune
    assert report.recommended.endswith("--method average")


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "llama", "vit"])
def test_twins_read_as_one_model_moved_by_a_symmetry(tmp_path, arch):
    """A model and its copy moved by a random full symmetry compute the same function, but their
    weights are as unlike as independent trainings' (a plain average would break them): inspect
    tells them apart by the inner products every symmetry keeps, and recommends weight matching."""
    _, (a, b) = twin_folders(tmp_path, arch, [7])
    report = inspect_models([a, b])
    (similarity,) = report.similarities
    assert similarity.lowest < FINE_TUNE_COSINE
    assert similarity.gram <= SAME_GRAM
    assert report.relation == "twins"
    assert "--method" not in report.recommended


def test_a_copy_plus_small_noise_reads_as_a_fine_tune(tmp_path):
    model = build_model(tiny_configs()["llama"], seed=0, dtype=torch.float32)
    a = _saved(model, tmp_path / "a")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * p.abs().mean() * torch.randn_like(p))
    report = inspect_models([a, _saved(model, tmp_path / "b")])
    assert report.relation == "fine-tunes"


def test_a_pair_the_merge_refuses_is_reported_with_every_difference(tmp_path):
    config = tiny_configs()["gpt2"]
    a = _saved(build_model(config, seed=0, dtype=torch.float32), tmp_path / "a")
    other = config.__class__.from_dict(
        {**config.to_dict(), "n_layer": config.n_layer + 1, "activation_function": "relu"}
    )
    b = _saved(build_model(other, seed=1, dtype=torch.float32), tmp_path / "b")
    report = inspect_models([a, b])
    assert not report.mergeable and report.refusal and report.recommended is None
    assert any("num_layers" in d for d in report.differences), report.differences
    assert any("activation_function" in d for d in report.differences), report.differences
    assert report.similarities == () and report.costs == ()
    assert "refused" in report.table()


def test_two_families_are_refused_as_the_merge_refuses_them(tmp_path):
    a = _saved(build_model(tiny_configs()["gpt2"], dtype=torch.float32), tmp_path / "a")
    b = _saved(build_model(tiny_configs()["llama"], dtype=torch.float32), tmp_path / "b")
    report = inspect_models([a, b])
    assert not report.mergeable
    assert report.differences == ("A vs B: model_type gpt2 vs llama",)


@pytest.mark.slow  # the zoo pair: unpacked, then streamed
def test_the_estimates_are_the_dry_runs(zoo_pair, tmp_path):
    """One estimate model: inspect's weight-matching cost is what ``merge --dry-run`` prints."""
    a, b = zoo_pair
    costs = {c.method: c for c in inspect_models([a, b]).costs}
    planned = plan(MergeRequest(models=[a, b], output=str(tmp_path / "out")))
    assert (costs["weight"].seconds, costs["weight"].peak_bytes) == (planned.seconds, planned.peak_bytes)
    assert costs["dual"].seconds > costs["weight"].seconds >= costs["average"].seconds
    assert costs["dual"].peak_bytes >= costs["weight"].peak_bytes


def test_the_symmetry_groups_follow_the_architecture_and_the_preset(tmp_path):
    _, (a, b) = twin_folders(tmp_path, "llama", [7])
    full = dict(inspect_models([a, b]).groups)
    assert set(full) == resolve_kinds("full")
    assert "SwiGLU" in full["mlp_scale"] and "query heads" in full["heads"]  # gated MLP; GQA
    gpt2 = dict(inspect_models(twin_folders(tmp_path / "g", "gpt2", [7])[1]).groups)
    assert "does not apply" in gpt2["mlp_scale"]
    assert set(dict(inspect_models([a, b], symmetries="permutation").groups)) == resolve_kinds("permutation")


def test_three_models_are_each_compared_with_the_first(tmp_path):
    _, folders = twin_folders(tmp_path, "gpt2", [7, 8])
    report = inspect_models(folders)
    assert [s.model for s in report.similarities] == ["B", "C"]
    assert report.relation == "twins"
    assert "activation" not in {c.method for c in report.costs}  # it merges two models only


@pytest.mark.slow  # the zoo pair: unpacked, then streamed
def test_json_carries_the_facts_of_the_report(zoo_pair, capsys):
    a, b = map(str, zoo_pair)
    assert main(["inspect", a, b, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    report = inspect_models([a, b])
    facts = json.loads(report.to_json())
    assert (facts["relation"], facts["recommended"], facts["mergeable"]) == (report.relation, report.recommended, True)
    for key in ("mergeable", "refusal", "differences", "relation", "recommended", "groups", "symmetries"):
        assert printed[key] == facts[key], key
    assert [m["spec"] for m in printed["models"]] == [m["spec"] for m in facts["models"]]
    assert printed["similarities"][0]["groups"] == facts["similarities"][0]["groups"]
    assert [c["method"] for c in printed["costs"]] == [c["method"] for c in facts["costs"]]
    assert main(["inspect", a, b]) == 0
    assert "recommended: hf-lmc merge" in capsys.readouterr().out


def test_a_refused_pair_exits_0_with_the_report(tmp_path, capsys):
    a = _saved(build_model(tiny_configs()["gpt2"], dtype=torch.float32), tmp_path / "a")
    b = _saved(build_model(tiny_configs()["llama"], dtype=torch.float32), tmp_path / "b")
    capsys.readouterr()
    assert main(["inspect", str(a), str(b), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mergeable"] is False


@pytest.mark.parametrize("bad", ["missing", "empty", "file"])
def test_a_bad_model_reference_is_one_error_line(tmp_path, capsys, bad):
    a = str(_saved(build_model(tiny_configs()["gpt2"], dtype=torch.float32), tmp_path / "a"))
    capsys.readouterr()
    reference = {"missing": tmp_path / "nothing-here", "empty": tmp_path / "empty", "file": tmp_path / "f.txt"}[bad]
    if bad == "empty":
        reference.mkdir()
    if bad == "file":
        reference.write_text("not a model")
    assert main(["inspect", a, str(reference)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hf-lmc: error:") and err.count("\n") == 1, err


def test_one_model_is_a_usage_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-lmc: error:") and err.count("\n") == 1, err


def test_models_of_two_widths_are_allowed_and_read_as_independent(tmp_path):
    """A width merge is allowed (at the wider shape); no tensor pairs up, so no similarity is
    computed, and weight matching is recommended."""
    config = tiny_configs()["gpt2"]
    wider = config.__class__.from_dict({**config.to_dict(), "n_embd": 2 * config.n_embd, "n_head": 2 * config.n_head})
    a = _saved(build_model(config, seed=0, dtype=torch.float32), tmp_path / "a")
    b = _saved(build_model(wider, seed=1, dtype=torch.float32), tmp_path / "b")
    report = inspect_models([a, b])
    assert report.mergeable and report.notes  # the card's note on the embedding into the wider shape
    assert report.relation == "different widths" and report.similarities[0].lowest is None
    assert "--method" not in report.recommended
    assert json.loads(report.to_json())["similarities"][0]["gram"] is None
    assert "two widths" in report.table()


def test_a_gpu_adds_its_estimate(tmp_path, monkeypatch):
    """Where torch sees a GPU each method gets a GPU time too, no longer than the CPU's."""
    import hf_lmc.commands.inspect

    _, folders = twin_folders(tmp_path, "gpt2", [7])
    assert (
        all(c.gpu_seconds is None for c in inspect_models(folders).costs)
        or hf_lmc.commands.inspect.torch.cuda.is_available()
    )
    monkeypatch.setattr(hf_lmc.commands.inspect.torch.cuda, "is_available", lambda: True)
    costs = inspect_models(folders).costs
    assert all(c.gpu_seconds is not None and c.gpu_seconds <= c.seconds for c in costs)
    assert "on a GPU" in inspect_models(folders).table()


def test_the_embeddings_and_head_read_in_row_blocks_give_the_whole_tensors_figures(tmp_path, monkeypatch):
    """The token rows are compared a block at a time (bounded memory at any vocabulary); the
    figures are those of the whole tensors."""
    import hf_lmc.commands.inspect

    model = build_model(tiny_configs()["gpt2"], seed=0, dtype=torch.float32)
    a = _saved(model, tmp_path / "a")
    b = _saved(build_model(tiny_configs()["gpt2"], seed=1, dtype=torch.float32), tmp_path / "b")
    whole = inspect_models([a, b]).similarities[0]
    monkeypatch.setattr(hf_lmc.commands.inspect, "block_rows", lambda spec: 3)
    blocked = inspect_models([a, b]).similarities[0]
    assert [g for g, _, _ in blocked.groups] == [g for g, _, _ in whole.groups]
    for (_, cosine, distance), (_, expected, expected_distance) in zip(blocked.groups, whole.groups):
        assert cosine == pytest.approx(expected, abs=1e-6) and distance == pytest.approx(expected_distance, rel=1e-6)
    assert blocked.gram == pytest.approx(whole.gram, rel=1e-9)
