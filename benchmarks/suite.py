"""The benchmark suite: many independently trained pairs per family, every method at its defaults.

A barrier measured on one pair, with settings tuned on that pair, says little about the next
pair a user brings. The suite trains several pairs per family that differ in what users' models
differ in (depth, width, number of heads, GQA ratio, rotary fraction, residual layout, tied or
untied embeddings, training length), each member until its validation loss stops improving
(``zoo.ZooEntry.patience``), and measures every method with the settings a user gets when
passing no flag. It reports mean ± std and the worst pair, per family and over the suite, in
the layout of Theus et al.'s Table 1.

Three tiers, one command:

* ``ci``: one tiny pair per family, seconds; ``tests/test_suite.py`` runs it so that the suite
  cannot silently regress;
* ``cpu``: three pairs per family on 2 cores (training about an hour the first time, then cached);
  the results are in docs/results.md;
* ``paper``: the configurations of Theus et al.'s Table 2 (GPT-2: 6 layers, 4 heads, width 256,
  MLP 1024 on Shakespeare; ViT: 6 layers, 8 heads, width 256, MLP 512), three pairs each from
  seeds no default was tuned on, meant for a GPU; on a CPU, ``--max-steps`` caps the training
  and every table states the cap.

    python -m benchmarks.suite --tier cpu                       # train (or load) and measure
    python -m benchmarks.suite --tier cpu --methods vanilla weight --families llama
    python -m benchmarks.suite --tier cpu --pairs suite-llama-b --methods dual --learn steps=4000
    python -m benchmarks.suite --tier paper --max-steps 3000 --pairs paper-gpt2-a --resume  # a CPU's cap

Pairs are trained from their seeds (init and data order: 0 and 1; the paper tier's 10 to 15) and
cached in the zoo cache. Each
pair writes its record as it finishes (``benchmarks/record.py``: date, commit, machine,
settings, the pair's barrier, ratio to vanilla and seconds per method, and the digests of the
merges behind its methods on the shipped pair, ``benchmarks/merge_digests.py``) under
``benchmarks/results/``, and the run then rebuilds the README's table and docs/results.md
(``benchmarks/tables.py``), which combine the records pair by pair while their digests are
today's; ``--json FILE`` writes one record of every pair to FILE instead and rebuilds nothing.
``--resume`` measures only what the records lack at today's code, so a run cut off (or a tier
measured over several sessions) goes on where it stopped:

    python -m benchmarks.suite --tier paper --resume            # the paper tier, whatever is missing
    python -m benchmarks.suite --tier cpu --families vit --resume

``--sampled`` fits the data methods on text sampled from each pair's own members (``--data
sampled``) rather than the training plays. The language pairs read characters, whose 65–82
tokens span a fraction of a 128-wide stream; ``--vocab-size N`` trains and measures them on a
byte-level BPE of N tokens instead (:func:`with_vocabulary`), which fills the stream as real
vocabularies do.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from hf_lmc.config.options import FIT_OPTIONS, EvalOptions, LearnOptions, check_device
from hf_lmc.evaluation.barriers import barrier, excess_over_vertices, simplex_barrier_of_loaded
from hf_lmc.evaluation.batches import SAMPLED, fitting_batches, load_batches
from hf_lmc.io import zoo
from hf_lmc.io.loading import load_model

from . import merge_digests, record, tables
from .record import new_record, started, write
from .tiers import FAMILIES, TIERS, TRIPLES, SuitePair

#: Rows of the table: (label, method, symmetries, learn overrides), as Theus et al.'s Table 1
#: orders them. "learned (perm. only)" trains the permutations alone (their "learned matching
#: (permutation only)"); records made before it existed have "learned (perm.)" instead: the
#: permutation-only start with every group trained, which is not that row.
METHODS = (
    ("vanilla", "average", "full", {}),
    ("activation", "activation", "full", {}),
    ("weight", "weight", "full", {}),
    ("learned (perm. only)", "learned", "permutation", {"trained": "permutations", "permutations": "ste"}),
    ("learned", "learned", "full", {}),
    ("dual", "dual", "full", {}),
)
LABELS = tuple(label for label, *_ in METHODS)


#: Rows of the simplex table: (label, method). Learned keeps the first model's universe-matching
#: transform and trains the others'; dual trains all three.
SIMPLEX_METHODS = (("vanilla", "average"), ("weight", "weight"), ("learned", "learned"), ("dual", "dual"))
SIMPLEX_LABELS = tuple(label for label, _ in SIMPLEX_METHODS)
SIMPLEX_POINTS = 5  # grid points per edge: weights in steps of 1/4, and the centre
#: Fitting data of activation, learned and dual matching, in sequences (images): fixed, as a
#: user's ``--data`` file is, so that a batch size changes how the data is cut, not how much there is.
FIT_SEQUENCES = 8192


@dataclass(frozen=True)
class Fitting:
    """The fitting data the suite gives activation, learned and dual matching: how many sequences
    (images), in batches of what size (by default what ``--data D`` gives)."""

    sequences: int = FIT_SEQUENCES
    batch_size: int = FIT_OPTIONS.batch_size
    sampled: bool = False  # sequences sampled from the members (``--data sampled``) instead of the training plays

    def describe(self) -> str:
        """What differs from the defaults, for a table's heading ("" when nothing does)."""
        changed = [f"{self.sequences} fitting sequences"] if self.sequences != FIT_SEQUENCES else []
        changed += [f"fitting batches of {self.batch_size}"] if self.batch_size != FIT_OPTIONS.batch_size else []
        changed += ["fitting data sampled from the members"] if self.sampled else []
        return "".join(f", {text}" for text in changed)


