"""The simplex barrier of a zoo triple: vanilla averaging vs universe matching vs learned refinement.

Three independently trained members of a zoo entry (seeds 0, 1, 2: different initialisation and
data order) span a simplex of merges ``sum_k w_k T_k(theta_k)``. For each method this evaluates
held-out loss on a grid of that simplex (every point with coordinates in steps of
``1/(points-1)``, plus the centre) and reports the barrier: the worst grid point's excess over
``sum_k w_k L(theta_k)`` (docs/design.md §1 for M models; hf_lmc.barriers.simplex_barrier).

Rows: ``average`` (the stored weights), ``weight (to first)`` (B and C each aligned to A by
two-model weight matching: the naive baseline), ``weight`` (universe matching), ``learned``
(universe matching, then B's and C's transforms trained at w ~ Dirichlet(1), uniform over the
simplex, while A's stays) and ``dual`` (all three trained). Learned methods train on 16-sample
training batches at ``LearnOptions``' defaults unless told otherwise. (``python -m
benchmarks.suite --triples`` measures the suite's triples at the defaults.)

    python benchmarks/simplex.py --entries vit gpt2            # trains seed 2 on first use
    python benchmarks/simplex.py --entries vit --points 6 --steps 400

Writes ``benchmarks/plots/simplex_<entry>.png`` (one triangle per method) and the raw losses as
``simplex_<entry>.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import hf_lmc
from hf_lmc import zoo
from hf_lmc.barriers import SimplexBarrierResult, plot_simplex, simplex_barrier_of_loaded
from hf_lmc.evaluation import load_batches
from hf_lmc.loading import load_model
from hf_lmc.options import PERMUTATIONS, EvalOptions, LearnOptions
from hf_lmc.symmetry import Transform

LABELS = ("average", "weight (to first)", "weight", "learned", "dual")


def measure(
    name: str, labels: list[str], points: int, learn: LearnOptions, progress: bool
) -> tuple[SimplexBarrierResult, dict]:
    folders = [zoo.train(name, seed, progress=progress) for seed in (0, 1, 2)]
    loaded = [load_model(f) for f in folders]
    data = load_batches(zoo.held_out(name), loaded[0].model.config, loaded[0].folder, EvalOptions(batch_size=16))
    fit = zoo.fit_batches(name, learn.steps)
    combined, seconds = None, {}
    for label in labels:
        start = time.perf_counter()
        method, transforms = label, None
        if label == "weight (to first)":
            method = "weight"
            canonical = [hf_lmc.canonicalize(m.model) for m in loaded]
            matcher = hf_lmc.WeightMatcher(progress=False)
            transforms = {"weight": [Transform()] + [matcher.match(canonical[0], c) for c in canonical[1:]]}
        result = simplex_barrier_of_loaded(
            loaded,
            data,
            methods=(method,),
            points=points,
            symmetries="full",
            eval_options=EvalOptions(batch_size=16),
            progress=False,
            fit_batches=fit,
            learn=learn,
            transforms=transforms,
        )
        seconds[label] = time.perf_counter() - start
        print(
            f"{name} {label}: barrier {result.barriers[method]:.3f} ({seconds[label]:.0f} s with evaluation)",
            file=sys.stderr,
        )
        combined = combined or SimplexBarrierResult(result.points)
        combined.losses[label] = result.losses[method]
        if method in result.accuracies:
            combined.accuracies[label] = result.accuracies[method]
    return combined, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--entries", nargs="+", default=["vit"], choices=list(zoo.ZOO), help="zoo entries to measure (default: vit)"
    )
    parser.add_argument(
        "--methods", nargs="+", default=list(LABELS), choices=LABELS, help="rows to measure (default: all)"
    )
    parser.add_argument(
        "--points", type=int, default=5, help="grid points per edge of the simplex (default: 5, steps of 0.25)"
    )
    defaults = LearnOptions()
    parser.add_argument(
        "--steps", type=int, default=defaults.steps, help=f"learned / dual training steps (default: {defaults.steps})"
    )
    parser.add_argument(
        "--lr", type=float, default=defaults.lr, help=f"learned / dual learning rate (default: {defaults.lr})"
    )
    parser.add_argument(
        "--concentration",
        type=float,
        default=defaults.concentration,
        help=f"Dirichlet concentration of the training weights (default: {defaults.concentration})",
    )
    parser.add_argument(
        "--plots-dir",
        type=Path,
        default=Path("benchmarks/plots"),
        help="where simplex_<entry>.png/.json go (default: benchmarks/plots)",
    )
    parser.add_argument(
        "--permutations",
        default="fixed",
        choices=PERMUTATIONS,
        help="learned / dual: how the unit and head permutations train (default: fixed)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args()
    args.plots_dir.mkdir(parents=True, exist_ok=True)

    learn = LearnOptions(steps=args.steps, lr=args.lr, concentration=args.concentration, permutations=args.permutations)
    rows = [
        "| triple | method | loss A / B / C | loss at the centre | worst point w | barrier | ratio to average | acc. at the centre | time (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in args.entries:
        result, seconds = measure(name, args.methods, args.points, learn, not args.quiet)
        (args.plots_dir / f"simplex_{name}.json").write_text(result.to_json())
        path = plot_simplex(
            result,
            args.plots_dir / f"simplex_{name}.png",
            names=("seed 0", "seed 1", "seed 2"),
            title=f"zoo {name} triple: held-out loss above the vertices' plane",
        )
        print(f"{name}: plot in {path}", file=sys.stderr)
        vanilla = result.barriers.get("average")
        centre = min(range(len(result.points)), key=lambda i: max(abs(x - 1 / 3) for x in result.points[i]))
        for label, value in result.barriers.items():
            losses, acc = result.losses[label], result.accuracies.get(label)
            worst = "(" + ", ".join(f"{x:.2f}" for x in result.worst(label)) + ")"
            rows.append(
                f"| {name} | {label} | {' / '.join(f'{x:.3f}' for x in losses[:3])} | {losses[centre]:.3f} | {worst} | {value:.3f} | "
                f"{f'{value / vanilla:.2f}' if vanilla else '—'} | {f'{acc[centre]:.3f}' if acc else '—'} | {seconds[label]:.0f} |"
            )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
