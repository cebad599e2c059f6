"""``hf-lmc align``: every model of a merge written as a stock checkpoint in the merge's
coordinates, nothing interpolated, for merging with other tools (:mod:`hf_lmc.merging.aligned`)."""

from __future__ import annotations

import argparse

from hf_lmc.commands.common import (
    ACCELERATE,
    LEARN,
    OUTPUT,
    fit_options,
    model_revisions,
    say,
)
from hf_lmc.config.options import UsageError
from hf_lmc.merging.preflight import check_align_request, merge_request


def main(args: argparse.Namespace) -> int:
    count = len(args.models)
    if count < 2:
        raise UsageError(f"align needs at least 2 models, got {count}")
    request = merge_request(
        args.models,
        args.output,
        revisions=model_revisions(args, count),
        method=args.method,
        symmetries=args.symmetries,
        device=args.device,
        data=args.data,
        data_options=fit_options(args),
        learn=LEARN.build(args),
        accelerate=ACCELERATE.build(args),
        **OUTPUT.build(args).model_dump(),
    )
    check_align_request(request)  # every refusal that needs no model, before torch and transformers load
    from hf_lmc.io.hub import command_markdown  # imports huggingface_hub: after the checks

    request = request.model_copy(update={"made_with": command_markdown(["hf-lmc", *args.argv])})
    from hf_lmc.merging.aligned import run_aligned

    result = run_aligned(request)
    if not result.wrote:  # one of several launched processes: the main one reports
        return 0
    if result.stopping is not None:
        print(f"{result.method} matching: {result.stopping.describe()}")
    folders = ", ".join(folder.name for folder in result.folders)
    say(f"aligned models written to {result.output}: {folders} (the first is the reference), transforms beside them")
    return 0
