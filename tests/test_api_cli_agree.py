"""The Python API and the command line give the same merge for the same settings: one options
object reaches the training loop from both, and a bare ``fit`` holds out and stops as
``hf-lmc merge`` does."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import hf_lmc
from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.cli import main
from hf_lmc.config.options import FIT_OPTIONS, LearnOptions
from hf_lmc.evaluation.batches import load_batches
from hf_lmc.learned import TrainedMatcher
from tests.models import build_model, transform_tensors


def _tensors(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        if file.name != "transforms.safetensors":  # the merge's weights only, not the transforms it saves
            tensors |= load_file(file)
    return tensors


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two independent tiny ViTs and fitting images that cut into eight batches of four (more
    steps than batches then train on the held-out batch unless it is held out)."""
    folder = tmp_path_factory.mktemp("pair")
    for seed, name in ((1, "a"), (2, "b")):  # independent: dual matching has something to learn
        build_model(tiny_configs()["vit"], seed=seed, dtype=torch.float32).save_pretrained(folder / name)
    g = torch.Generator().manual_seed(0)
    data = folder / "fit.pt"
    torch.save(
        {"pixel_values": torch.randn(32, 3, 8, 8, generator=g), "labels": torch.randint(0, 3, (32,), generator=g)}, data
    )
    return folder


# target 0: the held-out batches are cut and estimated on, and every step of the budget trains;
# the default target: training stops where the estimate reaches it (here: on the start's estimate or later).
@pytest.mark.slow
@pytest.mark.parametrize("target", [0.0, None])
def test_the_command_line_and_the_python_api_merge_alike(pair, tmp_path, target):
    a, b, data = pair / "a", pair / "b", pair / "fit.pt"
    settings = {"steps": 10, "lr": 2e-2, "seed": 0} | ({} if target is None else {"target_barrier": target})
    flags = ["--steps", "10", "--lr", "0.02", "--seed", "0"] + ([] if target is None else ["--target-barrier", "0"])
    batch = ["--batch-size", "4"]
    assert (
        main(
            [
                "merge",
                str(a),
                str(b),
                "-o",
                str(tmp_path / "cli"),
                "--method",
                "dual",
                "--data",
                str(data),
                *batch,
                *flags,
            ]
        )
        == 0
    )
    data_options = FIT_OPTIONS.model_copy(update={"batch_size": 4})
    hf_lmc.merge(
        a,
        b,
        tmp_path / "api",
        method="dual",
        data=str(data),
        data_options=data_options,
        learn=LearnOptions(**settings),
        progress=False,
    )
    cli, api = _tensors(tmp_path / "cli"), _tensors(tmp_path / "api")
    assert cli.keys() == api.keys()
    assert all(torch.equal(cli[name], api[name]) for name in cli)

    # The path trained by hand, with the same settings as keywords and no holdout of its own:
    # fit cuts the held-out batches and applies the stopping rule as the command line does.
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(a)
    batches = load_batches(str(data), config, a, data_options)
    path = hf_lmc.DualMatcher(a, b, **settings)
    path.fit(batches, progress=False)
    # Exactly the transforms the pipeline's matcher trains, from the same canonical models.
    canonical = [hf_lmc.canonicalize(folder, dtype=torch.float32) for folder in (a, b)]
    piped = TrainedMatcher(hf_lmc.DualMatcher, batches, learn=LearnOptions(**settings), progress=False).fit(canonical)
    for mine, theirs in zip(path.transforms(), piped, strict=True):
        mine, theirs = transform_tensors(mine), transform_tensors(theirs)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    merged = path.merge(0.5).state_dict()
    # The CLI's transforms are the path's: its merge, written by the exporter, is the path's merge
    # up to the rounding of a different order of sums.
    for name, tensor in cli.items():
        torch.testing.assert_close(merged[name].to(tensor.dtype), tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_a_bare_fit_holds_out_and_stops_as_the_command_line_does(pair):
    """``fit`` with no settings trains with the path's options: the held-out batches cut from the
    list, and the stopping rule of ``hf-lmc merge``."""
    from transformers import AutoConfig

    a, b, data = pair / "a", pair / "b", pair / "fit.pt"
    batches = load_batches(
        str(data), AutoConfig.from_pretrained(a), a, FIT_OPTIONS.model_copy(update={"batch_size": 4})
    )
    path = hf_lmc.DualMatcher(a, b, steps=3, target_barrier=0)
    assert len(path.fit(batches, progress=False)) == 3
    assert path.stopping.holdout_batches == 1 and path.stopping.estimate is not None
    unwatched = hf_lmc.DualMatcher(a, b, steps=3)
    unwatched.fit(batches, target_barrier=None, progress=False)
    assert unwatched.stopping.estimate is None and unwatched.stopping.holdout_batches == 0
    with pytest.raises(ValueError, match="orthogonal: the path was built with"):
        path.fit(batches, orthogonal="exp", progress=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'step'"):
        path.fit(batches, step=3, progress=False)
