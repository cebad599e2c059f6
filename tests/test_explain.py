"""``hf-lmc explain``: the midpoint's excess attributed to groups of tensors, before and after alignment."""

from __future__ import annotations

import json

import pytest
import torch

from hf_lmc import canonicalize
from hf_lmc.cli import main
from hf_lmc.explain import explain, group_of
from hf_lmc.verify import tiny_configs
from tests.models import ARCHITECTURES, build_model, twin_folders


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_canonical_tensor_has_a_group(arch):
    names = canonicalize(build_model(tiny_configs()[arch])).state_dict()
    groups = {group_of(name) for name in names}
    layers = tiny_configs()[arch].num_hidden_layers
    expected = {"embeddings", "head"} | {f"layer {i} {kind}" for i in range(layers) for kind in ("QK", "OV", "MLP")}
    assert groups == expected


def _images(config, count=32):
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(count, config.num_channels, config.image_size, config.image_size, generator=g)
    return {"pixel_values": pixels, "labels": torch.randint(0, config.num_labels, (count,), generator=g)}


@pytest.mark.parametrize("arch", ["vit", pytest.param("llama", marks=pytest.mark.slow)])
def test_a_twin_has_no_excess_after_alignment_and_the_vanilla_excess_is_attributed(arch, tmp_path):
    """B is a random symmetry of A (plus nothing): weight matching recovers it, so the aligned
    path is A all along (excess and every effect zero), while the vanilla path has an excess
    that the groups carry."""
    model, (a, b) = twin_folders(tmp_path, arch, [3])
    data = [_images(model.config)] if arch == "vit" else [{"input_ids": torch.randint(0, model.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))}]
    result = explain(a, b, data, progress=False)
    assert abs(result.loss_a - result.loss_b) < 1e-4
    assert abs(result.midpoint["vanilla"] - result.loss_a) > 1e-3 and abs(result.excess["weight"]) < 1e-4  # random models: any sign
    assert all(abs(v) < 1e-4 for v in (*result.alone["weight"].values(), *result.knockout["weight"].values()))
    assert max(abs(v) for v in result.alone["vanilla"].values()) > 1e-3
    assert set(result.alone["vanilla"]) == set(result.knockout["vanilla"]) == set(result.alone["weight"])


def test_the_command_prints_tables_or_json_and_plots(tmp_path, capsys):
    model, (a, b) = twin_folders(tmp_path, "vit", [3])
    torch.save(_images(model.config), tmp_path / "eval.pt")
    assert main(["explain", str(a), str(b), "--eval-data", str(tmp_path / "eval.pt"), "--json", "--plot", str(tmp_path / "why.png"), "-q"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["excess"]) == {"vanilla", "weight"} and "QK" in report["by_kind"]["weight"]
    assert (tmp_path / "why.png").stat().st_size > 0
    assert main(["explain", str(a), str(b), "--eval-data", str(tmp_path / "eval.pt"), "--method", "average", "-q"]) == 0
    out = capsys.readouterr().out
    assert "midpoint excess" in out and "weight" not in out
    assert main(["explain", str(a), str(b), str(b), "--eval-data", str(tmp_path / "eval.pt")]) == 2
