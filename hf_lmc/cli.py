"""``hf-lmc``: the command-line interface: the parser, and the dispatch to each command's handler.

The flags of every option come from the option models (:mod:`hf_lmc.config.options`, through the
flag sets of :mod:`hf_lmc.commands.common`) and the method choices from the registry
(:mod:`hf_lmc.config.methods`); library errors that name a parameter are shown with its flag.

Each command's handler lives with its command (``hf-lmc apply`` is :func:`hf_lmc.commands.apply.main`)
and is named here by its module path, imported only when the command runs: most load torch and
transformers, which building the parser must not (``hf-lmc --help`` stays fast;
``tests/test_layers.py`` checks ``sys.modules``). A handler runs every check that needs no model
before its heavy imports (the flags, :mod:`hf_lmc.merging.preflight`), so a request that cannot
run is refused at once (``tests/test_cli.py`` checks ``sys.modules`` at the refusal).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
import warnings
from collections.abc import Sequence

from hf_lmc.commands.common import (
    ACCELERATE,
    ALIGNED_OUTPUT,
    APPLY,
    BATCHES,
    CHECK,
    DEMO,
    EVAL_SOURCE,
    EXIT_INTERRUPTED,
    EXPLAIN,
    FIGURE_OUTPUT,
    FIT_BATCHES,
    FIT_SOURCE,
    LEARN,
    MOVED_OUTPUT,
    OUTPUT,
    PAIR,
    REQUEST,
    add_renamed,
    report,
)
from hf_lmc.config.flags import OptionFlags
from hf_lmc.utils import allocator
from hf_lmc.version import __version__

#: Every example, one command line each: ``hf-lmc --help`` shows them all, and each command's
#: ``--help`` the lines of that command (:func:`_examples`).
EXAMPLES = """\
examples:
  hf-lmc demo                                                         # train a pair, merge, barrier table
  hf-lmc demo --write-plays .                                         # the shipped plays as text: ./train.txt, ./plays.txt
  hf-lmc merge org/model-a org/model-b --push-to-hub                 # into ./model-a-model-b-merged, pushed to your namespace
  hf-lmc merge org/model-a org/model-b --output ./merged              # weight matching, alpha 0.5
  hf-lmc merge ./a ./b --output ./merged --dry-run                    # check everything, estimate size and time, write nothing
  hf-lmc merge ./a ./b --output ./merged --eval-data plays.txt --push-to-hub user/merged
  hf-lmc merge ./a ./b --output ./avg --method average                # the unaligned baseline
  hf-lmc merge ./a ./b --output ./act --method activation --data train.txt      # align on activations
  hf-lmc merge ./a ./b --output ./dual --method dual --data train.txt --steps 200   # both learn
  hf-lmc merge ./a ./b --output ./learned --method learned --data sampled   # learn on text the models sample
  hf-lmc merge ./a ./b ./c --output ./abc --weights 0.5 0.25 0.25     # universe matching of 3 models
  hf-lmc merge ./a ./b -o ./merged --eval-data Salesforce/wikitext --eval-data-name wikitext-2-raw-v1
  hf-lmc align ./a ./b --output ./aligned                             # A and aligned B as stock checkpoints, for mergekit
  hf-lmc barrier ./a ./b --eval-data plays.txt --plot path.png        # average vs aligned path
  hf-lmc barrier ./a ./b --eval-data plays.txt --method learned --data train.txt
  hf-lmc barrier ./a ./b ./c --eval-data plays.txt --plot simplex.png # 3+ models: worst point of the simplex
  hf-lmc explain ./a ./b --eval-data plays.txt --plot why.png          # which tensors carry the barrier
  hf-lmc explain ./a ./b --eval-data plays.txt --dry-run              # its cost (passes x tokens), nothing evaluated
  hf-lmc apply ./merged ./b-later-checkpoint -o ./b-moved              # a model moved by the transform a merge saved
  hf-lmc apply ./merged ./b-lora -o ./b-lora-moved --base-model ./b   # B's LoRA adapter, carried into the merge's basin
  hf-lmc check ./my-llama EleutherAI/pythia-14m --compute-dtype float64  # prove the rewrite exact
  hf-lmc check                                                        # the same on tiny built-in models
  hf-lmc inspect ./a ./b                                              # which merge fits: configs, similarity, costs
  hf-lmc symmetries ./my-llama                                        # axes -> symmetry spaces
  hf-lmc run recipes/zoo-offline.yaml                                 # a whole run (or sweep) from a YAML recipe
  hf-lmc run recipes/pythia-scaling-weight.yaml                       # Pythia 14m..410m, seed1 vs seed2
  hf-lmc run recipes/zoo-offline.yaml --set zoo.steps=50 --set output.dir=quick --overwrite
  hf-lmc recipe check recipes/*.yaml                                  # validate recipes and list their runs
  hf-lmc recipe schema > recipe.schema.json                           # for editors (yaml-language-server)
"""


def _examples(command: str) -> str:
    """The lines of :data:`EXAMPLES` that run ``command`` (``"merge"``, ``"recipe check"``)."""
    words = command.split()
    lines = [line for line in EXAMPLES.splitlines()[1:] if line.split("#")[0].split()[1 : len(words) + 1] == words]
    return "examples:\n" + "\n".join(lines) + "\n"


def _add_data_options(
    parser: argparse.ArgumentParser, *, eval_required: bool, grid: bool = True, evaluation: bool = True
) -> None:
    """The data flags every command names alike: the evaluation data (with the alpha grid; not
    with ``evaluation`` false: a command that measures nothing), the fitting data, how both are
    batched, and the learned methods' training options (all but the data paths generated from
    :mod:`hf_lmc.config.options`)."""
    if evaluation:
        measured = parser.add_argument_group(
            "evaluation data" + ("" if eval_required else " (optional: adds the barrier table and plot to the card)")
        )
        REQUEST.add_to(measured, ["eval_data"], eval_data=eval_required)
        EVAL_SOURCE.add_to(measured)
        if grid:
            REQUEST.add_to(measured, ["alphas"])
    fitting = parser.add_argument_group("fitting data (--method activation, learned, dual)")
    REQUEST.add_to(fitting, ["data"])
    FIT_SOURCE.add_to(fitting)
    if evaluation:
        BATCHES.add_to(parser.add_argument_group("batching (both data sets)"))
    else:
        FIT_BATCHES.add_to(parser.add_argument_group("batching"))
    learn = parser.add_argument_group(
        "learned and dual matching",
        "learned (B learns) and dual (A and B learn) matching train the symmetry transforms on the loss along the path, "
        "starting from weight matching; with 3+ models they start from universe matching and train at Dirichlet-sampled "
        "weights (learned: the first model stays); docs/learned-matching.md explains every option",
    )
    LEARN.add_to(learn)
    ACCELERATE.add_to(parser.add_argument_group("training loop (accelerate)"))


def _add_model_options(parser: argparse.ArgumentParser, weights: bool = False, pair: bool = False) -> None:
    """Two or more models (``pair``: exactly two, refused by argparse otherwise), their revisions
    and the method; ``weights``: --alpha / --weights (merge)."""
    if pair:
        parser.add_argument("models", nargs=2, metavar="MODEL", help="two local folders or Hub ids (MODEL_A MODEL_B)")
    else:
        parser.add_argument(
            "models", nargs="+", metavar="MODEL", help="two or more local folders or Hub ids (MODEL_A MODEL_B ...)"
        )
    group = parser.add_argument_group("models")
    PAIR.add_to(group, ["revision_a", "revision_b"])
    REQUEST.add_to(group, ["revisions"])
    method = parser.add_argument_group("method")
    REQUEST.add_to(method, ["method", "symmetries"])
    if weights:
        PAIR.add_to(method, ["alpha"])
        REQUEST.add_to(method, ["weights", "device"])


def _add_messages(parser: argparse.ArgumentParser) -> None:
    """``-q/--quiet`` (progress bars) and ``-v/--verbose`` (messages), one meaning in every
    command; together they give a log without bars."""
    group = parser.add_argument_group("messages")
    group.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="print results and errors only: no progress bars (as TQDM_DISABLE=1 does), notes, warnings or libraries' "
        "messages on stderr; with -v, a log of the stages without bars",
    )
    group.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="say what each stage does (downloads, alignment, training, writing, pushing); -vv adds details and transformers' own messages",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-lmc",
        description="Merge independently trained transformers through linear mode connectivity.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"hf-lmc {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    merge = commands.add_parser(
        "merge",
        help="merge two or more checkpoints into one stock HF checkpoint with a model card",
        description="Align the models (weight matching by default) and write (1-alpha)*A + alpha*aligned(B) "
        "as an ordinary HF folder: sharded safetensors, config, tokenizer files, model card. With three or "
        "more models: sum_k w_k*aligned(model k), every model aligned to one shared reference (universe matching).",
        epilog=_examples("merge"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_options(merge, weights=True)
    out = merge.add_argument_group("output and hub")
    REQUEST.add_to(out, ["output"])
    OUTPUT.add_to(out)
    out.add_argument(
        "--dry-run",
        action="store_true",
        help="check everything the merge checks (models' configs and tensor headers, data, output) and print the plan with "
        "estimates of size on disk, peak memory and time; read no weight, write nothing",
    )
    _add_data_options(merge, eval_required=False)
    _add_messages(merge)
    merge.set_defaults(run="hf_lmc.commands.merge:main")

    aligned = commands.add_parser(
        "align",
        help="write every model of a merge, aligned and not interpolated, as stock checkpoints for other merging tools",
        description="Align the models as `hf-lmc merge` does (weight matching by default) and write each, moved by the\n"
        "symmetry found for it and interpolated with nothing, as a stock HF checkpoint in OUTPUT/<name>/ (the model's\n"
        "folder or Hub name; model-1, model-2, ... where two names are the same): the first model is the reference,\n"
        "rewritten into the canonical form the others are written in, so a linear merge of the folders is hf-lmc's\n"
        "merge. Each folder has a card and the transforms (transforms.safetensors, transforms.json); mergekit and other\n"
        "tools then merge models that share no base (docs/mergekit.md).",
        epilog=_examples("align"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_options(aligned)
    REQUEST.add_to(aligned.add_argument_group("compute"), ["device"])
    out = aligned.add_argument_group("output")
    ALIGNED_OUTPUT.add_to(out, output=True)
    OUTPUT.add_to(out, ["shard_size", "dtype", "overwrite", "tokenizer_from", "inherit_from_a"])
    _add_data_options(aligned, eval_required=False, evaluation=False)
    _add_messages(aligned)
    aligned.set_defaults(run="hf_lmc.commands.align:main")

    bar = commands.add_parser(
        "barrier",
        help="measure the loss barrier along the average's and the aligned linear paths (or over the simplex of 3+ models)",
        description="Evaluate held-out loss along (1-alpha)*A + alpha*B for the plain average and for the "
        "aligned path, and report the barrier: the largest excess over the line between the endpoints. With 3+ "
        "models, the same over a grid of the simplex: the largest L(sum_k w_k theta_k) - sum_k w_k L(theta_k).",
        epilog=_examples("barrier"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_options(bar)
    _add_data_options(bar, eval_required=True)
    report = bar.add_argument_group("report")
    report.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="save the loss-along-path plot, as .png, .pdf or .svg (three models: the simplex triangle)",
    )
    FIGURE_OUTPUT.add_to(report)
    report.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_messages(bar)
    bar.set_defaults(run="hf_lmc.commands.barrier:main")

    why = commands.add_parser(
        "explain",
        help="where the barrier comes from: the midpoint's excess split into parts for the embeddings, per-layer QK, OV, MLP and head",
        description="Move the groups of tensors (embeddings; per layer the attention's QK and OV pairs and the MLP; the head)\n"
        "one at a time from each end of the path to its midpoint, on the average's path and on the path --method aligns, and\n"
        "print each group's part of the midpoint's excess (nats; positive = adds to the barrier). The parts add up to the\n"
        "excess; they are averaged over --orders orders of moving the groups, and their range over the orders is shown.\n"
        "Every move is one pass over the evaluation data, so explain reads its first batches only unless told otherwise,\n"
        "and says how many passes over how many tokens before it starts (--dry-run: that alone).",
        epilog=_examples("explain"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_options(why, pair=True)
    _add_data_options(why, eval_required=True, grid=False)
    report = why.add_argument_group("report")
    EXPLAIN.add_to(report, ["orders", "all_eval_data"])
    report.add_argument(
        "--dry-run",
        action="store_true",
        help="check the models' configs, the data and --plot, and print the cost (passes x tokens) without loading a weight "
        "or evaluating",
    )
    report.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="save a signed bar chart of the parts and total excess, as .png, .pdf or .svg",
    )
    FIGURE_OUTPUT.add_to(report)
    report.add_argument("--json", action="store_true", help="print JSON instead of tables")
    _add_messages(why)
    why.set_defaults(run="hf_lmc.commands.explain:main")

    check = commands.add_parser(
        "check",
        help="prove on your own model that canonical form, symmetries and export are exact",
        description="Canonicalise each model, apply a random symmetry, export to its stock HF class, "
        "save and reload it, and compare logits with the original.",
        epilog=_examples("check"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument(
        "models", nargs="*", metavar="MODEL", help="local folders or Hub ids (default: tiny built-in models)"
    )
    CHECK.add_to(check.add_argument_group("numerics"), ["dtype", "seed"])
    CHECK.add_to(check.add_argument_group("symmetry"), ["symmetries"])
    _add_messages(check)
    add_renamed(check, "check")
    check.set_defaults(run="hf_lmc.commands.check:main")

    demo = commands.add_parser(
        "demo",
        help="offline end-to-end run: merge a GPT-2 pair trained on Shakespeare, print the barrier table",
        description="Take two small GPT-2 models trained on the shipped Shakespeare plays from different seeds\n"
        "(the pair the package ships, or trained here with --train), merge them with weight matching, print\n"
        "the barrier of the average vs aligned interpolation on held-out plays, and write the merged model with\n"
        "its card and plot. Offline; about 20 s on 2 CPU cores with the shipped pair.",
        epilog=_examples("demo"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    DEMO.add_to(demo, ["output", "train"])
    DEMO.add_to(demo.add_argument_group("quick runs"), ["steps", "eval_chars", "cache_dir"])
    DEMO.add_to(demo.add_argument_group("data for the examples"), ["write_plays"])
    _add_messages(demo)
    add_renamed(demo, "demo")
    demo.set_defaults(run="hf_lmc.commands.demo:main")

    survey = commands.add_parser(
        "inspect",
        help="before a merge: which merge fits (configs, weight similarity, symmetry groups, each method's cost)",
        description="Read the models' configs and headers and stream their weights once, a layer at a time (no training,\n"
        "nothing written), and report: each model's architecture, every difference that refuses the merge, whether\n"
        "they look like fine-tunes of one base (a plain average fits) or independent trainings (alignment is needed),\n"
        "the symmetry groups that apply, each method's estimated time and memory, and the command to run.",
        epilog=_examples("inspect"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    survey.add_argument(
        "models", nargs="+", metavar="MODEL", help="two or more local folders or Hub ids (MODEL_A MODEL_B ...)"
    )
    group = survey.add_argument_group("models")
    PAIR.add_to(group, ["revision_a", "revision_b"])
    REQUEST.add_to(group, ["revisions"])
    REQUEST.add_to(survey.add_argument_group("symmetry"), ["symmetries"])
    survey.add_argument_group("report").add_argument(
        "--json", action="store_true", help="print JSON instead of the report"
    )
    _add_messages(survey)
    survey.set_defaults(run="hf_lmc.commands.inspect:main")

    moved = commands.add_parser(
        "apply",
        help="move a model, or a LoRA adapter trained on it, by the transform a merge saved (the same function, in the merge's basin)",
        description="Apply one of the function-preserving transforms an aligned merge saved (transforms.safetensors) to MODEL:\n"
        "a checkpoint of the architecture the transforms were made for (the model it was fitted on, or another checkpoint\n"
        "of the same shape) is written as a stock checkpoint computing the same function in the merge's coordinates; a PEFT\n"
        "LoRA adapter trained on it is written as the LoRA adapter of the moved model, each target at its own rank, which\n"
        "also applies to the merge itself.",
        epilog=_examples("apply"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    moved.add_argument(
        "transforms",
        metavar="TRANSFORMS",
        help="a merge's folder or Hub repo (its transforms.safetensors), or a transforms file",
    )
    moved.add_argument("model", metavar="MODEL", help="a model folder or Hub id, or a PEFT LoRA adapter folder")
    which = moved.add_argument_group("what to move")
    APPLY.add_to(which, ["member", "revision", "base_model", "moved_base"])
    written = moved.add_argument_group("output")
    APPLY.add_to(written, ["output"])
    MOVED_OUTPUT.add_to(written)
    _add_messages(moved)
    add_renamed(moved, "apply")
    moved.set_defaults(run="hf_lmc.commands.apply:main")

    sym = commands.add_parser(
        "symmetries",
        help="print a model's canonical tensors and the symmetry space of each axis",
        epilog=_examples("symmetries"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sym.add_argument("model", metavar="MODEL", help="local folder or Hub id")
    sym.add_argument("--all-layers", action="store_true", help="list every layer, not only layer 0")
    _add_messages(sym)
    sym.set_defaults(run="hf_lmc.commands.symmetries:main")
    _add_recipe_commands(commands)
    return parser


def _add_recipe_commands(commands) -> None:
    """``hf-lmc run RECIPE`` and ``hf-lmc recipe {check,schema}``."""
    raw = argparse.RawDescriptionHelpFormatter
    run = commands.add_parser(
        "run",
        help="run a YAML recipe: merges, barriers and a summary table (one pair or a sweep)",
        description="Validate RECIPE.yaml, then merge every group of models with every method it lists, and write\n"
        "the merged models and summary.md/.json/.csv (barrier per group and method) into its output folder.\n"
        "A run that fails is recorded in the summary with its error and the next one goes on (--fail-fast: the\n"
        "recipe stops at it); the finished merges and the summary are written either way, and the exit code is 1.\n"
        "recipes/README.md describes the keys; `hf-lmc recipe schema` prints them all.",
        epilog=_examples("run"),
        formatter_class=raw,
    )
    recipe = commands.add_parser(
        "recipe", help="check recipes or print the recipe schema", epilog=_examples("recipe"), formatter_class=raw
    )
    actions = recipe.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check",
        help="validate recipes and list the runs each makes",
        epilog=_examples("recipe check"),
        formatter_class=raw,
    )
    schema = actions.add_parser(
        "schema", help="print the JSON schema of recipes", epilog=_examples("recipe schema"), formatter_class=raw
    )
    run.add_argument("recipe", metavar="RECIPE.yaml", help="the recipe file")
    check.add_argument("recipes", nargs="+", metavar="RECIPE.yaml", help="the recipe files, each validated on its own")
    for parser in (run, check):
        changes = parser.add_argument_group("changes to the recipe")
        changes.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a key: dotted path, value read as YAML (e.g. zoo.steps=50, method=[weight,dual], sweep.0.name=tiny); repeatable",
        )
        if parser is run:
            changes.add_argument(
                "--overwrite", action="store_true", help="replace an existing output folder (output.overwrite)"
            )
            from hf_lmc.config.options import RecipeRunOptions

            OptionFlags(RecipeRunOptions, defaults="fields").add_to(changes)  # --fail-fast (output.fail_fast)
    _add_messages(run)
    run.set_defaults(run="hf_lmc.commands.run:main")
    check.set_defaults(run="hf_lmc.commands.recipe:check")
    schema.set_defaults(run="hf_lmc.commands.recipe:schema")


def exit_on_sigterm() -> None:
    """Have SIGTERM end the run as Ctrl-C does, by an exception in the main thread, so that what
    was half-written (staging folders) is removed on the way out; the exit code is 128 + 15."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


class _StderrHandler(logging.StreamHandler):
    """Log records to whatever ``sys.stderr`` is when they are emitted (a handler made once would
    keep writing to the stream of its time)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class _DefaultLossNotice(logging.Filter):
    """Drops transformers' ``loss_type=None ... Using the default loss: ForCausalLMLoss`` warning:
    a class whose name maps to no loss type (``GPT2LMHeadModel``) gets the causal-LM loss, the
    right one for every language model hf_lmc trains or evaluates, so there is nothing to act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("`loss_type=None`")


@contextlib.contextmanager
def _messages(args: argparse.Namespace):
    """How much a command says, for the length of the command: hf_lmc's module loggers print
    warnings (``-v``: what each stage does; ``-vv``: details, and transformers' info messages)
    as ``hf-lmc: ...`` lines on stderr; ``--quiet`` turns every progress bar off, hf_lmc's,
    transformers' and huggingface_hub's, and (without ``-v``) every warning: hf_lmc's,
    transformers' logged ones and Python's (the libraries' deprecation notices), so that
    nothing but errors reaches stderr. transformers' notice that a GPT-2 gets the default loss
    (:class:`_DefaultLossNotice`) shows only under ``-vv``. Everything is put back afterwards, so
    that ``main`` can be called from Python."""
    verbose, quiet = getattr(args, "verbose", 0), getattr(args, "quiet", False)
    log = logging.getLogger("hf_lmc")
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("hf-lmc: %(message)s"))
    environment = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"} if quiet else {}
    silent = quiet and not verbose  # nothing but errors
    if verbose > 1 or silent:
        environment["TRANSFORMERS_VERBOSITY"] = "info" if verbose > 1 else "error"
    saved = log.level, log.propagate, {key: os.environ.get(key) for key in environment}
    log.addHandler(handler)
    notice, loss_notice = logging.getLogger("transformers.modeling_utils"), _DefaultLossNotice()  # where it is logged
    if verbose < 2:
        notice.addFilter(loss_notice)
    log.setLevel(
        logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.ERROR if silent else logging.WARNING
    )
    log.propagate = False
    os.environ.update(environment)  # read when a library is imported or a bar is made
    verbosity = _library_messages(
        quiet=quiet, verbose=verbose > 1, silent=silent
    )  # libraries already imported are told directly
    try:
        with warnings.catch_warnings():  # the filters as they were, afterwards
            if silent:
                warnings.simplefilter("ignore")
            yield
    finally:
        log.removeHandler(handler)
        notice.removeFilter(loss_notice)
        log.setLevel(saved[0])
        log.propagate = saved[1]
        for key, value in saved[2].items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if quiet or verbose > 1:
            _library_messages(quiet=False, verbose=False, verbosity=verbosity)


def _library_messages(*, quiet: bool, verbose: bool, verbosity: int | None = None, silent: bool = False) -> int | None:
    """Turn the progress bars of transformers and huggingface_hub off (``quiet``) or back on,
    and transformers' verbosity to info (``verbose``), to errors only (``silent``) or back to
    ``verbosity``, where they are already imported (a fresh process reads the environment when
    it imports them). Returns
    transformers' verbosity as it was. Bars that ``HF_HUB_DISABLE_PROGRESS_BARS`` turned off
    when huggingface_hub was imported stay off."""
    locked = False
    if "huggingface_hub" in sys.modules:
        from huggingface_hub import constants
        from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

        locked = constants.HF_HUB_DISABLE_PROGRESS_BARS is True
        if quiet:
            disable_progress_bars()
        elif not locked:
            enable_progress_bars()
    if "transformers" not in sys.modules:
        return None
    from transformers.utils import logging as hf_logging

    if quiet:
        hf_logging.disable_progress_bar()
    elif not locked:
        hf_logging.enable_progress_bar()
    before = hf_logging.get_verbosity()
    if verbose:
        hf_logging.set_verbosity_info()
    elif silent:
        hf_logging.set_verbosity_error()
    elif verbosity is not None:
        hf_logging.set_verbosity(verbosity)
    return before


def _process_group_initialised() -> bool:
    """Whether torch.distributed has a process group, read without importing torch (a command
    that never imported it has none)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _owned_process_group():
    """Destroy, on the way out, a process group the command set up (a launched run's, made by
    ``devices.launched_processes`` or by the matcher); one that existed before is the caller's
    and is left alone.

    Why: torch's gloo workers drop each finished collective's tensors on their own threads.
    Left to interpreter shutdown, a worker still doing so takes the GIL from a finalising
    interpreter and the process aborts (SIGABRT) after its work is done, its exit status lost.
    Destroying the group once nothing of the run holds it (hence the collection first) joins
    the workers while the interpreter is whole. The teardown never replaces the command's own
    outcome.
    """
    had_group = _process_group_initialised()
    try:
        yield
    finally:
        if not had_group and _process_group_initialised():
            import gc

            import torch.distributed as dist

            gc.collect()  # a finished run's modules, its meshes among them, hold the groups in cycles
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _handler(name: str):
    """The handler a command's parser names (``"hf_lmc.commands.merge:main"``), imported only when the
    command runs: the modules behind most commands load torch, which building the parser must not."""
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    allocator.return_freed_memory_promptly()  # docs/decisions.md#d-mmap-threshold
    if threading.current_thread() is threading.main_thread():
        exit_on_sigterm()
    with _owned_process_group():  # outermost: a failed run's traceback no longer holds the run
        try:
            with _messages(args):
                return _handler(args.run)(args)
        except (ValueError, OSError) as err:
            return report(err)
        except KeyboardInterrupt:  # what was half-written was removed on the way out (staging folders)
            print("hf-lmc: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
