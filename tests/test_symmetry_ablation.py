"""``benchmarks/symmetry_ablation.py``: a matcher's barrier with each kind of symmetry left out."""

import json

import pytest

from benchmarks import suite, symmetry_ablation
from hf_lmc.symmetry.sample import KINDS, PRESETS


def test_every_kind_of_the_whole_group_is_left_out_once():
    groups = symmetry_ablation.groups()
    left_out = [PRESETS["full"] - kinds for name, kinds in groups.items() if name.startswith("without")]
    assert sorted(kind for (kind,) in left_out) == sorted(PRESETS["full"])
    assert {"full", "permutation"} <= set(groups) and PRESETS["full"] <= set(KINDS)


@pytest.mark.slow
def test_the_whole_groups_barrier_is_the_suites(monkeypatch, tmp_path):
    """The ablation's pair is the suite's: with the whole group it gives the suite's weight-matching
    barrier, and every group is recorded with the kinds it searched."""
    monkeypatch.setenv("HF_LMC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "ablation.json"
    assert symmetry_ablation.main(["--pair", "ci-vit", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    (result,) = suite.run("ci", labels=("vanilla", "weight"), families=("vit",))
    rows = {row["group"]: row for row in record["groups"]}
    assert rows["full"]["barrier"] == pytest.approx(result.barriers["weight"], abs=1e-6)
    assert record["average"] == pytest.approx(result.barriers["vanilla"], abs=1e-6)
    assert set(rows) == set(symmetry_ablation.groups())
    assert set(rows["without residual"]["kinds"]) == PRESETS["full"] - {"residual"}
