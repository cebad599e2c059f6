"""Merging M models: universe matching is exact for twins, learned refinement over the simplex,
the simplex barrier, and ``merge_models`` / ``hf-lmc merge A B C`` end to end."""

from __future__ import annotations

import json

import pytest
import torch
from huggingface_hub import ModelCard
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import hf_lmc
from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.canonical.form import combine
from hf_lmc.cli import main
from hf_lmc.evaluation.barriers import alpha_grid, loss_barrier, simplex_barrier, simplex_grid
from hf_lmc.merging.pipeline import merge, merge_models
from tests.models import (
    ARCHITECTURES,
    CONFIGS,
    MODEL_CLASSES,
    build_model,
    logits,
    relative_error,
    sample_inputs,
    twin_folders,
)
from tests.test_merge import _fails, _save


def _twins(model, seeds):
    """``model`` moved by a random full symmetry per seed (canonical, in memory)."""
    a = hf_lmc.canonicalize(model)
    return [hf_lmc.random_symmetry(a.spec, seed=s, dtype=torch.float32).apply(a).materialize() for s in seeds]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_universe_merge_of_twins_computes_the_model(arch):
    """If every model is a random symmetry of A (A itself among them, not first), the weighted
    universe merge is A's function, whatever the weights."""

    @settings(max_examples=3, deadline=None)
    @given(
        config=CONFIGS[arch](), seed=st.integers(0, 2**16), raw=st.lists(st.floats(0.05, 1.0), min_size=3, max_size=3)
    )
    def run(config, seed, raw):
        model = build_model(config, seed=seed, dtype=torch.float32)
        models = _twins(model, [seed + 1, seed + 2])
        models.insert(1, hf_lmc.canonicalize(model))
        weights = [w / sum(raw) for w in raw]
        transforms = hf_lmc.UniverseMatcher(progress=False).fit(models, weights)
        merged = combine([t.to(torch.float32).apply(m) for t, m in zip(transforms, models)], weights)
        inputs = sample_inputs(config, seed=seed)
        err = relative_error(logits(hf_lmc.to_hf(merged), inputs), logits(model, inputs))
        assert err < 1e-3, f"universe merge of twins off by {err:.2e}"

    run()


@pytest.mark.slow
def test_universe_matching_pulls_independent_models_together():
    config = tiny_configs()["gpt_neox"]
    models = [hf_lmc.canonicalize(build_model(config, seed=s, dtype=torch.float32)) for s in (1, 2, 3)]
    matcher = hf_lmc.UniverseMatcher(max_rounds=2, progress=False)
    transforms = matcher.fit(models)
    aligned = [t.to(torch.float32).apply(m).materialize() for t, m in zip(transforms, models)]

    def spread(ms):  # mean squared distance of each model to the average, over all tensors
        mean = combine(ms, [1 / 3] * 3).state_dict()
        return sum((m.state_dict()[n] - t).square().sum().item() for m in ms for n, t in mean.items())

    assert spread(aligned) < 0.8 * spread(models)
    assert len(matcher.history) >= 2  # the seed and at least one leave-one-out round


def test_simplex_grid_and_barrier():
    grid = simplex_grid(3, 3)  # steps of 1/2: 3 vertices, 3 edge midpoints, plus the centre
    assert len(grid) == 7 and grid[:3] == [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)]
    assert grid[-1] == pytest.approx((1 / 3,) * 3) and all(sum(w) == pytest.approx(1) for w in grid)
    assert len(simplex_grid(4, 5)) == 35  # C(4 + 3, 3): the centre (1/4, ...) is on this grid
    pair = simplex_grid(2, 5)
    assert sorted(w[1] for w in pair) == alpha_grid(5)
    losses = [1.0, 1.6, 2.5, 2.6, 3.0]  # along alpha: the two-model barrier is 0.5
    by_alpha = dict(zip(alpha_grid(5), losses))
    assert simplex_barrier(pair, [by_alpha[w[1]] for w in pair]) == pytest.approx(loss_barrier(alpha_grid(5), losses))
    # three models with losses 1, 2, 3 and a flat plane except 0.7 above it at the centre
    plane = [sum(x * v for x, v in zip(w, (1.0, 2.0, 3.0))) for w in grid]
    assert simplex_barrier(grid, plane[:-1] + [plane[-1] + 0.7]) == pytest.approx(0.7)
    with pytest.raises(ValueError, match="every vertex"):
        simplex_barrier(grid[3:], plane[3:])


