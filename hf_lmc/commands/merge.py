"""``hf-lmc merge``: two or more checkpoints merged into one stock checkpoint with a card
(:mod:`hf_lmc.merging.pipeline`)."""

from __future__ import annotations

import argparse

from hf_lmc.commands.common import (
    ACCELERATE,
    LEARN,
    OUTPUT,
    eval_options,
    fit_options,
    model_revisions,
)
from hf_lmc.config.options import (
    DEFAULT_ALPHA,
    UsageError,
    default_output,
    pair_weights,
)
from hf_lmc.merging.preflight import check_request, merge_request


def main(args: argparse.Namespace) -> int:
    output = args.output
    if output is None:  # said first: the folder is the user's to find (and, with --push-to-hub alone, the repo's name)
        output = default_output(args.models)
        if not args.quiet:
            print(f"writing the merge to ./{output} (no --output given)")
    request = merge_request(args.models, output, **_merge_settings(args))
    check_request(request)  # every refusal that needs no model, before torch and transformers load
    # the command as the card shows it imports huggingface_hub: after the checks
    request = request.model_copy(update={"made_with": _command_markdown(args)})
    if args.dry_run:
        from hf_lmc.merging.pipeline import plan

        print(plan(request).table())
        return 0
    from hf_lmc.merging.pipeline import run

    result = run(request)
    if not result.wrote:  # one of several launched processes: the main one reports
        return 0
    if result.stopping is not None:
        print(f"{result.method} matching: {result.stopping.describe()}")
    if result.barrier is not None:
        print(result.barrier.table())
    print(f"merged model written to {result.output}")
    if result.url:
        print(f"pushed to {result.url}")
    return 0


def _merge_settings(args: argparse.Namespace) -> dict:
    """The :class:`~hf_lmc.config.options.MergeRequest` fields of ``hf-lmc merge``'s flags but the models
    and the output, with the checks of how the flags combine (torch-free)."""
    count = len(args.models)
    if count < 2:
        raise UsageError(f"merge needs at least 2 models, got {count}")
    if args.alpha is not None and args.weights is not None:
        raise UsageError("pass either --alpha (two models) or --weights (one per model), not both")
    if args.alpha is not None and count != 2:
        raise UsageError(
            f"--alpha is the weight of MODEL_B when merging two models; for {count} pass --weights w1 ... w{count}"
        )
    weights = args.weights
    if weights is None and count == 2:
        weights = pair_weights(DEFAULT_ALPHA if args.alpha is None else args.alpha)
    return {
        "weights": weights,
        "revisions": model_revisions(args, count),
        "method": args.method,
        "symmetries": args.symmetries,
        "device": args.device,
        "data": args.data,
        "data_options": fit_options(args),
        "learn": LEARN.build(args),
        "accelerate": ACCELERATE.build(args),
        "eval_data": args.eval_data,
        "eval_options": eval_options(args),
        "alphas": args.alphas,
        **OUTPUT.build(args).model_dump(),
    }


def _command_markdown(args: argparse.Namespace) -> str:
    """The command line as typed, for the model card (``hf-lmc`` however it was started), with
    each local path reduced to its final component (models, data, output: the card is shared,
    the machine's folders are not); flags and Hub ids stay as typed."""
    from hf_lmc.io.hub import command_markdown

    return command_markdown(["hf-lmc", *args.argv])
