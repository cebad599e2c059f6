"""Weight matching's two solves of the RoPE head maps, on the suite's RoPE pairs.

Weight matching aligns each RoPE head by per-frequency-pair scale-rotations. ``moments`` (the
default) balances each model's pair on its own and takes the angle by Procrustes; ``joint`` is
Tran et al.'s appendix G.1, the least-squares map of Q and K together
(:func:`hf_lmc.matching.solvers.match_rotary_joint_moments`). Both are exact on twins; this
measures which leaves the lower barrier between independently trained models. Per pair: the
vanilla barrier, and for each solve the weight-matching barrier, its ratio to vanilla, the
matching objective (``WeightMatcher.objective``) and seconds; then mean, std and worst per solve.

    python -m benchmarks.rotary_solve --tier ci
    python -m benchmarks.rotary_solve --tier cpu --pairs suite-llama-c suite-pythia-a

Members are trained (or loaded) from the zoo cache as the suite trains them (:mod:`benchmarks.suite`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from hf_lmc import WeightMatcher, canonicalize
from hf_lmc.config.options import ROTARY_SOLVES, EvalOptions
from hf_lmc.evaluation.barriers import barrier_of_loaded
from hf_lmc.io import zoo
from hf_lmc.io.loading import load_model
from hf_lmc.symmetry import Transform

from .record import new_record, settings_of, write
from .suite import TIERS, SuitePair, evaluation_batches, tier_pairs

ROPE_FAMILIES = ("pythia", "llama")


def measure(pair: SuitePair, solves: Sequence[str] = ROTARY_SOLVES) -> dict:
    """The vanilla barrier of ``pair`` and, per solve, weight matching's barrier, objective and seconds."""
    folders = [zoo.train(pair.entry, seed, progress=False) for seed in pair.seeds]
    a, b = (load_model(folder) for folder in folders)
    evaluation = evaluation_batches(pair.entry, folders[0])
    canonical_a, canonical_b = canonicalize(a.model), canonicalize(b.model)
    transforms, seconds, objectives = {}, {}, {}
    for solve in solves:
        start = time.perf_counter()
        matcher = WeightMatcher(progress=False, rotary_solve=solve)
        transform = matcher.match(canonical_a, canonical_b)
        seconds[solve] = time.perf_counter() - start
        objectives[solve] = matcher.objective(canonical_a, canonical_b, transform)
        transforms[solve] = transform
    options = {"alphas": 11, "symmetries": "full", "eval_options": EvalOptions(batch_size=16), "progress": False}
    vanilla = barrier_of_loaded(a, b, evaluation, methods=("average",), **options).barriers["average"]
    barriers = {}
    for solve, transform in transforms.items():
        result = barrier_of_loaded(
            a, b, evaluation, methods=("weight",), transforms={"weight": (Transform(), transform)}, **options
        )
        barriers[solve] = result.barriers["weight"]
    row = {
        "family": pair.family,
        "name": pair.entry.name,
        "varies": pair.varies,
        "vanilla": vanilla,
        "barriers": barriers,
        "ratios": {solve: value / vanilla for solve, value in barriers.items()},
        "objectives": objectives,
        "seconds": seconds,
    }
    print(
        f"{pair.entry.name}: vanilla {vanilla:.4f}; "
        + "; ".join(
            f"{s} {barriers[s]:.4f} ({barriers[s] / vanilla:.3f}x, objective {objectives[s]:.4f})" for s in solves
        ),
        file=sys.stderr,
    )
    return row


def summary(rows: Sequence[dict], solves: Sequence[str]) -> dict:
    """Per solve: mean, std and worst of the barrier and of its ratio to vanilla, over ``rows``."""

    def spread(values):
        return {
            "mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "worst": max(values),
        }

    return {
        solve: {
            "barrier": spread([r["barriers"][solve] for r in rows]),
            "ratio": spread([r["ratios"][solve] for r in rows]),
            "pairs_lower_than_moments": sum(r["barriers"][solve] < r["barriers"]["moments"] for r in rows)
            if "moments" in solves
            else None,
        }
        for solve in solves
    }


def table(rows: Sequence[dict], totals: dict, solves: Sequence[str]) -> str:
    lines = ["| pair | vanilla | " + " | ".join(solves) + " |", "|---|---|" + "---|" * len(solves)]
    for r in rows:
        cells = " | ".join(f"{r['barriers'][s]:.4f} ({r['ratios'][s]:.3f}×)" for s in solves)
        lines.append(f"| {r['name']} | {r['vanilla']:.4f} | {cells} |")
    for stat in ("mean", "std", "worst"):
        cells = " | ".join(f"{totals[s]['barrier'][stat]:.4f} ({totals[s]['ratio'][stat]:.3f}×)" for s in solves)
        lines.append(f"| {stat} | | {cells} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tier", choices=list(TIERS), default="ci", help="which suite pairs (default: ci)")
    parser.add_argument("--pairs", nargs="+", default=None, help="only these RoPE pairs of the tier")
    parser.add_argument("--solves", nargs="+", choices=ROTARY_SOLVES, default=list(ROTARY_SOLVES))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default=None, help="write the record here instead of benchmarks/results/")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    pairs = tier_pairs(args.tier, ROPE_FAMILIES, args.pairs)
    if not pairs:
        parser.error(f"the {args.tier} tier has no RoPE pair among {args.pairs}")
    record = new_record("rotary_solve", settings_of(args))
    rows = [measure(pair, args.solves) for pair in pairs]
    record["pairs"], record["summary"] = rows, summary(rows, args.solves)
    print(table(rows, record["summary"], args.solves))
    print(f"\nwritten to {write(record, args.json)}", file=sys.stderr)


if __name__ == "__main__":
    main()
