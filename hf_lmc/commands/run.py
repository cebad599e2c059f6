"""``hf-lmc run RECIPE``: a recipe's merges, barriers and summary (:mod:`hf_lmc.merging.sweep`). The
recipe and its folders are checked before torch loads."""

from __future__ import annotations

import argparse
import sys

from hf_lmc.commands.common import EXIT_FAILED, recipe_overrides
from hf_lmc.config.flags import OptionFlags
from hf_lmc.config.options import RecipeRunOptions, escape_controls


def main(args: argparse.Namespace) -> int:
    """Run a recipe and print its barrier table. A run that fails is recorded in the summary and
    the others go on (``--fail-fast``: the recipe stops at it); the merges that finished and the
    summary are written either way, each failure is one error line, and the exit code is then
    :data:`EXIT_FAILED`."""
    from hf_lmc.config.recipe import check_outputs, load_recipe

    switched = OptionFlags(RecipeRunOptions, defaults="fields").given(args)  # --fail-fast: output.fail_fast
    overrides = recipe_overrides(args) | {f"output.{name}": True for name, on in switched.items() if on}
    check_outputs(load_recipe(args.recipe, overrides), args.recipe)  # the recipe and its folders, before torch loads

    from hf_lmc.merging.sweep import SKIPPED, SUMMARY, RecipeFailedError, run_recipe

    try:
        result = run_recipe(args.recipe, overrides=overrides)
    except RecipeFailedError as err:  # what finished is written; the summary records each failure
        result = err.result
    if not result.wrote:  # one of several launched processes: the main one reports
        return 0
    print(escape_controls(result.table(), keep="\n"))
    merged = sum(run.ok for run in result.runs)
    shown = escape_controls(result.output)
    print(f"\n{merged} merged model(s) and {SUMMARY}.md/.json/.csv written to {shown}")
    for run in result.runs:
        if run.url:
            print(f"pushed {run.group} / {run.method} to {escape_controls(run.url)}")
    for run in result.failed:
        print(f"hf-lmc: error: {run.group} / {run.method}: {escape_controls(run.error)}", file=sys.stderr)
    skipped = sum(run.status == SKIPPED for run in result.runs)
    if skipped:
        print(
            f"hf-lmc: {skipped} run(s) skipped: output.fail_fast stopped the recipe at its first failure",
            file=sys.stderr,
        )
    return EXIT_FAILED if result.failed else 0