@dataclass
class PairResult:
    """Barriers (and the time each method took) of one pair."""

    family: str
    name: str
    varies: str
    barriers: dict[str, float]
    seconds: dict[str, float]
    members: list[dict]
    #: Per trained method: the held-out barrier estimate along its run, ``[steps, seconds,
    #: estimate]`` every 50 steps, seconds counted from the method's start (its weight-matching
    #: start included).
    curves: dict[str, list] = dataclasses.field(default_factory=dict)
    #: Per trained method: why its run stopped, its steps, and ``steps`` and ``seconds`` to its
    #: final barrier (the first estimate within 10 % of the final one, or of the target when it
    #: was reached: :meth:`hf_lmc.learned.training.Stopping.time_to_final`).
    runs: dict[str, dict] = dataclasses.field(default_factory=dict)
    #: What the members were trained on (``zoo.data_text``), as the tables name it.
    data: str = ""


def evaluation_batches(entry: zoo.ZooEntry, folder: Path):
    """The held-out data of ``entry`` as batches (LMs: the held-out plays, tokenised by the model's tokenizer)."""
    data = zoo.held_out(entry)
    if entry.model_type == "vit":
        return data
    config = zoo.build_config(entry)
    return load_batches(data, config, folder, EvalOptions(batch_size=16, seq_len=entry.seq_len))


def pair_data(
    pair: SuitePair,
    *,
    seeds: Sequence[int] | None = None,
    cache: Path | None = None,
    progress: bool = False,
    fitting: Fitting = Fitting(),
    device: str | None = None,
) -> tuple[list[Path], object, list[dict]]:
    """Train (or load) the members of ``pair`` (``seeds``, by default the pair's; on ``device``,
    by default the CPU) and return their folders, the held-out batches and the fitting batches
    ``fitting`` describes."""
    folders = [
        zoo.train(pair.entry, seed, cache=cache, progress=progress, device=device) for seed in (seeds or pair.seeds)
    ]
    count = fitting.sequences // fitting.batch_size
    if fitting.sampled:
        start = time.perf_counter()
        options = EvalOptions(batch_size=fitting.batch_size, max_batches=count, seq_len=pair.entry.seq_len)
        models = [lambda folder=folder: load_model(folder).model for folder in folders]
        batches = fitting_batches(
            SAMPLED, zoo.build_config(pair.entry), None, options, models=models, progress=progress
        )
        print(
            f"{pair.entry.name}: {fitting.sequences} fitting sequences sampled ({time.perf_counter() - start:.0f} s)",
            file=sys.stderr,
        )
    else:
        batches = zoo.fit_batches(pair.entry, count, batch_size=fitting.batch_size)
    return folders, evaluation_batches(pair.entry, folders[0]), batches


