"""``hf-lmc recipe check`` and ``hf-lmc recipe schema``: recipes validated, the schema printed
(:mod:`hf_lmc.config.recipe`)."""

from __future__ import annotations

import argparse

from hf_lmc.commands.common import recipe_overrides, report
from hf_lmc.config.options import (
    escape_controls,
)


def check(args: argparse.Namespace) -> int:
    """Validate each recipe on its own, run every check that needs no weight (the recipe, the
    folders it writes against those it reads, each group's configs compared as the merge compares
    them) and list its runs; every invalid one is reported (as one error line) and the exit code is
    the worst of them. A check left out (a config not at hand here) is listed as a note."""
    from hf_lmc.config.recipe import check_outputs, load_recipe
    from hf_lmc.merging.sweep import check_models, unpinned_models

    overrides, worst = recipe_overrides(args), 0
    for path in args.recipes:
        try:
            recipe = load_recipe(path, overrides)
            check_outputs(recipe, path, tidy=False)  # the folders it writes against those it reads, changing nothing
            left_out = check_models(recipe, path)  # config.json alone: no weight is read or downloaded
            runs = recipe.runs()
        except (ValueError, OSError) as err:
            worst = max(worst, report(err))
            continue
        print(f"{escape_controls(path)}: valid; {len(runs)} run(s) into {escape_controls(recipe.output.dir)}")
        for note in left_out:
            print(f"  note: {escape_controls(note)}")
        for warning in unpinned_models(recipe):
            print(f"  warning: {escape_controls(warning)}")
        if recipe.output.fail_fast:
            print("  stops at its first failed run (output.fail_fast)")
        launch = recipe.launch.command(str(path))
        if launch:
            print(f"  runs as {recipe.launch.processes} processes: {launch}")
        push = recipe.output.push_to_hub
        for group, method, models in runs:
            target = f" -> {push.format(group=group, method=method)}" if push else ""
            target += " (under the token's namespace)" if push and "/" not in push else ""
            print(f"  {recipe.run_folder(group, method)}: {method} of {', '.join(m.label for m in models)}{target}")
    return worst


def schema(args: argparse.Namespace) -> int:
    import json

    from hf_lmc.config.recipe import Recipe

    print(json.dumps(Recipe.model_json_schema(), indent=2))
    return 0
