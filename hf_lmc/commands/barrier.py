"""``hf-lmc barrier``: the loss barrier along the average's and the aligned paths, or over the simplex
(:mod:`hf_lmc.evaluation.barriers`)."""

from __future__ import annotations

import argparse

from hf_lmc.commands.common import (
    ACCELERATE,
    LEARN,
    check_figure,
    eval_options,
    fit_options,
    model_revisions,
    say,
)
from hf_lmc.config.methods import check_method
from hf_lmc.config.options import (
    PATH_POINTS,
    SIMPLEX_POINTS,
    UsageError,
)
from hf_lmc.evaluation.grids import alpha_grid


def main(args: argparse.Namespace) -> int:
    models = args.models
    if len(models) < 2:
        raise UsageError(f"barrier needs at least 2 models, got {len(models)}")
    if args.plot and len(models) > 3:
        raise UsageError(f"--plot draws the simplex of three models, got {len(models)}; drop --plot or pass three")
    check_figure(args, [*models, args.eval_data, args.data])
    revisions = model_revisions(args, len(models))
    check_method(args.method, args.data, len(models), data_parameter="fit_data")
    if args.alphas is not None:
        alpha_grid(args.alphas)
    methods = ("average",) if args.method == "average" else ("average", args.method)
    common = {
        "methods": methods,
        "symmetries": args.symmetries,
        "eval_options": eval_options(args),
        "fit_data": args.data,
        "fit_options": fit_options(args),
        "learn": LEARN.build(args),
        "accelerate": ACCELERATE.build(args),
    }
    from hf_lmc.evaluation.barriers import barrier, barrier_over_simplex, plot, plot_simplex

    if len(models) == 2:
        result = barrier(
            *models,
            args.eval_data,
            alphas=PATH_POINTS if args.alphas is None else args.alphas,
            revision_a=revisions[0],
            revision_b=revisions[1],
            **common,
        )
        draw = plot
    else:
        result = barrier_over_simplex(
            models,
            args.eval_data,
            points=SIMPLEX_POINTS if args.alphas is None else args.alphas,
            revisions=revisions,
            **common,
        )
        draw = plot_simplex
    say(result.to_json() if args.json else result.table())  # what was measured, before a file can fail
    if args.plot:
        draw(result, args.plot, overwrite=args.overwrite)
    return 0