@pytest.mark.slow
@pytest.mark.parametrize("learns_first", [True, False])
def test_simplex_matcher_is_exact_at_twins_and_at_vertices(learns_first):
    config = tiny_configs()["llama"]
    model = build_model(config, seed=0, dtype=torch.float64)
    twins = [hf_lmc.to_hf(t) for t in _twins(model, [1, 2])]
    matcher = hf_lmc.SimplexMatcher([twins[0], model, twins[1]], learns_first=learns_first, dtype=torch.float64)
    inputs = sample_inputs(config)
    assert relative_error(logits(matcher.merge([0.2, 0.5, 0.3]), inputs), logits(model, inputs)) < 1e-5
    # transforms() are of the models as given (their fixed assignments composed back in)
    given = [
        t.apply(hf_lmc.canonicalize(m, dtype=torch.float64))
        for t, m in zip(matcher.transforms(), [twins[0], model, twins[1]])
    ]
    rebuilt = hf_lmc.to_hf(hf_lmc.canonical.form.combine(given, [0.2, 0.5, 0.3]))
    assert relative_error(logits(rebuilt, inputs), logits(matcher.merge([0.2, 0.5, 0.3]), inputs)) < 1e-10

    others = [build_model(config, seed=s) for s in (1, 2, 3)]
    matcher = hf_lmc.SimplexMatcher(others, init="identity", learns_first=learns_first, dtype=torch.float64)
    trainable = [p for p in matcher.parameters() if p.requires_grad]
    assert trainable and len(matcher.learned) == (3 if learns_first else 2)
    batches = [
        {"input_ids": torch.randint(0, config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(i))}
        for i in range(2)
    ]
    centre = [1 / 3] * 3
    before = matcher(batches[0], weights=centre).item()
    torch.manual_seed(0)
    matcher.fit(batches, steps=12, lr=1e-2, progress=False)
    assert matcher(batches[0], weights=centre).item() < before
    for k, expected in enumerate(others):  # every vertex is its model, exactly
        vertex = [float(j == k) for j in range(3)]
        assert relative_error(logits(matcher.merge(vertex), inputs), logits(expected, inputs)) < 1e-6


def test_cli_merge_of_three_twins_lists_every_model_and_weight(tmp_path, capsys):
    model, folders = twin_folders(tmp_path, "gpt2", [5, 6])
    out = tmp_path / "merged"
    assert main(["merge", *map(str, folders), "-o", str(out), "--weights", "0.5", "0.3", "0.2"]) == 0
    merged = MODEL_CLASSES["gpt2"].from_pretrained(out).eval()
    inputs = sample_inputs(model.config)
    assert relative_error(logits(merged, inputs), logits(model, inputs)) < 1e-3
    card = ModelCard.load(out / "README.md")
    assert "base_model" not in card.data.to_dict()  # local folders are described in the body only
    assert f"| weights | `{folders[0].name}`: 0.5, `{folders[1].name}`: 0.3, `{folders[2].name}`: 0.2 |" in card.text
    assert "universe weight matching" in card.text


def test_average_of_three_is_the_weighted_mean_of_stored_weights(tmp_path):
    config = tiny_configs()["gpt_neox"]
    models = [build_model(config, seed=s, dtype=torch.float32) for s in (1, 2, 3)]
    folders = [_save(m, tmp_path / f"m{k}") for k, m in enumerate(models)]
    weights = (0.2, 0.3, 0.5)
    result = merge_models(folders, tmp_path / "avg", weights=weights, method="average", progress=False)
    assert result.weights == weights and result.alpha is None
    merged = MODEL_CLASSES["gpt_neox"].from_pretrained(result.output)
    for key, value in merged.state_dict().items():
        expected = sum(w * m.state_dict()[key] for w, m in zip(weights, models))
        torch.testing.assert_close(value, expected, msg=key)


def test_two_models_through_merge_models_are_merge_bit_for_bit(tmp_path):
    config = tiny_configs()["llama"]
    a, b = (_save(build_model(config, seed=s, dtype=torch.float32), tmp_path / f"m{s}") for s in (1, 2))
    one = merge(a, b, tmp_path / "merge", alpha=0.3, progress=False)
    other = merge_models([a, b], tmp_path / "many", weights=[0.7, 0.3], progress=False)
    assert other.alpha == pytest.approx(0.3)
    expected, got = load_file(one.output / "model.safetensors"), load_file(other.output / "model.safetensors")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.slow
