"""``hf-lmc explain``: the midpoint's excess attributed to groups of tensors, before and after alignment."""

from __future__ import annotations

import json
import re

import pytest
import torch

from hf_lmc import canonicalize
from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.cli import main
from hf_lmc.config.options import ParameterError
from hf_lmc.evaluation.explain import explain, explanation_group, kinds_table, plot_explanation
from tests.models import ARCHITECTURES, build_model, twin_folders


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_canonical_tensor_has_a_group(arch):
    names = canonicalize(build_model(tiny_configs()[arch])).state_dict()
    groups = {explanation_group(name) for name in names}
    layers = tiny_configs()[arch].num_hidden_layers
    expected = {"embeddings", "head"} | {f"layer {i} {kind}" for i in range(layers) for kind in ("QK", "OV", "MLP")}
    assert groups == expected


def _images(config, count=32):
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(count, config.num_channels, config.image_size, config.image_size, generator=g)
    return {"pixel_values": pixels, "labels": torch.randint(0, config.num_labels, (count,), generator=g)}


def _data(config):
    if config.model_type == "vit":
        return [_images(config)]
    return [{"input_ids": torch.randint(0, config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))}]


def _adds_up(result, path) -> bool:
    """Every order's parts, their mean and the per-kind sums each add up to the path's excess."""
    sums = [sum(parts.values()) for parts in (*result.by_order[path], result.parts[path], result.by_kind()[path])]
    return all(abs(total - result.excess[path]) < 1e-5 for total in sums)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_parts_add_up_to_the_excess_on_both_paths(arch):
    """Two unrelated models (so both paths have an excess and the groups interact): the parts
    telescope, so they add up to the total excess for every order, and the mean lies in its range."""
    config = tiny_configs()[arch]
    a, b = build_model(config, seed=0, dtype=torch.float32), build_model(config, seed=1, dtype=torch.float32)
    result = explain(a, b, _data(config), orders=3, progress=False)
    assert len(result.orders) == 3 and result.orders[1] == result.orders[0][::-1]
    assert result.orders[0][0] == "embeddings" and result.orders[0][-1] == "head"  # the network's order first
    for path in ("average", "weight"):
        assert abs(result.excess[path]) > 1e-3 and _adds_up(result, path)
        assert all(low <= result.parts[path][g] <= high for g, (low, high) in result.spread[path].items())
    assert any(high - low > 1e-4 for low, high in result.spread["average"].values())  # the order matters


@pytest.mark.parametrize("arch", ["vit", pytest.param("llama", marks=pytest.mark.slow)])
def test_a_twin_has_no_excess_after_alignment_and_the_average_excess_is_attributed(arch, tmp_path):
    """B is a random symmetry of A (plus nothing): weight matching recovers it, so the aligned
    path is A all along (excess and every part zero), while the average's path has an excess
    that the groups carry."""
    model, (a, b) = twin_folders(tmp_path, arch, [3])
    result = explain(a, b, _data(model.config), progress=False)
    assert abs(result.loss_a - result.loss_b) < 1e-4
    assert abs(result.excess["weight"]) < 1e-4
    assert abs(result.midpoint["average"] - result.loss_a) > 1e-3  # random models: any sign
    assert all(abs(v) < 1e-4 for parts in result.by_order["weight"] for v in parts.values())
    assert max(abs(v) for v in result.parts["average"].values()) > 1e-3 and _adds_up(result, "average")
    assert set(result.parts["average"]) == set(result.parts["weight"])


def _table_numbers(text: str) -> dict[str, list[float]]:
    """``row label -> its numbers`` of the markdown table(s) in ``text``."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip(" *") for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and not cells[0].startswith("-"):
            rows.setdefault(cells[0], [float(x) for c in cells[1:] for x in re.findall(r"-?\d+\.\d+", c)])
    return rows


def test_the_table_and_the_json_carry_the_same_numbers_and_the_plot_is_written(tmp_path):
    config = tiny_configs()["vit"]
    a, b = build_model(config, seed=0, dtype=torch.float32), build_model(config, seed=1, dtype=torch.float32)
    result = explain(a, b, _data(config), progress=False)
    report, table = json.loads(result.to_json()), _table_numbers(result.table())
    assert "positive = adds to the barrier" in result.table()  # the footer says how to read it
    for group, part in report["parts"]["average"].items():
        expected = [part, *report["spread"]["average"][group]]
        expected += [report["parts"]["weight"][group], *report["spread"]["weight"][group]]
        assert table[group] == pytest.approx(expected, abs=1e-4), group
    assert table["total excess"] == pytest.approx(list(report["excess"].values()), abs=1e-4)
    kinds = _table_numbers(kinds_table(result))
    for kind, part in report["by_kind"]["weight"].items():
        assert kinds[kind] == pytest.approx([report["by_kind"]["average"][kind], part], abs=1e-4), kind
    assert plot_explanation(result, tmp_path / "why.png").stat().st_size > 0


def test_the_command_prints_tables_or_json_and_plots(tmp_path, capsys):
    model, (a, b) = twin_folders(tmp_path, "vit", [3])
    torch.save(_images(model.config), tmp_path / "eval.pt")
    command = ["explain", str(a), str(b), "--eval-data", str(tmp_path / "eval.pt"), "-q"]
    assert main([*command, "--json", "--orders", "1", "--plot", str(tmp_path / "why.png")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["excess"]) == {"average", "weight"} and "QK" in report["by_kind"]["weight"]
    assert len(report["orders"]) == 1 and (tmp_path / "why.png").stat().st_size > 0
    assert main([*command, "--method", "average", "--orders", "1"]) == 0
    out = capsys.readouterr().out
    assert "total excess" in out and "positive = adds to the barrier" in out and "weight" not in out


def test_a_bad_order_count_is_refused_before_any_model_is_read(capsys):
    """The models do not exist: the refusal comes first, one line naming the flag (or keyword)."""
    assert main(["explain", "./no/such/a", "./no/such/b", "--eval-data", "unused.pt", "--orders", "0"]) == 2
    err = capsys.readouterr().err
    assert "--orders" in err and err.count("\n") == 1
    with pytest.raises(ParameterError, match="orders"):
        explain("./no/such/a", "./no/such/b", [], orders=0)


def test_two_models_only():
    """explain compares a pair: argparse refuses a third model (exit 2) before anything is read."""
    with pytest.raises(SystemExit) as refused:
        main(["explain", "./no/such/a", "./no/such/b", "./no/such/c", "--eval-data", "unused.pt"])
    assert refused.value.code == 2
