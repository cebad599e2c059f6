"""What the commands share: their flag sets, each built once from the option models
(:mod:`hf_lmc.config.options`), and how a command reads its arguments and prints its report. No
torch: :mod:`hf_lmc.cli` builds every parser from here."""

from __future__ import annotations

import argparse
import signal
import sys

from hf_lmc.config.flags import OptionFlags, flag_for
from hf_lmc.config.methods import METHODS, NAMES
from hf_lmc.config.options import (
    EVAL_OPTIONS,
    FIT_OPTIONS,
    AccelerateOptions,
    ApplyOptions,
    CheckOptions,
    DemoOptions,
    EvalOptions,
    ExplainOptions,
    LearnOptions,
    MergeRequest,
    OutputExistsError,
    OutputOptions,
    PairOptions,
    ParameterError,
    UsageError,
    escape_controls,
    flag_of,
)

TOLERANCE = {"float32": 1e-4, "float64": 1e-9}


LEARN = OptionFlags(LearnOptions)


ACCELERATE = OptionFlags(AccelerateOptions)


#: One set of batching flags for both data sets; where a flag is absent each keeps its own default.
BATCHES = OptionFlags(
    EvalOptions,
    only=("batch_size", "seq_len", "max_batches"),
    defaults={"--data": FIT_OPTIONS, "--eval-data": EVAL_OPTIONS},
)


#: The same flags where the fitting data is the only data set (``hf-lmc align``).
FIT_BATCHES = OptionFlags(EvalOptions, only=("batch_size", "seq_len", "max_batches"), defaults=FIT_OPTIONS)


#: One name per data set across commands: ``--data`` is what alignment fits on (activation,
#: learned, dual), ``--eval-data`` what the barrier is measured on; each has its split and
#: dataset configuration flags, and both are batched alike.
FIT_SOURCE = OptionFlags(
    EvalOptions,
    only=("split", "name"),
    flags={"split": "--data-split", "name": "--data-name"},
    defaults=FIT_OPTIONS,
    prefix="fit_",
)


EVAL_SOURCE = OptionFlags(
    EvalOptions,
    only=("split", "name"),
    flags={"split": "--eval-data-split", "name": "--eval-data-name"},
    prefix="eval_",
)


OUTPUT = OptionFlags(OutputOptions, metavars={"push_to_hub": "REPO_ID"})


#: The flags of a merge of two models that name its models by letter (--alpha, --revision-a/-b).
PAIR = OptionFlags(PairOptions, defaults="fields")


#: The own flags of the commands that are not merges.
DEMO = OptionFlags(DemoOptions, defaults="fields", flags={"steps": "--train-steps"})


CHECK = OptionFlags(CheckOptions, defaults="fields", flags={"dtype": "--compute-dtype", "seed": "--sample-seed"})


EXPLAIN = OptionFlags(ExplainOptions, defaults="fields")


APPLY = OptionFlags(ApplyOptions, defaults="fields", flags={"revision": "--revision-model"})


#: How ``apply`` writes: the merge's output settings that a moved model takes.
MOVED_OUTPUT = OptionFlags(
    OutputOptions,
    only=("dtype", "shard_size", "overwrite"),
    defaults="fields",
    helps={"dtype": "dtype of the written weights (default: MODEL's; refused for an adapter, which keeps its own)"},
)


#: How ``barrier`` and ``explain`` write their figure: replaced only with --overwrite, and only
#: a figure hf-lmc wrote.
FIGURE_OUTPUT = OptionFlags(
    OutputOptions,
    only=("overwrite",),
    defaults="fields",
    helps={"overwrite": "replace an existing --plot file (only a figure hf-lmc wrote)"},
)


#: The merge request's own flags (the models are positional, and the output settings are
#: :data:`OUTPUT`'s); each command offers those it takes.
REQUEST = OptionFlags(
    MergeRequest,
    only=("output", "revisions", "weights", "method", "symmetries", "device", "data", "eval_data", "alphas"),
    defaults="fields",
    choices={"method": NAMES},
    helps={
        "method": flag_of(MergeRequest.model_fields["method"]).help
        + ": "
        + "; ".join(f"{m.name}, {m.when}" for m in METHODS.values())
        + f" (default: {MergeRequest.model_fields['method'].default})"
    },
)


