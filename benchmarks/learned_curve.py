"""Barrier against training steps: what dual matching buys over one-sided learned matching.

Over a full symmetry group the merged function depends only on ``T_A^-1 T_B`` (docs/design.md §4), so
dual matching cannot reach a function one-sided matching cannot; any gain is in optimisation.
This trains :class:`hf_lmc.LearnedMatcher` and :class:`hf_lmc.DualMatcher` on the same zoo pair,
the same batches (fresh training-split batches of ``--batch-size`` every step) and the same optimiser
settings, and every ``--every`` steps measures the held-out barrier of the hardened merge on an
11-point alpha grid (docs/design.md §1). Prints one markdown table: steps × method → barrier.

    python benchmarks/learned_curve.py --pair gpt2 --steps 1000 --every 250
    python benchmarks/learned_curve.py --pair gpt2 --steps 3000 --schedule cosine --lr 1e-2 --warmup 100
    python benchmarks/learned_curve.py --pair pythia-wide --batch-size 64 --schedule cosine --lr 1e-2 --warmup 50
    python benchmarks/learned_curve.py --pair vit --batch-size 64 --schedule cosine --lr 5e-3 --warmup 50 --input-noise 0.25 --seed 1

The ``-wide`` pairs (``zoo.WIDE``) are their family at twice the width, trained the same way:
how the barrier learned matching reaches falls with width.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from hf_lmc import ActivationMatcher, DualMatcher, LearnedMatcher, canonicalize, zoo
from hf_lmc.alignment import LearnOptions
from hf_lmc.canonical import interpolate, to_hf
from hf_lmc.evaluation import EvalOptions, evaluate, load_batches
from hf_lmc.grids import alpha_grid, excess_over_line, loss_barrier
from hf_lmc.loading import load_model
from hf_lmc.matching.learned import FOCI, OBJECTIVES
from hf_lmc.matching.trainable import PERMUTATIONS

MATCHERS = {"learned": LearnedMatcher, "dual": DualMatcher}


def held_out_barrier(matcher: DualMatcher, batches, grid: list[float]) -> tuple[float, list[float]]:
    """Barrier of the exact (hardened) merge path, and the losses along it."""
    a, b = (model.materialize() for model in matcher.aligned())
    losses = [evaluate(to_hf(interpolate(a, b, alpha)), batches).loss for alpha in grid]
    return loss_barrier(grid, losses), losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="gpt2", choices=list(zoo.ZOO), help="zoo pair (default: gpt2)")
    parser.add_argument("--methods", nargs="+", default=list(MATCHERS), choices=list(MATCHERS))
    parser.add_argument("--steps", type=int, default=1000, help="training steps (default: 1000)")
    parser.add_argument("--every", type=int, default=250, help="measure the barrier every N steps (default: 250)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default: 3e-3)")
    parser.add_argument(
        "--residual-lr", type=float, default=None, help="the residual maps' learning rate (default: --lr)"
    )
    parser.add_argument("--schedule", default="constant", help="transformers scheduler name (default: constant)")
    parser.add_argument("--warmup", type=int, default=0, help="linear warmup steps (default: 0)")
    parser.add_argument("--lambda-range", type=float, nargs=2, default=(0.4, 0.6), metavar=("LOW", "HIGH"))
    parser.add_argument("--batch-size", type=int, default=16, help="training batch size (default: 16)")
    parser.add_argument(
        "--permutations", default="fixed", choices=PERMUTATIONS, help="permutation parameterisation (default: fixed)"
    )
    parser.add_argument(
        "--init",
        default="weight",
        choices=["weight", "activation"],
        help="starting transform of B: weight matching's, or activation matching's on 200 training batches of 16 (default: weight)",
    )
    parser.add_argument(
        "--objective",
        default="labels",
        choices=list(OBJECTIVES),
        help="train toward the batch's labels or the endpoints' predictions mixed at the same lambda (default: labels)",
    )
    parser.add_argument(
        "--orthogonal",
        default="cayley",
        choices=["cayley", "exp", "polar"],
        help="orthogonal parameterisation (default: cayley)",
    )
    parser.add_argument(
        "--frame",
        default="own",
        choices=["own", "target", "both"],
        help="where the trained factor of each map sits: M_0 f(A) (steps in the model's own coordinates), f(A) M_0 (in A's) or f(L) M_0 f(A) (both, as dual's relative map; default: own)",
    )
    parser.add_argument(
        "--train-barrier",
        action="store_true",
        help="also measure the barrier on 8 training-split batches (the generalisation gap)",
    )
    parser.add_argument(
        "--focus",
        choices=FOCI,
        default=LearnOptions.focus,
        help=f"where the --worst-fraction draws go: near the worst grid point, or near each in proportion to its excess over the line (default: {LearnOptions.focus})",
    )
    parser.add_argument(
        "--worst-fraction",
        type=float,
        default=LearnOptions.worst_fraction,
        help=f"share of lambda draws near the path's current worst point, the rest uniform over --lambda-range (default: {LearnOptions.worst_fraction})",
    )
    parser.add_argument(
        "--locate-every", type=int, default=50, help="re-locate the worst point every N steps (default: 50)"
    )
    parser.add_argument(
        "--input-noise",
        type=float,
        default=LearnOptions.input_noise,
        metavar="SIGMA",
        help=f"ViT pairs: std of Gaussian noise on the training images, drawn afresh every step (pixels span [-1, 1]; default: {LearnOptions.input_noise})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the batch order, lambda draws and input noise (default: 0, the runs of record)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    folder_a, folder_b = zoo.pair(args.pair, progress=not args.quiet)
    a, b = load_model(folder_a).model, load_model(folder_b).model
    eval_batches = load_batches(zoo.held_out(args.pair), a.config, folder_a, EvalOptions(batch_size=16))
    fit = zoo.fit_batches(args.pair, args.steps, batch_size=args.batch_size, seed=1234 + args.seed)
    if args.input_noise and "pixel_values" not in fit[0]:
        parser.error("--input-noise applies to the ViT pairs only")
    train_batches = fit[:: max(1, args.steps // 8)][:8] if args.train_barrier else None
    grid = alpha_grid(11)
    init = "weight"
    if args.init == "activation":  # calibrated as the barrier table's activation row
        init = ActivationMatcher(zoo.fit_batches(args.pair, 200), progress=False).match(
            canonicalize(a), canonicalize(b)
        )

    curves: dict[str, dict[int, float]] = {}
    for method in args.methods:
        torch.manual_seed(args.seed)  # same lambda draws for both methods
        matcher = MATCHERS[method](
            a,
            b,
            init=init,
            lambda_range=tuple(args.lambda_range),
            permutations=args.permutations,
            orthogonal=args.orthogonal,
            frame=args.frame,
            objective=args.objective,
            worst_fraction=args.worst_fraction,
            focus=args.focus,
            input_noise=args.input_noise,
        )
        curve = curves[method] = {0: held_out_barrier(matcher, eval_batches, grid)[0]}
        if train_batches:
            curves[f"{method} (train)"] = {0: held_out_barrier(matcher, train_batches, grid)[0]}
        start = time.perf_counter()

        def measure(step: int, matcher: DualMatcher, curve=curve, method=method, start=start) -> None:
            if step % args.every == 0 or step == args.steps:
                barrier, losses = held_out_barrier(matcher, eval_batches, grid)
                curve[step] = barrier
                where = grid[max(range(len(grid)), key=excess_over_line(grid, losses).__getitem__)]
                print(
                    f"{method} step {step}: barrier {barrier:.4f} (worst at alpha {where:.1f}; located on training batches at {float(matcher.worst_alpha):.1f}), "
                    f"{time.perf_counter() - start:.0f} s",
                    file=sys.stderr,
                )
                if train_batches:
                    curves[f"{method} (train)"][step] = held_out_barrier(matcher, train_batches, grid)[0]

        matcher.fit(
            fit,
            steps=args.steps,
            lr=args.lr,
            residual_lr=args.residual_lr,
            schedule=args.schedule,
            warmup_steps=args.warmup,
            locate_every=args.locate_every,
            progress=not args.quiet,
            callback=measure,
        )

    steps = sorted({s for curve in curves.values() for s in curve})
    print(
        f"zoo {args.pair}: lr {args.lr} (residual {args.residual_lr or args.lr}), schedule {args.schedule}, warmup {args.warmup}, "
        f"lambda ~ U{tuple(args.lambda_range)}, batch size {args.batch_size}, "
        f"permutations {args.permutations}, orthogonal {args.orthogonal} (frame {args.frame}), init {args.init}, objective {args.objective}, "
        f"worst fraction {args.worst_fraction} (focus {args.focus}, located every {args.locate_every}), input noise {args.input_noise}, seed {args.seed}, "
        f"device {'cuda' if torch.cuda.is_available() else 'cpu'}"
    )
    print("| steps | " + " | ".join(curves) + " |")
    print("|---|" + "---|" * len(curves))
    for step in steps:
        print(
            f"| {step} | " + " | ".join(f"{curves[m][step]:.4f}" if step in curves[m] else "—" for m in curves) + " |"
        )


if __name__ == "__main__":
    main()
