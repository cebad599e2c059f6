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
    inputs = {
        "gpt2": {"token", "position"},
        "gpt_neox": {"token"},
        "llama": {"token"},
        "vit": {"patch", "class-token", "position"},  # each of the ViT's inputs on its own
    }[arch]
    expected = {f"{i} embeddings" for i in inputs} | {"head"}
    expected |= {f"layer {i} {kind}" for i in range(layers) for kind in ("QK", "OV", "MLP")}
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
    assert result.orders[0][0].endswith("embeddings") and result.orders[0][-1] == "head"  # the network's order first
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


def _counting(monkeypatch, capsys=None):
    """Wrap explain's evaluations: how many there were, how many batches each read, and what
    stderr held before the first one."""
    import hf_lmc.evaluation.explain as module

    seen = {"calls": 0, "batches": set(), "stderr_before": None}
    original = module.evaluate

    def counted(model, batches):
        if seen["calls"] == 0 and capsys is not None:
            seen["stderr_before"] = capsys.readouterr().err
        seen["calls"] += 1
        seen["batches"].add(len(batches))
        return original(model, batches)

    monkeypatch.setattr(module, "evaluate", counted)
    return seen


def test_explain_caps_its_evaluation_data_by_default_and_a_flag_lifts_the_cap(monkeypatch):
    """Every pass reads the evaluation data: by default only its first EXPLAIN_EVAL_BATCHES
    batches; max_batches sets another count; all_eval_data reads every batch."""
    from hf_lmc.config.options import EXPLAIN_EVAL_BATCHES, EvalOptions

    config = tiny_configs()["gpt2"]
    a, b = build_model(config, seed=0, dtype=torch.float32), build_model(config, seed=1, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": torch.randint(0, config.vocab_size, (2, 8), generator=g)} for _ in range(EXPLAIN_EVAL_BATCHES + 9)
    ]
    for options, everything, read in (
        ({}, False, EXPLAIN_EVAL_BATCHES),
        ({"max_batches": 3}, False, 3),
        ({}, True, len(data)),
    ):
        seen = _counting(monkeypatch)
        announced = []
        explain(
            a,
            b,
            data,
            method="average",
            orders=1,
            eval_options=EvalOptions(**options),
            all_eval_data=everything,
            announce=announced.append,
            progress=False,
        )
        assert seen["batches"] == {read}
        (cost,) = announced
        assert cost.batches == read and cost.passes == seen["calls"] and cost.tokens == read * 16
        assert cost.capped == (not options and not everything)


def test_the_command_prints_its_cost_before_the_first_pass_and_the_dry_run_evaluates_nothing(
    tmp_path, capsys, monkeypatch
):
    from hf_lmc.io import loading

    model, (a, b) = twin_folders(tmp_path, "vit", [3])
    torch.save(_images(model.config, count=8 * 20), tmp_path / "eval.pt")  # 20 batches of 8: more than the cap
    command = ["explain", str(a), str(b), "--eval-data", str(tmp_path / "eval.pt"), "--orders", "1"]

    seen = _counting(monkeypatch, capsys)
    assert main([*command, "--json"]) == 0
    before = seen["stderr_before"]
    passes = int(re.search(r"(\d+) passes", before).group(1))
    assert passes == seen["calls"] and seen["batches"] == {16} and "--all-eval-data" in before
    capsys.readouterr()

    def no_weights(*args, **kwargs):
        raise AssertionError("a dry run loads no weight")

    seen = _counting(monkeypatch)
    monkeypatch.setattr(loading, "load_model", no_weights)
    assert main([*command, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert seen["calls"] == 0 and int(re.search(r"(\d+) passes", out).group(1)) == passes
    assert main([*command, "--dry-run", "--all-eval-data"]) == 0
    assert "20 batches" in capsys.readouterr().out


def test_the_cost_line_is_silenced_by_quiet_and_a_cap_with_all_data_is_refused(tmp_path, capfd):
    model, (a, b) = twin_folders(tmp_path, "vit", [3])
    torch.save(_images(model.config), tmp_path / "eval.pt")
    command = ["explain", str(a), str(b), "--eval-data", str(tmp_path / "eval.pt"), "--orders", "1"]
    capfd.readouterr()  # what saving the models printed
    assert main([*command, "-q", "--method", "average"]) == 0
    assert capfd.readouterr().err == ""  # nothing but errors under -q
    assert main([*command, "--all-eval-data", "--max-batches", "2"]) == 2
    err = capfd.readouterr().err
    assert "--all-eval-data" in err and "--max-batches" in err and err.count("\n") == 1
