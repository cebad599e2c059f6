"""Levers on what a learned or dual merge costs (issue 77): settings tried against the defaults on
the suite's pairs, side by side, resumably, each run kept as a suite record.

A lever is a set of learned-matching settings other than the defaults (``LearnOptions`` fields,
and the fitting data's ``batch_size`` and ``sequences``; values read as YAML), one per ``--try``. Pair by pair, the defaults and then every lever are
measured in turn on the same machine, so that a machine that slows slows both; each (pair,
method, setting) writes its suite record under ``benchmarks/results/levers/`` as it finishes,
with the digests of the merges behind it (``benchmarks/merge_digests.py``), and one already
recorded at today's code on this kind of machine is not measured again: a run cut off goes on
where it stopped, and a session can add pairs to the last one's. ``--report`` reads every record
there (and the suite's own records of the defaults) and puts each lever beside the defaults on
the pairs both have: the barrier (mean and worst, and its change per pair), the steps and
seconds to the final barrier (medians over the pairs) and the per-pair ratio of those seconds to
the defaults' (comparable only between runs made side by side on a quiet machine). These records are evidence for the
decisions that cite them (docs/decisions.md); the results tables do not show them.

    python -m benchmarks.levers --pairs suite-gpt2-a suite-gpt2-c --methods dual --try steps=250 "steps=250 lr=0.03"
    python -m benchmarks.levers --pairs suite-gpt2-a --again --try target_cache=0   # a speed-only change, side by side
    python -m benchmarks.levers --report
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from hf_lmc.config.options import LearnOptions

from . import merge_digests, suite, tables
from .record import RESULTS, machine, started, write

#: Where the levers' records go (beside, not among, the records the results tables read).
LEVERS = RESULTS / "levers"
#: The trained rows a lever can change.
TRAINED = ("learned (perm. only)", "learned", "dual")


#: Settings of the fitting data a lever can change besides LearnOptions' (``suite.Fitting``):
#: sequences per fitting batch, and fitting sequences in all.
FITTING_KEYS = ("batch_size", "sequences")


def parse(text: str) -> dict:
    """``"steps=250 lr=0.03 batch_size=16"`` as LearnOptions and fitting overrides, checked (a bad
    key or value is an error)."""
    overrides = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in text.split())}
    _split(overrides)
    return overrides


def _split(overrides: dict) -> tuple[LearnOptions, suite.Fitting]:
    """The LearnOptions and fitting data a setting gives."""
    fitting = {key: overrides[key] for key in FITTING_KEYS if key in overrides}
    if any(not isinstance(value, int) or value < 1 for value in fitting.values()):
        raise ValueError(f"fitting settings must be positive integers, got {fitting}")
    learn = LearnOptions(**{k: v for k, v in overrides.items() if k not in FITTING_KEYS})
    return learn, suite.Fitting(**fitting)


def tag(overrides: dict) -> str:
    """A file-name tag for a setting: ``defaults`` or ``steps=250_lr=0.03``."""
    if not overrides:
        return "defaults"
    return re.sub(r"[^A-Za-z0-9=._-]", "-", "_".join(f"{k}={v}" for k, v in sorted(overrides.items())))


def _settings(pair: str, labels: Sequence[str], learn: LearnOptions, fitting: suite.Fitting, tier: str) -> dict:
    return {
        "tier": tier,
        "methods": list(labels),
        "families": list(suite.FAMILIES),
        "pairs": [pair],
        "max_steps": None,
        "vocab_size": None,
        "learn": learn.model_dump(mode="json"),
        "learn_changed": learn.model_dump(mode="json", exclude_defaults=True),
        "fitting": dataclasses.asdict(fitting),
    }


def measure(
    tier: str,
    pairs: Sequence[str],
    labels: Sequence[str],
    levers: Sequence[dict],
    *,
    folder: Path = LEVERS,
    cache: Path | None = None,
    again: bool = False,
) -> list[Path]:
    """Measure the defaults and every lever of ``levers`` on each pair in turn, writing one record
    per (pair, setting) under ``folder``; what ``folder`` and the suite's own records (``RESULTS``:
    a tier's run measures the defaults) hold at today's code on this kind of machine is skipped,
    except, with ``again``, the defaults: a change that leaves the merges alone (their digests)
    and not their time is measured beside the settings it is compared with (the newest record
    of a setting is the one reported)."""
    suite_records = tables.load(RESULTS)  # read once: a lever run writes only under folder
    digests = merge_digests.for_labels(labels)
    here = machine()
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for pair in suite.tier_pairs(tier, suite.FAMILIES, pairs):
        for overrides in [{}, *levers]:
            learn, fitting = _split(overrides)
            settings = _settings(pair.entry.name, labels, learn, fitting, tier)
            done = tables.measured_today([*suite_records, *tables.load(folder)], settings, digests, here)
            todo = [label for label in labels if (pair.entry.name, label) not in done or (again and not overrides)]
            if not todo:
                print(f"{pair.entry.name} {tag(overrides)}: recorded at today's code", file=sys.stderr)
                continue
            date = started()
            result = suite.measure_pair(pair, todo, cache=cache, progress=False, learn=learn, fitting=fitting)
            print(
                f"{pair.entry.name} {tag(overrides)}: "
                + ", ".join(f"{label} {result.barriers[label]:.4f} ({result.seconds[label]:.0f} s)" for label in todo),
                file=sys.stderr,
            )
            record = suite.pairs_record([result], {**settings, "methods": todo}, date=date)
            path = folder / f"suite-{date:%Y%m%d-%H%M%S}-{pair.entry.name}-{tag(overrides)}.json"
            written.append(write({**record, "digests": digests}, path))
    return written


def report(folder: Path = LEVERS, results: Path = RESULTS) -> list[str]:
    """Every lever recorded under ``folder`` beside the defaults on the pairs both have, per method,
    from the figures of today's code (newest per pair, method and setting), one table per kind of
    machine: a lever is compared only with the defaults measured on the same kind (its arithmetic
    and its seconds), newest kind first."""
    records = sorted(
        [*tables.load(results), *tables.load(folder)], key=lambda item: (item[1]["date"], item[0].name)
    )  # the defaults the suite itself measured count too
    out: list[str] = []
    kinds = list(dict.fromkeys(tables._machine_kind(record) for _, record in reversed(records)))
    for kind in kinds:
        same = [(path, record) for path, record in records if tables._machine_kind(record) == kind]
        rows = _table(tables.merged(same)[tables.CURRENT])
        if len(rows) > 2:
            newest = same[-1][1]
            out += [*([""] if out else []), f"On {tables._machine_text(newest)}:", "", *rows]
    return out


def _table(by_setting: dict) -> list[str]:
    """The rows of one kind of machine's levers (``tables.merged``'s current figures)."""
    rows = [
        (
            "| method | setting | pairs | barrier, mean (worst) | change per pair, mean (worst) | steps to the final "
            "barrier, median | seconds to it, median | ÷ the defaults', median (worst) |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, entry in sorted(by_setting.items(), key=lambda item: (not tables.is_plain(item[0]), item[0][4])):
        plain = tables.is_plain(key)
        base = (
            None if plain else next((d for k, d in by_setting.items() if tables.is_plain(k) and k[:3] == key[:3]), None)
        )
        fitting = json.loads(key[3])
        changed = {
            **json.loads(key[4]),
            **{k: v for k, v in fitting.items() if v != tables.DEFAULT_FITTING.get(k)},
        }
        setting = "the defaults" if plain else ", ".join(f"{k}={v}" for k, v in sorted(changed.items()))
        for label in TRAINED:
            items = [item for item in entry["items"].values() if label in item["barriers"]]
            if base is not None:
                items = [item for item in items if label in base["items"].get(item["name"], {}).get("barriers", {})]
            if items:
                rows.append(_row(label, setting, items, base))
    return rows


def _row(label: str, setting: str, items: list[dict], base: dict | None) -> str:
    """One lever's row: its barrier and time to the final barrier, and both against ``base`` (the
    defaults' figures of the same pairs) when given."""

    def to_final(item: dict) -> float | None:
        return item.get("runs", {}).get(label, {}).get("seconds_to_final")

    values = [item["barriers"][label] for item in items]
    times = [t for t in map(to_final, items) if t is not None]
    steps = [s for s in (item.get("runs", {}).get(label, {}).get("steps_to_final") for item in items) if s is not None]
    cells = [f"{statistics.mean(values):.4f} ({max(values):.4f})", "—", "—", "—", "—"]
    if steps:
        cells[2] = f"{statistics.median(steps):.0f}"
    if times:
        cells[3] = f"{statistics.median(times):.0f}"
    if base is not None:
        theirs = [base["items"][item["name"]] for item in items]
        changes = [
            item["barriers"][label] - other["barriers"][label] for item, other in zip(items, theirs, strict=True)
        ]
        cells[1] = f"{statistics.mean(changes):+.4f} ({max(changes):+.4f})"
        ratios = [
            to_final(item) / to_final(other)
            for item, other in zip(items, theirs, strict=True)
            if to_final(item) is not None and to_final(other)
        ]
        if ratios:
            cells[4] = f"{statistics.median(ratios):.2f} ({max(ratios):.2f})"
    return f"| {label} | {setting} | {len(items)} | " + " | ".join(cells) + " |"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tier", choices=list(suite.TIERS), default="cpu", help="whose pairs (default: cpu)")
    parser.add_argument("--pairs", nargs="+", default=None, metavar="NAME", help="pairs of the tier (default: all)")
    parser.add_argument("--methods", nargs="+", choices=TRAINED, default=["dual"], help="trained rows (default: dual)")
    parser.add_argument(
        "--try",
        dest="levers",
        nargs="+",
        default=[],
        metavar="SETTINGS",
        help='one lever per value: learned-matching settings, space-separated KEY=VALUE (e.g. "steps=250 lr=0.03")',
    )
    parser.add_argument("--cache", type=Path, default=None, help="zoo cache folder")
    parser.add_argument("--folder", type=Path, default=LEVERS, help=f"the records' folder (default: {LEVERS})")
    parser.add_argument(
        "--again",
        action="store_true",
        help="measure the defaults even where recorded at today's code (a change of speed that leaves the merges alone)",
    )
    parser.add_argument("--report", action="store_true", help="print the table of the recorded levers and stop")
    args = parser.parse_args(argv)
    if not args.report:
        try:
            levers = [parse(text) for text in args.levers]
            suite.tier_pairs(args.tier, suite.FAMILIES, args.pairs)
        except ValueError as err:
            parser.error(str(err))
        measure(args.tier, args.pairs, args.methods, levers, folder=args.folder, cache=args.cache, again=args.again)
    print("\n".join(report(args.folder, RESULTS)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