#: ``hf-lmc align``'s output: one folder per model inside it, so never named after the models.
ALIGNED_OUTPUT = OptionFlags(
    MergeRequest,
    only=("output",),
    defaults="fields",
    helps={
        "output": "folder to write, one folder per model inside it: new, empty, or with --overwrite one hf-lmc wrote"
    },
)


def eval_options(args: argparse.Namespace):
    return EVAL_SOURCE.build(args, **BATCHES.given(args))


def fit_options(args: argparse.Namespace):
    return FIT_SOURCE.build(args, **BATCHES.given(args))


def check_figure(args: argparse.Namespace, read) -> None:
    """The ``--plot`` file checked before any work (:func:`hf_lmc.io.outputs.check_figure_path`)."""
    if args.plot:
        from hf_lmc.io.outputs import check_figure_path

        check_figure_path(args.plot, [r for r in read if isinstance(r, str)], "plot", overwrite=args.overwrite)


def say(text: str) -> None:
    """Print a command's report with every control character but newlines and tabs escaped: it
    carries names read from files and folders (labels, models), which must not drive the terminal."""
    print(escape_controls(text, keep="\n\t"))


def model_revisions(args: argparse.Namespace, count: int) -> list[str | None]:
    """One revision per model from ``--revisions`` or ``--revision-a/--revision-b``."""
    if args.revisions is not None and (args.revision_a or args.revision_b):
        raise UsageError("pass either --revisions or --revision-a/--revision-b, not both")
    if args.revisions is None:
        return [args.revision_a, args.revision_b] + [None] * (count - 2)
    if len(args.revisions) != count:
        raise UsageError(
            f"--revisions takes one entry per model ('-' for the default branch): got {len(args.revisions)} for {count} models"
        )
    return [None if r == "-" else r for r in args.revisions]


#: Exit codes, as argparse, ``hf`` and mergekit use them: 2 when the command as written cannot
#: run (argparse's own usage errors, a bad or conflicting value, an output that exists or covers
#: an input), 1 when a run fails on what it reads or writes (models, data, disk, network).
EXIT_USAGE, EXIT_FAILED = 2, 1
EXIT_INTERRUPTED = 128 + signal.SIGINT  # as a shell reports a process that Ctrl-C ended


def report(err: ValueError | OSError) -> int:
    """Print ``err`` as one ``hf-lmc: error:`` line, a parameter the library names shown as its
    flag, and return its exit code: :data:`EXIT_USAGE` for a usage error, else :data:`EXIT_FAILED`."""
    if isinstance(err, (UsageError, OutputExistsError)):
        named = err.named(flag_for(err.parameter)) if isinstance(err, (ParameterError, OutputExistsError)) else err
        print(f"hf-lmc: error: {escape_controls(named)}", file=sys.stderr)
        return EXIT_USAGE
    print(f"hf-lmc: error: {escape_controls(err)}", file=sys.stderr)  # one line, whatever a file's text held
    return EXIT_FAILED


def recipe_overrides(args: argparse.Namespace) -> dict:
    from hf_lmc.config.recipe import parse_override

    overrides = dict(parse_override(text) for text in args.set)
    if getattr(args, "overwrite", False):
        overrides["output.overwrite"] = True
    return overrides


#: Flags that meant something else in one command than in the others, by command: the old
#: spelling, refused in one line naming the new one (one meaning per flag across commands).
RENAMED_FLAGS = {
    "check": {"--dtype": "--compute-dtype", "--seed": "--sample-seed"},
    "demo": {"--steps": "--train-steps"},
    "apply": {"--revision": "--revision-model"},
}


class RenamedFlag(argparse.Action):
    """An old spelling of a renamed flag: one ``hf-lmc: error:`` line naming the new one, exit 2."""

    def __init__(self, option_strings, dest, renamed_to: str, **kwargs):
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.renamed_to = renamed_to

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"hf-lmc: error: {option_string} is now {self.renamed_to} in {parser.prog}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def add_renamed(parser: argparse.ArgumentParser, command: str) -> None:
    """The old spellings of ``command``'s renamed flags (:data:`RENAMED_FLAGS`), each refused by name."""
    for old, new in RENAMED_FLAGS.get(command, {}).items():
        parser.add_argument(old, action=RenamedFlag, renamed_to=new, dest=f"renamed_{old.strip('-')}")