def test_dual_merge_of_three_twins_with_the_simplex_barrier_in_the_card(tmp_path, capsys):
    model, folders = twin_folders(tmp_path, "vit", [5, 6])
    torch.save({"pixel_values": torch.randn(12, 3, 8, 8), "labels": torch.randint(0, 3, (12,))}, tmp_path / "fit.pt")
    torch.save({"pixel_values": torch.randn(8, 3, 8, 8), "labels": torch.randint(0, 3, (8,))}, tmp_path / "eval.pt")
    out = tmp_path / "dual"
    args = [
        "merge",
        *map(str, folders),
        "-o",
        str(out),
        "--method",
        "dual",
        "--data",
        str(tmp_path / "fit.pt"),
        "--batch-size",
        "4",
        "--steps",
        "3",
        "--lr",
        "1e-4",
        "--eval-data",
        str(tmp_path / "eval.pt"),
        "--alphas",
        "3",
    ]
    assert main(args) == 0
    merged = MODEL_CLASSES["vit"].from_pretrained(out).eval()
    inputs = sample_inputs(model.config)
    assert relative_error(logits(merged, inputs), logits(model, inputs)) < 1e-3
    card = (out / "README.md").read_text()
    assert "| method | `dual` |" in card and "worst point w" in card and "| dual |" in card and "| average |" in card
    assert "loss_over_simplex.png" in card and (out / "loss_over_simplex.png").stat().st_size > 1000
    table = capsys.readouterr().out
    dual_row = next(line for line in table.splitlines() if line.startswith("| dual |"))
    assert abs(float(dual_row.split("|")[4])) < 1e-4  # twins: flat over the whole simplex


def test_barrier_cli_over_the_simplex_of_three_twins(tmp_path, capsys):
    _, folders = twin_folders(tmp_path, "vit", [5, 6])
    torch.save({"pixel_values": torch.randn(8, 3, 8, 8), "labels": torch.randint(0, 3, (8,))}, tmp_path / "eval.pt")
    plot = tmp_path / "simplex.png"
    args = [
        "barrier",
        *map(str, folders),
        "--eval-data",
        str(tmp_path / "eval.pt"),
        "--alphas",
        "3",
        "--json",
        "--plot",
        str(plot),
    ]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["points"]) == len(simplex_grid(3, 3)) and abs(report["barriers"]["weight"]) < 1e-4
    assert set(report["barriers"]) == {"average", "weight"} and plot.stat().st_size > 1000
    _fails(
        ["barrier", *map(str, folders), "--eval-data", "x.pt", "--revisions", "main"],
        capsys,
        tmp_path,
        "one entry per model",
    )
    with pytest.raises(ValueError, match="one entry per model"):  # the Python API checks it too
        hf_lmc.evaluation.barriers.barrier_over_simplex(folders, tmp_path / "eval.pt", revisions=["main"])


def test_bad_multi_model_input(tmp_path, capsys):
    _, folders = twin_folders(tmp_path, "llama", [5, 6])
    models, out = [str(f) for f in folders], str(tmp_path / "out")
    _fails(["merge", models[0], "-o", out], capsys, tmp_path, "at least 2 models")
    _fails(["merge", *models, "-o", out, "--alpha", "0.3"], capsys, tmp_path, "pass --weights")
    _fails(["merge", *models[:2], "-o", out, "--alpha", "0.3", "--weights", "0.7", "0.3"], capsys, tmp_path, "not both")
    _fails(["merge", *models, "-o", out, "--weights", "0.5", "0.5"], capsys, tmp_path, "got 2 for 3 models")
    _fails(["merge", *models, "-o", out, "--weights", "1.5", "-0.25", "-0.25"], capsys, tmp_path, "must be >= 0")
    _fails(["merge", *models, "-o", out, "--weights", "0.5", "0.5", "0.5"], capsys, tmp_path, "must sum to 1")
    _fails(
        ["merge", *models, "-o", out, "--method", "activation", "--data", "x.txt"],
        capsys,
        tmp_path,
        "aligns two models",
    )
    _fails(["merge", *models, "-o", out, "--method", "learned"], capsys, tmp_path, "pass --data")
    _fails(["merge", *models, "-o", out, "--revisions", "main"], capsys, tmp_path, "one entry per model")
