"""The benchmark suite's ``ci`` tier: one tiny pair per family, every check in seconds, so that a
change that makes merges worse on the suite fails the tests (``benchmarks/suite.py`` measures
the larger tiers)."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest

from benchmarks import merge_digests, record, suite


@pytest.fixture(autouse=True)
def _no_digest_merges(monkeypatch):
    """The command's tests stand in for the merges behind a record's digests (each a real merge
    of the shipped pair; ``benchmarks/merge_digests.py`` and its test run them)."""
    monkeypatch.setattr(
        merge_digests, "digests", lambda scratch, names=None: {name: f"digest of {name}" for name in names}
    )


def test_a_record_carries_the_digests_of_the_runs_behind_its_methods(monkeypatch, tmp_path):
    """What the tables read as the code behind a figure: the runs of ``SUITE_RUNS`` for the
    methods measured, and no others."""
    monkeypatch.setattr(
        suite,
        "measure_pair",
        lambda pair, labels, **_: suite.PairResult(
            pair.family, pair.entry.name, pair.varies, dict.fromkeys(labels, 0.5), dict.fromkeys(labels, 1.0), []
        ),
    )
    suite.main(
        ["--tier", "ci", "--families", "gpt2", "--methods", "vanilla", "dual", "--json", str(tmp_path / "r.json")]
    )
    saved = json.loads((tmp_path / "r.json").read_text())
    assert set(saved["digests"]) == {"average", "dual", "dual-target"}
    assert set(merge_digests.SUITE_RUNS) == set(suite.LABELS)
    assert {name for runs in merge_digests.SUITE_RUNS.values() for name in runs} <= {n for n, _ in merge_digests.RUNS}


@pytest.mark.slow
def test_the_ci_tier_keeps_its_barriers(tmp_path):
    """Issue 58's guards, on one tiny pair per family: dual matching at the defaults with median
    <= 0.05, worst <= 0.13 and every pair <= 0.1x vanilla; data-free weight matching on the RoPE
    families <= 0.4x vanilla on average and <= 0.55x at worst (the cpu tier's guards, which
    benchmarks/suite.py measures)."""
    results = suite.run("ci", labels=("vanilla", "weight", "dual"), cache=tmp_path)
    assert [r.family for r in results] == list(suite.FAMILIES)
    for r in results:
        vanilla, weight, dual = (r.barriers[label] for label in ("vanilla", "weight", "dual"))
        assert vanilla > 0.2, r  # independently trained: there is a barrier to remove
        # Measured at the commit that added this test: weight/vanilla 0.02-0.37, dual 0.002-0.058.
        assert weight < 0.5 * vanilla, r
        assert dual <= weight + 1e-3 and dual <= 0.1 * vanilla, r
    duals = sorted(r.barriers["dual"] for r in results)
    assert statistics.median(duals) <= 0.05 and duals[-1] <= 0.13, duals
    rope = [r.barriers["weight"] / r.barriers["vanilla"] for r in results if r.family in ("pythia", "llama")]
    assert statistics.mean(rope) <= 0.4 and max(rope) <= 0.55, rope
    rows = suite.summary_rows(results, ("vanilla", "weight", "dual"))
    assert any(row.startswith("| all | dual | 4 |") for row in rows), rows


@pytest.mark.slow
def test_learned_matching_on_sampled_text_keeps_its_guard(tmp_path):
    """``--data sampled`` (no data of one's own): learned matching <= 0.1x vanilla on every
    language pair of the ci tier."""
    results = suite.run(
        "ci",
        labels=("vanilla", "learned"),
        families=("gpt2", "pythia", "llama"),
        cache=tmp_path,
        fitting=suite.Fitting(sampled=True),
    )
    for r in results:
        assert r.barriers["learned"] <= 0.1 * r.barriers["vanilla"], r


@pytest.mark.slow
def test_learned_simplex_refinement_improves_on_universe_matching(tmp_path):
    results = suite.run_triples_of("ci", labels=("vanilla", "weight", "learned"), families=("gpt2",), cache=tmp_path)
    (r,) = results
    assert r.barriers["vanilla"] > 0.2, r
    assert r.barriers["weight"] < 0.5 * r.barriers["vanilla"], r
    # On the cpu tier's triples, training at Dirichlet(0.1) draws (near the vertices) ended above this start (issue 37).
    assert r.barriers["learned"] < r.barriers["weight"] and r.mean_excess["learned"] < r.mean_excess["weight"], r
    rows = suite.triple_rows(results, ("vanilla", "weight", "learned"))
    assert any(row.startswith("| learned | 1 |") for row in rows), rows


def test_with_vocabulary_changes_the_language_pairs_tokens_alone():
    pairs = {pair.family: pair for pair in suite.TIERS["cpu"]}
    for family in ("gpt2", "pythia", "llama"):
        pair = pairs[family]
        bpe = suite.with_vocabulary(pair, 1024)
        assert bpe.entry.vocab_size == 1024 and bpe.entry.name != pair.entry.name
        assert dataclasses.replace(bpe.entry, vocab_size=None, name=pair.entry.name) == pair.entry
        assert bpe.seeds == pair.seeds
    assert suite.with_vocabulary(pairs["vit"], 1024) is pairs["vit"]
    assert suite.with_vocabulary(pairs["gpt2"], None) is pairs["gpt2"]


def test_a_training_cap_changes_the_members_steps_alone():
    """``--max-steps`` (the paper tier on a CPU) shortens the members' training and keeps the rest
    of the pair, its seeds above all: the paper tier's are never the seeds defaults were tuned on."""
    for pair in suite.TIERS["paper"]:
        capped = suite._capped(pair, 500)
        assert capped.seeds == pair.seeds and capped.seeds not in ((0, 1),)
        assert capped.entry.steps == 500 and capped.entry.warmup <= pair.entry.warmup
        assert dataclasses.replace(capped.entry, steps=pair.entry.steps, warmup=pair.entry.warmup) == pair.entry
        assert (capped.family, capped.varies) == (pair.family, pair.varies)
        assert suite._capped(pair, None) is pair and suite._capped(pair, pair.entry.steps) is pair


@pytest.mark.parametrize("vocab_size", [None, 1024])
def test_the_triples_command_measures_the_tiers_triples_with_the_flags_settings(
    vocab_size, monkeypatch, capsys, tmp_path
):
    """``--triples`` hands every flag to the measurement (measure_triple stands in for the
    training and merging: this checks the command's plumbing, not the barriers)."""
    measured = []

    def stand_in(pair, labels, *, cache, progress, learn, fitting):
        measured.append((pair, learn, fitting))
        return suite.TripleResult(
            pair.family,
            pair.entry.name,
            pair.varies,
            dict.fromkeys(labels, 0.5),
            dict.fromkeys(labels, 0.25),
            dict.fromkeys(labels, 1.0),
        )

    monkeypatch.setattr(suite, "measure_triple", stand_in)
    argv = ["--tier", "cpu", "--triples", "--methods", "learned", "--learn", "steps=7", "--fit-sequences", "64"]
    suite.main(argv + (["--vocab-size", str(vocab_size)] if vocab_size else []) + ["--json", str(tmp_path / "r.json")])
    expected = [
        suite.with_vocabulary(pair, vocab_size)
        for pair in suite.TIERS["cpu"]
        if pair.entry.name in suite.TRIPLES["cpu"]
    ]
    assert [pair for pair, _, _ in measured] == expected and len(expected) == 4
    assert all(learn.steps == 7 and fitting.sequences == 64 for _, learn, fitting in measured)
    assert "| learned | 4 |" in capsys.readouterr().out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["benchmark"] == "suite_triples" and saved["settings"]["vocab_size"] == vocab_size
    assert [t["name"] for t in saved["triples"]] == [pair.entry.name for pair in expected]
    assert saved["triples"][0]["barriers"] == {"learned": 0.5} and saved["triples"][0]["mean_excess"] == {
        "learned": 0.25
    }


def test_pairs_picks_the_named_pairs_of_the_tier(monkeypatch, capsys, tmp_path):
    """``--pairs`` measures the named pairs of the tier alone (in the tier's order); a name the
    tier does not have is a usage error before anything trains."""
    assert [p.entry.name for p in suite.tier_pairs("cpu", suite.FAMILIES, ["suite-llama-b", "suite-gpt2-a"])] == [
        "suite-gpt2-a",
        "suite-llama-b",
    ]
    assert suite.tier_pairs("cpu") == list(suite.TIERS["cpu"])
    measured = []
    monkeypatch.setattr(
        suite,
        "measure_pair",
        lambda pair, labels, **_: (
            measured.append(pair.entry.name)
            or suite.PairResult(
                pair.family,
                pair.entry.name,
                pair.varies,
                {label: 0.0 for label in labels},
                {label: 0.0 for label in labels},
                [],
            )
        ),
    )
    suite.main(["--tier", "cpu", "--pairs", "suite-pythia-b", "--methods", "dual", "--json", str(tmp_path / "r.json")])
    assert measured == ["suite-pythia-b"]
    with pytest.raises(SystemExit) as exit_info:
        suite.main(["--tier", "cpu", "--pairs", "suite-llama-z", "--methods", "dual"])
    assert exit_info.value.code == 2
    assert measured == ["suite-pythia-b"]


def test_a_run_writes_one_standard_record_per_run(monkeypatch, tmp_path):
    """A run of the suite writes its record by default under ``benchmarks/results/`` (here a
    temporary folder): the provenance of ``record.new_record``, the settings spelled out, and per
    pair its family, name, what it varies and, per method, the barrier, the ratio to vanilla and
    the seconds; ``--report`` reads the record back."""
    monkeypatch.setattr(record, "RESULTS", tmp_path)
    barriers = {"vanilla": 2.0, "weight": 0.5, "dual": 0.1}
    monkeypatch.setattr(
        suite,
        "measure_pair",
        lambda pair, labels, **_: suite.PairResult(
            pair.family, pair.entry.name, pair.varies, {k: barriers[k] for k in labels}, dict.fromkeys(labels, 3.0), []
        ),
    )
    suite.main(["--tier", "ci", "--families", "gpt2", "vit", "--methods", "vanilla", "weight", "dual"])
    paths = sorted(tmp_path.glob("suite-*.json"), key=lambda path: path.name.endswith("ci-vit.json"))
    assert len(paths) == 2  # one record per pair, written as each finishes
    saved = [json.loads(path.read_text()) for path in paths]
    for one in saved:
        assert {"benchmark", "date", "commit", "machine", "settings"} <= set(one) and one["benchmark"] == "suite"
        assert one["settings"]["tier"] == "ci" and one["settings"]["learn_changed"] == {}
        assert one["settings"]["fitting"] == {"sequences": suite.FIT_SEQUENCES, "batch_size": 32, "sampled": False}
        assert set(one["digests"]) == {"average", "weight", "dual", "dual-target"}
    assert [(one["pairs"][0]["family"], one["settings"]["pairs"]) for one in saved] == [
        ("gpt2", ["ci-gpt2"]),
        ("vit", ["ci-vit"]),
    ]
    first = saved[0]["pairs"][0]
    assert first["varies"] == "tiny" and first["barriers"] == barriers and first["seconds"]["dual"] == 3.0
    assert first["ratio_to_vanilla"] == {"vanilla": 1.0, "weight": 0.25, "dual": 0.05}
    results = suite.read_results(paths, suite.PairResult)
    assert [r.name for r in results] == ["ci-gpt2", "ci-vit"] and results[1].barriers == barriers


def test_a_resumed_run_measures_only_what_todays_code_has_not(monkeypatch, tmp_path):
    """``--resume`` skips the pairs and methods the records hold at today's code (same settings,
    same kind of machine, today's digests) and measures the rest; with nothing left it measures
    nothing. A figure made by other code is measured again."""
    monkeypatch.setattr(record, "RESULTS", tmp_path)
    measured = []

    def stand_in(pair, labels, **_):
        measured.append((pair.entry.name, list(labels)))
        return suite.PairResult(
            pair.family, pair.entry.name, pair.varies, dict.fromkeys(labels, 0.5), dict.fromkeys(labels, 1.0), []
        )

    monkeypatch.setattr(suite, "measure_pair", stand_in)
    argv = ["--tier", "ci", "--families", "gpt2", "vit", "--methods", "vanilla", "dual", "--resume"]
    suite.main(argv[:-1] + ["--pairs", "ci-gpt2"])
    assert measured == [("ci-gpt2", ["vanilla", "dual"])]
    suite.main(argv)
    assert measured[1:] == [("ci-vit", ["vanilla", "dual"])]
    suite.main(argv)
    assert len(measured) == 2  # everything measured at today's code
    monkeypatch.setattr(
        merge_digests, "digests", lambda scratch, names=None: {name: f"changed {name}" for name in names}
    )
    suite.main(argv)
    assert measured[2:] == [("ci-gpt2", ["vanilla", "dual"]), ("ci-vit", ["vanilla", "dual"])]


def test_recorded_curves_replay_through_the_stopping_rule(tmp_path):
    """``benchmarks.plateau`` stops a recorded curve where the loop's own rule would have."""
    from benchmarks import plateau

    curve = [[0, 0.0, 0.5], [50, 10.0, 0.2], [100, 20.0, 0.199], [150, 30.0, 0.198], [200, 40.0, 0.15]]
    assert plateau.replay(curve, 0.02, None) == (200, 40.0, 0.15)  # no plateau rule: the whole run
    assert plateau.replay(curve, 0.02, 2) == (150, 30.0, 0.198)  # two estimates without a 2 % fall
    assert plateau.replay(curve, 0.25, 2) == (50, 10.0, 0.2)  # the target first
    record = tmp_path / "suite.json"
    record.write_text(
        json.dumps(
            {"settings": {"learn": {"target_barrier": 0.02}}, "pairs": [{"name": "p", "curves": {"dual": curve}}]}
        )
    )
    rows = plateau.measure(plateau.runs_of([record]), [2])
    assert rows[0]["time_ratio"] == 0.75 and abs(rows[0]["estimate_rise"] - 0.048) < 1e-12