def measure_pair(
    pair: SuitePair,
    labels: Sequence[str],
    *,
    cache: Path | None,
    progress: bool,
    learn: LearnOptions,
    fitting: Fitting = Fitting(),
    device: str | None = None,
) -> PairResult:
    """Train (or load) ``pair`` (members on ``device``) and measure the barrier of every method in
    ``labels`` at its defaults (fitting data: :func:`pair_data`'s)."""
    folders, evaluation, fitting = pair_data(pair, cache=cache, progress=progress, fitting=fitting, device=device)
    members = [json.loads((f / "zoo.json").read_text()) for f in folders]
    barriers, seconds, curves, runs = {}, {}, {}, {}
    for label, method, symmetries, overrides in METHODS:
        if label not in labels:
            continue
        start = time.perf_counter()
        torch.manual_seed(0)
        result = barrier(
            *folders,
            evaluation,
            methods=(method,),
            symmetries=symmetries,
            fit_data=fitting,
            learn=LearnOptions(**{**learn.model_dump(), **overrides}) if overrides else learn,
            eval_options=EvalOptions(batch_size=16),
            progress=False,
        )
        barriers[label], seconds[label] = result.barriers[method], time.perf_counter() - start
        stopping = result.stopping.get(method)
        if stopping is not None and stopping.curve:
            curves[label], runs[label] = run_of(stopping, stopping.started - start)
        print(f"{pair.entry.name} {label}: barrier {barriers[label]:.4f} ({seconds[label]:.0f} s)", file=sys.stderr)
    return PairResult(
        pair.family,
        pair.entry.name,
        pair.varies,
        barriers,
        seconds,
        [_member_summary(m) for m in members],
        curves,
        runs,
        zoo.data_text(pair.entry),
    )


def run_of(stopping, offset: float) -> tuple[list, dict]:
    """A trained method's curve and run summary for the record, seconds shifted by ``offset``
    (the seconds from the method's start to its training's)."""
    curve = [[step, round(offset + seconds, 2), estimate] for step, seconds, estimate in stopping.curve]
    reached = stopping.time_to_final()
    run = {"stopped": stopping.reason, "steps": stopping.steps, "budget": stopping.budget}
    if reached is not None:
        run |= {"steps_to_final": reached[0], "seconds_to_final": round(offset + reached[1], 2)}
    return curve, run


@dataclass
class TripleResult:
    """Excess losses over the simplex of one triple: its worst grid point (the barrier) and the
    mean over the grid, per method."""

    family: str
    name: str
    varies: str
    barriers: dict[str, float]
    mean_excess: dict[str, float]
    seconds: dict[str, float]


def measure_triple(
    pair: SuitePair,
    labels: Sequence[str],
    *,
    cache: Path | None,
    progress: bool,
    learn: LearnOptions,
    fitting: Fitting = Fitting(),
) -> TripleResult:
    """Train (or load) seeds 0, 1 and 2 of ``pair`` and measure every method of ``labels`` over
    their simplex at its defaults (the grid of :data:`SIMPLEX_POINTS` per edge, and the centre)."""
    folders, evaluation, fitting = pair_data(
        pair, seeds=(*pair.seeds, 2), cache=cache, progress=progress, fitting=fitting
    )
    loaded = [load_model(f) for f in folders]
    barriers, means, seconds = {}, {}, {}
    for label, method in SIMPLEX_METHODS:
        if label not in labels:
            continue
        start = time.perf_counter()
        torch.manual_seed(0)
        result = simplex_barrier_of_loaded(
            loaded,
            evaluation,
            methods=(method,),
            points=SIMPLEX_POINTS,
            symmetries="full",
            eval_options=EvalOptions(batch_size=16),
            progress=False,
            fit_batches=fitting,
            learn=learn,
        )
        excess = excess_over_vertices(result.points, result.losses[method])
        barriers[label], means[label] = max(excess), statistics.mean(excess)
        seconds[label] = time.perf_counter() - start
        print(
            f"{pair.entry.name} triple {label}: worst point {barriers[label]:.4f}, mean {means[label]:.4f} ({seconds[label]:.0f} s)",
            file=sys.stderr,
        )
    return TripleResult(pair.family, pair.entry.name, pair.varies, barriers, means, seconds)


