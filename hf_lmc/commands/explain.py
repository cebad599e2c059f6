"""``hf-lmc explain``: where a barrier comes from (:mod:`hf_lmc.evaluation.explain`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hf_lmc.commands.common import (
    LEARN,
    check_figure,
    eval_options,
    fit_options,
    model_revisions,
    say,
)
from hf_lmc.config.methods import check_method
from hf_lmc.config.options import (
    UsageError,
    check_orders,
    escape_controls,
)


def main(args: argparse.Namespace) -> int:
    check_orders(args.orders)
    if args.all_eval_data and getattr(args, "max_batches", None) is not None:
        raise UsageError("--all-eval-data reads every batch, --max-batches a number of them: pass one")
    check_figure(args, [*args.models, args.eval_data, args.data])
    revisions = model_revisions(args, 2)
    check_method(args.method, args.data, 2, data_parameter="fit_data")
    from hf_lmc.evaluation.explain import explain, explain_cost, kinds_table, plot_explanation
    from hf_lmc.io.loading import load_model
    from hf_lmc.utils.progress import silenced

    # what sets the cost, shared by the estimate and the run
    settings = {
        "method": args.method,
        "orders": args.orders,
        "eval_options": eval_options(args),
        "all_eval_data": args.all_eval_data,
    }
    if args.dry_run:  # the cost is the result: printed whatever -q says
        cost = explain_cost(*args.models, args.eval_data, revisions=revisions, **settings)
        say(f"hf-lmc explain would run {cost.describe()}; nothing was evaluated (--dry-run)")
        return 0

    def announce(cost) -> None:  # before the first pass: what the next minutes are spent on
        if not silenced() and not args.verbose:  # -v logs it among the stages
            print(f"hf-lmc explain: {cost.describe()}", file=sys.stderr)

    a, b = (load_model(m, r).model for m, r in zip(args.models, revisions))
    result = explain(
        a,
        b,
        args.eval_data,
        symmetries=args.symmetries,
        fit_data=args.data,
        fit_options=fit_options(args),
        learn=LEARN.build(args),
        announce=announce,
        **settings,
    )
    say(result.to_json() if args.json else f"{result.table()}\n\nparts summed per kind:\n\n{kinds_table(result)}")
    if args.plot:
        title = f"{Path(args.models[0]).name} ↔ {Path(args.models[1]).name}"
        plot_explanation(result, args.plot, title=escape_controls(title, 120), overwrite=args.overwrite)
    return 0
