"""``hf-lmc explain``: where a barrier comes from (:mod:`hf_lmc.evaluation.explain`)."""

from __future__ import annotations

import argparse
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
    check_orders,
    escape_controls,
)


def main(args: argparse.Namespace) -> int:
    check_orders(args.orders)
    check_figure(args, [*args.models, args.eval_data, args.data])
    revisions = model_revisions(args, 2)
    check_method(args.method, args.data, 2, data_parameter="fit_data")
    from hf_lmc.evaluation.explain import explain, kinds_table, plot_explanation
    from hf_lmc.io.loading import load_model

    a, b = (load_model(m, r).model for m, r in zip(args.models, revisions))
    result = explain(
        a,
        b,
        args.eval_data,
        method=args.method,
        symmetries=args.symmetries,
        eval_options=eval_options(args),
        fit_data=args.data,
        fit_options=fit_options(args),
        learn=LEARN.build(args),
        orders=args.orders,
    )
    say(result.to_json() if args.json else f"{result.table()}\n\nparts summed per kind:\n\n{kinds_table(result)}")
    if args.plot:
        title = f"{Path(args.models[0]).name} ↔ {Path(args.models[1]).name}"
        plot_explanation(result, args.plot, title=escape_controls(title, 120), overwrite=args.overwrite)
    return 0