def triple_rows(results: Sequence[TripleResult], labels: Sequence[str]) -> list[str]:
    """One row per method: the excess at the worst grid point and its mean over the grid, each as
    mean ± std over triples and the worst triple, and the ratio to weight (universe) matching."""
    rows = [
        "| method | triples | worst point: mean ± std | worst triple | mean over the grid: mean ± std | worst triple | worst point / weight (mean, worst) |",
        "|---|---|---|---|---|---|---|",
    ]
    for label in labels:
        members = [r for r in results if label in r.barriers]
        if not members:
            continue
        worst, mean = [r.barriers[label] for r in members], [r.mean_excess[label] for r in members]
        ratios = [r.barriers[label] / r.barriers["weight"] for r in members if r.barriers.get("weight", 0) > 0]
        ratio = f"{statistics.mean(ratios):.2f}, {max(ratios):.2f}" if ratios else "—"
        rows.append(
            f"| {label} | {len(members)} | {_spread(worst)} | {max(worst):.3f} | {_spread(mean)} | {max(mean):.3f} | {ratio} |"
        )
    rows += [
        "",
        "| triple | " + " | ".join(f"{label}: worst / mean" for label in labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for r in results:
        cells = " | ".join(
            f"{r.barriers[label]:.3f} / {r.mean_excess[label]:.3f}" if label in r.barriers else "—" for label in labels
        )
        rows.append(f"| {r.name} | {cells} |")
    return rows


def _spread(values: Sequence[float]) -> str:
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.3f}"


def _member_summary(record: dict) -> dict:
    keys = ("seed", "train_loss", "steps", "best_step", "validation_loss", "stopped", "device", "seconds")
    return {k: record[k] for k in keys if k in record}


def summary_rows(results: Sequence[PairResult], labels: Sequence[str]) -> list[str]:
    """Table 1 layout: one row per method, mean ± std over pairs, the worst pair, and the ratio
    to vanilla (mean of the per-pair ratios), for each family and over all pairs."""
    groups = [(family, [r for r in results if r.family == family]) for family in FAMILIES] + [("all", list(results))]
    rows = [
        "| family | method | pairs | barrier mean ± std | worst | ratio to vanilla (mean, worst) |",
        "|---|---|---|---|---|---|",
    ]
    for family, members in groups:
        if not members:
            continue
        for label in labels:
            values = [r.barriers[label] for r in members if label in r.barriers]
            if not values:
                continue
            ratios = [
                r.barriers[label] / r.barriers["vanilla"]
                for r in members
                if label in r.barriers and r.barriers.get("vanilla", 0) > 0
            ]
            ratio = f"{statistics.mean(ratios):.2f}, {max(ratios):.2f}" if ratios else "—"
            rows.append(f"| {family} | {label} | {len(values)} | {_spread(values)} | {max(values):.3f} | {ratio} |")
    return rows


def pair_rows(results: Sequence[PairResult], labels: Sequence[str]) -> list[str]:
    """One row per pair: what it varies, how its members trained, and every method's barrier."""
    rows = [
        "| pair | varies | members: steps (stop), validation loss | " + " | ".join(labels) + " |",
        "|---|---|---|" + "---|" * len(labels),
    ]
    for r in results:
        members = "; ".join(
            f"{m.get('steps', '?')} ({m.get('stopped', 'fixed')}), {m['validation_loss']:.3f}"
            if "validation_loss" in m
            else f"fixed, train {m['train_loss']:.3f}"
            for m in r.members
        )
        cells = " | ".join(f"{r.barriers[label]:.3f}" if label in r.barriers else "—" for label in labels)
        rows.append(f"| {r.name} | {r.varies} | {members} | {cells} |")
    return rows


def time_rows(results: Sequence[PairResult], labels: Sequence[str]) -> list[str]:
    """Seconds each method took per pair (merge-time alignment and the barrier's evaluation), mean
    and max; for the trained methods also the seconds to their final barrier (median and worst)
    and how their runs stopped."""
    rows = [
        "| method | seconds per pair, mean | max | to the final barrier, median | worst | stopped by |",
        "|---|---|---|---|---|---|",
    ]
    for label in labels:
        values = [r.seconds[label] for r in results if label in r.seconds]
        if not values:
            continue
        runs = [r.runs[label] for r in results if label in r.runs and "seconds_to_final" in r.runs[label]]
        to_final = [run["seconds_to_final"] for run in runs]
        reasons = collections.Counter(run["stopped"] for run in runs)
        shown = (
            f"{statistics.median(to_final):.0f} | {max(to_final):.0f} | "
            + ", ".join(f"{reason} {count}" for reason, count in sorted(reasons.items()))
            if to_final
            else "— | — | —"
        )
        rows.append(f"| {label} | {statistics.mean(values):.0f} | {max(values):.0f} | {shown} |")
    return rows


def settings_of(args: argparse.Namespace, learn: LearnOptions, fitting: Fitting) -> dict:
    """What a run measured with, as its record's settings: the tier, the rows, the pairs asked
    for, and every learned-matching and fitting-data setting (the defaults spelled out)."""
    return {
        "tier": args.tier,
        "methods": list(args.methods) if args.methods else None,
        "families": list(args.families),
        "pairs": list(args.pairs) if args.pairs else None,
        "max_steps": args.max_steps,
        "vocab_size": args.vocab_size,
        "learn": learn.model_dump(mode="json"),
        "learn_changed": learn.model_dump(mode="json", exclude_defaults=True),
        "fitting": dataclasses.asdict(fitting),
    }


def ratios_to_vanilla(barriers: dict[str, float]) -> dict[str, float]:
    """Each method's barrier over vanilla averaging's on the same pair (none without a vanilla row)."""
    vanilla = barriers.get("vanilla", 0)
    return {label: value / vanilla for label, value in barriers.items()} if vanilla > 0 else {}


def pairs_record(results: Sequence[PairResult], settings: dict, date=None) -> dict:
    """The run's record: per pair its family, name, what it varies, its members' training and,
    per method, the barrier, the ratio to vanilla and the seconds."""
    record = new_record("suite", settings, date=date)
    record["pairs"] = [{**r.__dict__, "ratio_to_vanilla": ratios_to_vanilla(r.barriers)} for r in results]
    return record


def triples_record(results: Sequence[TripleResult], settings: dict, date=None) -> dict:
    """The ``--triples`` run's record: per triple, per method, the excess at the worst grid point
    and its mean over the grid, and the seconds."""
    record = new_record("suite_triples", settings, date=date)
    record["triples"] = [dict(r.__dict__) for r in results]
    return record


def read_results(paths: Sequence[Path], kind: type) -> list:
    """The pair (``PairResult``) or triple (``TripleResult``) results of saved runs: records, or
    the bare lists that ``--json`` wrote before records."""
    results = []
    for path in paths:
        saved = json.loads(path.read_text())
        items = saved if isinstance(saved, list) else saved["pairs" if kind is PairResult else "triples"]
        fields = {field.name for field in dataclasses.fields(kind)}
        results += [kind(**{k: v for k, v in item.items() if k in fields}) for item in items]
    return results


def tier_pairs(tier: str, families: Sequence[str] = FAMILIES, names: Sequence[str] | None = None) -> list[SuitePair]:
    """The pairs of ``tier`` in ``families``, and only those called ``names`` when given (a name
    the tier does not have is an error)."""
    known = [pair.entry.name for pair in TIERS[tier]]
    unknown = [name for name in names or () if name not in known]
    if unknown:
        raise ValueError(f"the {tier} tier has no pair {', '.join(unknown)}; it has {', '.join(known)}")
    return [pair for pair in TIERS[tier] if pair.family in families and (names is None or pair.entry.name in names)]


def run(
    tier: str,
    *,
    labels: Sequence[str] = LABELS,
    families: Sequence[str] = FAMILIES,
    names: Sequence[str] | None = None,
    cache: Path | None = None,
    progress: bool = False,
    max_steps: int | None = None,
    learn: LearnOptions = LearnOptions(),
    fitting: Fitting = Fitting(),
    vocab_size: int | None = None,
) -> list[PairResult]:
    """Measure every pair of ``tier`` (of ``families``; of ``names`` when given); ``max_steps`` caps
    each member's training, ``vocab_size`` gives the language pairs a BPE of that many tokens
    (:func:`with_vocabulary`)."""
    pairs = [with_vocabulary(_capped(pair, max_steps), vocab_size) for pair in tier_pairs(tier, families, names)]
    return [measure_pair(pair, labels, cache=cache, progress=progress, learn=learn, fitting=fitting) for pair in pairs]


def _capped(pair: SuitePair, max_steps: int | None) -> SuitePair:
    """``pair`` with its members' training capped at ``max_steps`` (the paper tier on a CPU)."""
    if max_steps is None or pair.entry.steps <= max_steps:
        return pair
    # dataclasses.replace: the pair keeps its seeds (the paper tier's are never the tuning seeds 0 and 1)
    return dataclasses.replace(
        pair, entry=pair.entry.scaled(steps=max_steps, warmup=min(pair.entry.warmup, max(1, max_steps // 10)))
    )


def pair_named(name: str) -> SuitePair:
    """The pair of any tier whose zoo entry is called ``name`` (e.g. ``suite-llama-a``)."""
    for pairs in TIERS.values():
        for pair in pairs:
            if pair.entry.name == name:
                return pair
    raise ValueError(f"unknown pair {name!r}: one of {sorted(p.entry.name for pairs in TIERS.values() for p in pairs)}")


def with_vocabulary(pair: SuitePair, vocab_size: int | None) -> SuitePair:
    """``pair`` with its members reading the plays through a byte-level BPE of ``vocab_size``
    tokens (``zoo.bpe_tokenizer``) in place of characters: a vocabulary larger than the width, so
    that the embedding spans the stream, as real vocabularies do. ViT pairs are returned as they are."""
    if vocab_size is None or pair.family == "vit":
        return pair
    entry = dataclasses.replace(pair.entry, name=f"{pair.entry.name}-bpe{vocab_size}", vocab_size=vocab_size)
    return SuitePair(pair.family, entry, f"{pair.varies}; BPE of {vocab_size} tokens", pair.seeds)


def _triples_of(
    tier: str, families: Sequence[str], max_steps: int | None = None, vocab_size: int | None = None
) -> list[SuitePair]:
    return [
        with_vocabulary(_capped(pair, max_steps), vocab_size)
        for pair in TIERS[tier]
        if pair.entry.name in TRIPLES[tier] and pair.family in families
    ]


def run_triples_of(
    tier: str,
    *,
    labels: Sequence[str] = SIMPLEX_LABELS,
    families: Sequence[str] = FAMILIES,
    cache: Path | None = None,
    progress: bool = False,
    max_steps: int | None = None,
    learn: LearnOptions | None = None,
    fitting: Fitting = Fitting(),
    vocab_size: int | None = None,
) -> list[TripleResult]:
    """Measure every triple of ``tier`` (of ``families``) over its simplex (``learn``: default
    ``LearnOptions()``); ``max_steps`` caps each member's training; ``vocab_size`` as for
    :func:`run_tier`."""
    learn = learn or LearnOptions()
    return [
        measure_triple(pair, labels, cache=cache, progress=progress, learn=learn, fitting=fitting)
        for pair in _triples_of(tier, families, max_steps, vocab_size)
    ]


def fitting_of(args: argparse.Namespace) -> Fitting:
    """The fitting data the flags ask for."""
    return Fitting(args.fit_sequences, args.fit_batch_size, args.sampled)


def run_triples(args: argparse.Namespace, learn: LearnOptions) -> None:
    """``--triples``: the simplex table of the tier's triples, and its record."""
    labels = [label for label in SIMPLEX_LABELS if args.methods is None or label in args.methods]
    if args.report:
        results = read_results(args.report, TripleResult)
        print("\n".join(triple_rows(results, [label for label in labels if any(label in r.barriers for r in results)])))
        return
    if args.train_only:
        for pair in _triples_of(args.tier, args.families, args.max_steps, args.vocab_size):
            zoo.train(pair.entry, 2, cache=args.cache, progress=args.progress)
        return
    date, start, fitting = started(), time.perf_counter(), fitting_of(args)
    results = run_triples_of(
        args.tier,
        labels=labels,
        families=args.families,
        cache=args.cache,
        progress=args.progress,
        max_steps=args.max_steps,
        learn=learn,
        fitting=fitting,
        vocab_size=args.vocab_size,
    )
    changed = learn.model_dump(exclude_defaults=True)
    print(
        f"## Suite `{args.tier}`, triples: {len(results)}, {time.perf_counter() - start:.0f} s"
        + (f", learn {changed}" if changed else "")
        + fitting.describe()
        + "\n"
    )
    print("\n".join(triple_rows(results, labels)))
    path = write(triples_record(results, settings_of(args, learn, fitting), date=date), args.json)
    print(f"\nwritten to {path}", file=sys.stderr)


def _device(text: str) -> str:
    try:
        return check_device(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tier", choices=list(TIERS), default="cpu", help="which pairs (default: cpu)")
    parser.add_argument("--methods", nargs="+", choices=LABELS, default=None, help="rows to measure (default: all)")
    parser.add_argument(
        "--families", nargs="+", choices=FAMILIES, default=list(FAMILIES), help="families to measure (default: all)"
    )
    parser.add_argument(
        "--pairs",
        nargs="+",
        default=None,
        metavar="NAME",
        help="only these pairs of the tier (e.g. suite-llama-b; default: every pair of --families)",
    )
    parser.add_argument(
        "--max-steps", type=int, default=None, help="cap each member's training steps (the paper tier on a CPU)"
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="zoo cache folder (default: $HF_LMC_CACHE/zoo or ~/.cache/hf_lmc/zoo)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the run's record to FILE (default: benchmarks/results/suite-<date>.json)",
    )
    parser.add_argument("--train-only", action="store_true", help="train (or load) the members and measure nothing")
    parser.add_argument(
        "--device",
        type=_device,
        default=None,
        metavar="DEVICE",
        help="train the members on DEVICE (cpu, cuda, cuda:N; default cpu); learned and dual matching run where "
        "accelerate puts them (a GPU when there is one)",
    )
    parser.add_argument(
        "--report",
        nargs="+",
        type=Path,
        default=None,
        metavar="JSON",
        help="print the tables of saved records (several runs together)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="measure only the pairs and methods that have no figure at today's code among the records "
        "(same settings, same kind of machine, the digests of today's merges): a run cut off goes on where it stopped",
    )
    parser.add_argument("--progress", action="store_true", help="progress bars while training")
    parser.add_argument(
        "--triples",
        action="store_true",
        help=f"measure the tier's triples over their simplex instead of its pairs (rows {', '.join(SIMPLEX_LABELS)}; --methods picks among them)",
    )
    parser.add_argument(
        "--learn",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="learned and dual matching settings other than the defaults (LearnOptions fields, values read as YAML), e.g. steps=1000 lr=1e-2",
    )
    parser.add_argument(
        "--fit-batch-size",
        type=int,
        default=FIT_OPTIONS.batch_size,
        metavar="N",
        help=f"sequences per fitting batch of activation, learned and dual matching (default {FIT_OPTIONS.batch_size}, what --data gives)",
    )
    parser.add_argument(
        "--fit-sequences",
        type=int,
        default=FIT_SEQUENCES,
        metavar="N",
        help=f"fitting sequences (images) in all, cut into batches of --fit-batch-size (default {FIT_SEQUENCES})",
    )
    parser.add_argument(
        "--sampled",
        action="store_true",
        help="fit activation, learned and dual matching on sequences sampled from each pair's members (--data sampled) instead of "
        "the training plays (language pairs)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="N",
        help="language pairs read the plays through a byte-level BPE of N tokens instead of characters (members trained and cached apart)",
    )
    args = parser.parse_args(argv)
    if args.pairs is not None:
        if args.triples:
            parser.error("--pairs picks pairs; --triples measures the tier's triples")
        try:
            tier_pairs(args.tier, args.families, args.pairs)
        except ValueError as err:
            parser.error(str(err))
    learn = LearnOptions(**{k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.learn)})
    if args.triples:
        run_triples(args, learn)
        return
    args.methods = args.methods or list(LABELS)
    if args.report:
        results = read_results(args.report, PairResult)
        labels = [label for label in LABELS if any(label in r.barriers for r in results)]
        print("\n\n".join("\n".join(rows(results, labels)) for rows in (summary_rows, pair_rows, time_rows)))
        return
    if args.train_only:
        for pair in tier_pairs(args.tier, args.families, args.pairs):
            pair = with_vocabulary(_capped(pair, args.max_steps), args.vocab_size)  # the members a run measures
            for seed in pair.seeds:
                folder = zoo.train(pair.entry, seed, cache=args.cache, progress=args.progress, device=args.device)
                print(
                    f"{pair.entry.name} seed {seed}: {json.dumps(_member_summary(json.loads((folder / 'zoo.json').read_text())))}",
                    file=sys.stderr,
                )
        return
    date, start, fitting = started(), time.perf_counter(), fitting_of(args)
    settings = settings_of(args, learn, fitting)
    digests = merge_digests.for_labels(args.methods)  # the code these figures come from (tables.py)
    todo = {pair.entry.name: list(args.methods) for pair in tier_pairs(args.tier, args.families, args.pairs)}
    if args.resume:
        done = tables.measured_today(tables.load(record.RESULTS), settings, digests, record.machine())
        todo = {name: [label for label in labels if (name, label) not in done] for name, labels in todo.items()}
        for name, labels in todo.items():
            if len(labels) < len(args.methods):
                kept = [label for label in args.methods if label not in labels]
                print(f"{name}: {', '.join(kept)} already measured at today's code", file=sys.stderr)
    results, written = [], []
    for name, labels in todo.items():
        if not labels:
            continue
        (pair,) = [
            with_vocabulary(_capped(pair, args.max_steps), args.vocab_size)
            for pair in tier_pairs(args.tier, args.families, [name])
        ]
        pair_date = started()
        result = measure_pair(
            pair, labels, cache=args.cache, progress=args.progress, learn=learn, fitting=fitting, device=args.device
        )
        results.append(result)
        if args.json is None:  # one record per pair as it finishes: a run cut off keeps what it measured
            saved = pairs_record([result], {**settings, "pairs": [name], "methods": labels}, date=pair_date)
            path = record.RESULTS / f"suite-{pair_date:%Y%m%d-%H%M%S}-{name}.json"
            written.append(write({**saved, "digests": digests}, path))
    if not results:
        print("every pair asked for is measured at today's code; nothing to do", file=sys.stderr)
        return
    changed = learn.model_dump(exclude_defaults=True)
    print(
        f"## Suite `{args.tier}`: {len(results)} pairs, {time.perf_counter() - start:.0f} s"
        + (f", learn {changed}" if changed else "")
        + fitting.describe()
        + "\n"
    )
    print("\n".join(summary_rows(results, args.methods)) + "\n")
    print("\n".join(pair_rows(results, args.methods)) + "\n")
    print("\n".join(time_rows(results, args.methods)))
    if args.json is not None:
        written.append(write({**pairs_record(results, settings, date=date), "digests": digests}, args.json))
    print(f"\nwritten to {', '.join(str(path) for path in written)}", file=sys.stderr)
    if args.json is None and record.RESULTS == tables.RESULTS:
        tables.main([])  # the README's table and docs/results.md, with this run's figures


if __name__ == "__main__":
    main()
