"""What a plateau rule would have saved: the suite's recorded runs replayed through the stopping rule.

A trained run's path up to any step does not depend on when it stops (the schedule is laid out
over the whole budget), so the held-out estimates a suite run records every 50 steps
(``PairResult.curves``) say exactly where a rule with ``patience`` P would have stopped it, and
which estimate the path had there. This replays each recorded curve through
:class:`hf_lmc.learned.training.Stopping` itself (the rule the loop runs, target included) for
each P and reports, per P over every run: the seconds to the stop against the run's own, and the
estimate at the stop against the run's final one (mean, median, worst). The estimate is the
stopping rule's, on the held-out fitting batches; the suite's barrier, on the evaluation data,
needs a real run with ``--learn patience=P`` (``python -m benchmarks.suite``).

    python -m benchmarks.plateau benchmarks/results/suite-*.json
    python -m benchmarks.plateau --patience 1 2 3 4 6 benchmarks/results/suite-20261207-*.json

Writes a record (``benchmarks/record.py``) under ``benchmarks/results/`` or to ``--json FILE``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from hf_lmc.learned.training import Stopping

from .record import new_record, write

PATIENCES = (1, 2, 3, 4, 6, 8)


def replay(curve: Sequence[Sequence[float]], target: float | None, patience: int | None) -> tuple[int, float, float]:
    """Where a run whose estimates were ``curve`` (``[steps, seconds, estimate]``) stops under the
    rule with ``target`` and ``patience``: ``(steps, seconds, estimate)`` of the stopping estimate."""
    budget = int(curve[-1][0])
    stopping = Stopping(target, 1, budget=budget, patience=patience)
    for steps, seconds, estimate in curve:
        if stopping.record(int(steps), estimate, seconds):
            return int(steps), seconds, estimate
    steps, seconds, estimate = curve[-1]
    return int(steps), seconds, estimate


def runs_of(paths: Sequence[Path]) -> list[dict]:
    """Every trained run with a curve in the suite records at ``paths``: pair, method, target, curve."""
    runs = []
    for path in paths:
        record = json.loads(path.read_text())
        target = (record.get("settings", {}).get("learn") or {}).get("target_barrier")
        for pair in record.get("pairs", []):
            for label, curve in (pair.get("curves") or {}).items():
                if len(curve) >= 2:
                    runs.append(
                        {"record": path.name, "pair": pair["name"], "method": label, "target": target, "curve": curve}
                    )
    return runs


def measure(runs: Sequence[dict], patiences: Sequence[int]) -> list[dict]:
    """Per run and ``patience``: the stop, its seconds and estimate against the run's own end."""
    rows = []
    for run in runs:
        end_steps, end_seconds, end_estimate = replay(run["curve"], run["target"], None)
        for patience in patiences:
            steps, seconds, estimate = replay(run["curve"], run["target"], patience)
            rows.append(
                {
                    "pair": run["pair"],
                    "method": run["method"],
                    "record": run["record"],
                    "patience": patience,
                    "steps": steps,
                    "end_steps": end_steps,
                    "time_ratio": seconds / end_seconds if end_seconds else 1.0,
                    "estimate": estimate,
                    "end_estimate": end_estimate,
                    "estimate_rise": estimate - end_estimate,
                }
            )
    return rows


def summary(rows: Sequence[dict], patiences: Sequence[int]) -> list[dict]:
    """Per ``patience`` over every run: the time ratio and the rise of the estimate, mean, median and worst."""
    out = []
    for patience in patiences:
        picked = [row for row in rows if row["patience"] == patience]
        if not picked:
            continue
        ratios, rises = [row["time_ratio"] for row in picked], [row["estimate_rise"] for row in picked]
        out.append(
            {
                "patience": patience,
                "runs": len(picked),
                "time_ratio": {
                    "mean": statistics.mean(ratios),
                    "median": statistics.median(ratios),
                    "worst": max(ratios),
                },
                "estimate_rise": {
                    "mean": statistics.mean(rises),
                    "median": statistics.median(rises),
                    "worst": max(rises),
                },
            }
        )
    return out


def table(summaries: Sequence[dict]) -> str:
    rows = [
        "| patience | runs | seconds to the stop ÷ the run's, mean (median, worst) | estimate at the stop − the run's final, mean (median, worst) |",
        "|---|---|---|---|",
    ]
    for s in summaries:
        t, e = s["time_ratio"], s["estimate_rise"]
        rows.append(
            f"| {s['patience']} | {s['runs']} | {t['mean']:.2f} ({t['median']:.2f}, {t['worst']:.2f}) | "
            f"{e['mean']:+.4f} ({e['median']:+.4f}, {e['worst']:+.4f}) |"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", nargs="+", type=Path, help="suite records whose pairs carry curves")
    parser.add_argument("--patience", nargs="+", type=int, default=list(PATIENCES), help="patiences to replay")
    parser.add_argument("--json", type=Path, default=None, help="write the record here instead of benchmarks/results/")
    args = parser.parse_args(argv)
    runs = runs_of(args.records)
    if not runs:
        raise SystemExit(
            "no trained run with a curve in these records (records made before curves were kept have none)"
        )
    rows = measure(runs, args.patience)
    summaries = summary(rows, args.patience)
    print(table(summaries))
    settings = {"records": [path.name for path in args.records], "patiences": list(args.patience)}
    record = new_record("plateau", settings) | {"runs": rows, "summary": summaries}
    print(f"\nwritten to {write(record, args.json)}", file=sys.stderr)


if __name__ == "__main__":
    main()
