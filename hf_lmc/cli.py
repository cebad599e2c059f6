"""``hf-lmc``: the command-line interface.

The flags of every option come from the option models (:mod:`hf_lmc.options`, through
:class:`~hf_lmc.flags.OptionFlags`) and the method choices from the registry (:mod:`hf_lmc.methods`); library
errors that name a parameter are shown with its flag.

Each command imports the modules it runs inside its own function, on purpose: they load torch
and transformers, which building the parser must not (``hf-lmc --help`` stays fast;
``tests/test_layers.py`` checks ``sys.modules``). Those are the only imports of the package's own
modules inside functions. Before them each command runs every check that needs no model (the
flags, :mod:`hf_lmc.preflight`), so a request that cannot run is refused at once
(``tests/test_cli.py`` checks ``sys.modules`` at the refusal).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from . import __version__
from .flags import OptionFlags, flag_for
from .grids import alpha_grid
from .methods import METHODS, NAMES, check_method
from .options import (
    DEFAULT_ALPHA,
    EVAL_OPTIONS,
    FIT_OPTIONS,
    PATH_POINTS,
    SIMPLEX_POINTS,
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
    check_orders,
    escape_controls,
    flag_of,
)
from .preflight import check_request, merge_request, pair_weights

#: Every example, one command line each: ``hf-lmc --help`` shows them all, and each command's
#: ``--help`` the lines of that command (:func:`_examples`).
EXAMPLES = """\
examples:
  hf-lmc demo                                                         # train a pair, merge, barrier table
  hf-lmc merge org/model-a org/model-b --output ./merged              # weight matching, alpha 0.5
  hf-lmc merge ./a ./b --output ./merged --dry-run                    # check everything, estimate size and time, write nothing
  hf-lmc merge ./a ./b --output ./merged --eval-data plays.txt --push-to-hub user/merged
  hf-lmc merge ./a ./b --output ./avg --method average                # vanilla baseline
  hf-lmc merge ./a ./b --output ./act --method activation --data train.txt      # align on activations
  hf-lmc merge ./a ./b --output ./dual --method dual --data train.txt --steps 200   # both learn
  hf-lmc merge ./a ./b --output ./learned --method learned --data sampled   # learn on text the models sample
  hf-lmc merge ./a ./b ./c --output ./abc --weights 0.5 0.25 0.25     # universe matching of 3 models
  hf-lmc merge ./a ./b -o ./merged --eval-data Salesforce/wikitext --eval-data-name wikitext-2-raw-v1
  hf-lmc barrier ./a ./b --eval-data plays.txt --plot path.png        # vanilla vs aligned path
  hf-lmc barrier ./a ./b --eval-data test.txt --method learned --data train.txt
  hf-lmc barrier ./a ./b ./c --eval-data plays.txt --plot simplex.png # 3+ models: worst point of the simplex
  hf-lmc explain ./a ./b --eval-data plays.txt --plot why.png          # which tensors carry the barrier
  hf-lmc apply ./merged ./b-later-checkpoint -o ./b-moved              # a model moved by the transform a merge saved
  hf-lmc apply ./merged ./b-lora -o ./b-lora-moved --base-model ./b   # B's LoRA adapter, carried into the merge's basin
  hf-lmc check ./my-llama EleutherAI/pythia-14m --dtype float64       # prove the rewrite exact
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


TOLERANCE = {"float32": 1e-4, "float64": 1e-9}

#: Exit codes, as argparse, ``hf`` and mergekit use them: 2 when the command as written cannot
#: run (argparse's own usage errors, a bad or conflicting value, an output that exists or covers
#: an input), 1 when a run fails on what it reads or writes (models, data, disk, network).
EXIT_USAGE, EXIT_FAILED = 2, 1
EXIT_INTERRUPTED = 128 + signal.SIGINT  # as a shell reports a process that Ctrl-C ended


LEARN = OptionFlags(LearnOptions)
ACCELERATE = OptionFlags(AccelerateOptions)
#: One set of batching flags for both data sets; where a flag is absent each keeps its own default.
BATCHES = OptionFlags(
    EvalOptions,
    only=("batch_size", "seq_len", "max_batches"),
    defaults={"--data": FIT_OPTIONS, "--eval-data": EVAL_OPTIONS},
)
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
DEMO = OptionFlags(DemoOptions, defaults="fields")
CHECK = OptionFlags(CheckOptions, defaults="fields")
EXPLAIN = OptionFlags(ExplainOptions, defaults="fields")
APPLY = OptionFlags(ApplyOptions, defaults="fields")
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


def cmd_check(args: argparse.Namespace) -> int:
    import torch

    from .adapters import adapter_for
    from .verify import check_exactness, tiny_configs

    dtype = getattr(torch, args.dtype)
    if args.models:
        from .loading import load_model

        models = [(name, load_model(name).model.to(dtype)) for name in args.models]
    else:
        torch.manual_seed(args.seed)
        models = [(f"tiny-{arch}", adapter_for(cfg).model_class(cfg).to(dtype)) for arch, cfg in tiny_configs().items()]
    tolerance = TOLERANCE[args.dtype]
    print(f"relative logit error vs the original model ({args.dtype}, tolerance {tolerance:g})")
    print(f"{'model':<32} {'type':<9} {'params':>10} {'canonical':>10} {'symmetry':>10} {'reloaded':>10}")
    failed = False
    for name, model in models:
        report = check_exactness(model, seed=args.seed, symmetries=args.symmetries)
        ok = report.worst < tolerance
        failed |= not ok
        print(
            f"{name:<32} {report.model_type:<9} {report.parameters:>10,} {report.canonical:>10.1e} "
            f"{report.symmetry:>10.1e} {report.reloaded:>10.1e}  {'ok' if ok else 'FAILED'}"
        )
    return 1 if failed else 0


def _eval_options(args: argparse.Namespace):
    return EVAL_SOURCE.build(args, **BATCHES.given(args))


def _fit_options(args: argparse.Namespace):
    return FIT_SOURCE.build(args, **BATCHES.given(args))


def cmd_merge(args: argparse.Namespace) -> int:
    request = merge_request(args.models, args.output, **_merge_settings(args))
    check_request(request)  # every refusal that needs no model, before torch and transformers load
    # the command as the card shows it imports huggingface_hub: after the checks
    request = request.model_copy(update={"made_with": _command_markdown(args)})
    if args.dry_run:
        from .pipeline import plan

        print(plan(request).table())
        return 0
    from .pipeline import run

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
    """The :class:`~hf_lmc.options.MergeRequest` fields of ``hf-lmc merge``'s flags but the models
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
        "revisions": _revisions(args, count),
        "method": args.method,
        "symmetries": args.symmetries,
        "device": args.device,
        "data": args.data,
        "data_options": _fit_options(args),
        "learn": LEARN.build(args),
        "accelerate": ACCELERATE.build(args),
        "eval_data": args.eval_data,
        "eval_options": _eval_options(args),
        "alphas": args.alphas,
        **OUTPUT.build(args).model_dump(),
    }


def _command_markdown(args: argparse.Namespace) -> str:
    """The command line as typed, for the model card (``hf-lmc`` however it was started), with
    each local path reduced to its final component (models, data, output: the card is shared,
    the machine's folders are not); flags and Hub ids stay as typed."""
    from .hub import command_markdown

    return command_markdown(["hf-lmc", *args.argv])


def cmd_barrier(args: argparse.Namespace) -> int:
    models = args.models
    if len(models) < 2:
        raise UsageError(f"barrier needs at least 2 models, got {len(models)}")
    if args.plot and len(models) > 3:
        raise UsageError(f"--plot draws the simplex of three models, got {len(models)}; drop --plot or pass three")
    _check_figure(args, [*models, args.eval_data, args.data])
    revisions = _revisions(args, len(models))
    check_method(args.method, args.data, len(models), data_parameter="fit_data")
    if args.alphas is not None:
        alpha_grid(args.alphas)
    methods = ("average",) if args.method == "average" else ("average", args.method)
    common = {
        "methods": methods,
        "symmetries": args.symmetries,
        "eval_options": _eval_options(args),
        "fit_data": args.data,
        "fit_options": _fit_options(args),
        "learn": LEARN.build(args),
        "accelerate": ACCELERATE.build(args),
    }
    from .barriers import barrier, barrier_over_simplex, plot, plot_simplex

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
    _say(result.to_json() if args.json else result.table())  # what was measured, before a file can fail
    if args.plot:
        draw(result, args.plot, overwrite=args.overwrite)
    return 0


def _check_figure(args: argparse.Namespace, read) -> None:
    """The ``--plot`` file checked before any work (:func:`hf_lmc.outputs.check_figure_path`)."""
    if args.plot:
        from .outputs import check_figure_path

        check_figure_path(args.plot, [r for r in read if isinstance(r, str)], "plot", overwrite=args.overwrite)


def _say(text: str) -> None:
    """Print a command's report with every control character but newlines and tabs escaped: it
    carries names read from files and folders (labels, models), which must not drive the terminal."""
    print(escape_controls(text, keep="\n\t"))


def cmd_explain(args: argparse.Namespace) -> int:
    check_orders(args.orders)
    _check_figure(args, [*args.models, args.eval_data, args.data])
    revisions = _revisions(args, 2)
    check_method(args.method, args.data, 2, data_parameter="fit_data")
    from .explain import explain, kinds_table, plot_explanation
    from .loading import load_model

    a, b = (load_model(m, r).model for m, r in zip(args.models, revisions))
    result = explain(
        a,
        b,
        args.eval_data,
        method=args.method,
        symmetries=args.symmetries,
        eval_options=_eval_options(args),
        fit_data=args.data,
        fit_options=_fit_options(args),
        learn=LEARN.build(args),
        orders=args.orders,
    )
    _say(result.to_json() if args.json else f"{result.table()}\n\nparts summed per kind:\n\n{kinds_table(result)}")
    if args.plot:
        title = f"{Path(args.models[0]).name} ↔ {Path(args.models[1]).name}"
        plot_explanation(result, args.plot, title=escape_controls(title, 120), overwrite=args.overwrite)
    return 0


def _revisions(args: argparse.Namespace, count: int) -> list[str | None]:
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


def _small_blocks_from_the_heap() -> None:
    """Have glibc serve blocks below 32 MiB from its heap again (the bounds its own adaptive
    threshold grows to), undoing :func:`_return_freed_memory_promptly` for the demo: its tiny
    models allocate thousands of temporaries of a few MiB, and served by ``mmap`` each one is
    fresh pages the kernel must fault in and zero, which took longer than the arithmetic. A
    no-op where glibc is not the allocator."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 64 << 20)  # M_TRIM_THRESHOLD: twice it, as the adaptive threshold keeps it
    except (OSError, AttributeError):
        pass


def cmd_demo(args: argparse.Namespace) -> int:
    from .outputs import check_output_path, check_replaceable
    from .progress import silenced

    check_output_path(args.output, "output")  # refused before torch loads; run_demo checks again
    check_replaceable(args.output, "output", kinds=("demo",))  # as run_demo: its own earlier output only
    if not silenced():  # what the next seconds (or minutes) are spent on, before the imports take the first of them
        print(f"hf-lmc demo: {_demo_plan(args)}", file=sys.stderr)
    _small_blocks_from_the_heap()
    from .demo import run_demo

    cache = None if args.cache_dir is None else Path(args.cache_dir)
    result = run_demo(args.output, steps=args.steps, eval_chars=args.eval_chars, cache=cache, train=args.train)
    a, b = result.train_loss
    origin = "shipped with hf_lmc; --train trains it here" if result.shipped else "trained here"
    print(f"GPT-2 pair trained from seeds 0 and 1 ({origin}; final training loss {a:.3f} / {b:.3f} nats per character)")
    print(f"  {result.model_a}\n  {result.model_b}")
    print(f"\nheld-out loss along the path (two unseen plays):\n\n{result.merge.barrier.table()}\n")
    print(f"merged model, card and plot written to {result.merge.output} ({result.seconds:.0f} s)")
    return 0


#: Rough seconds one training step of the demo's GPT-2 takes on one CPU core, and the demo's
#: merge and loss along the path with the imports (benchmarks/demo_time.py measures both).
_DEMO_STEP_SECONDS, _DEMO_MERGE_SECONDS = 0.25, 20


def _demo_plan(args: argparse.Namespace) -> str:
    """One line on what ``hf-lmc demo`` is about to do and roughly how long it takes."""
    merging = f"with weight matching and measuring the loss along the path (about {_DEMO_MERGE_SECONDS} s in all)"
    if not args.train and args.steps is None:
        return f"merging the GPT-2 pair shipped with hf_lmc {merging}"
    steps = 600 if args.steps is None else args.steps  # the zoo's gpt2 entry (hf_lmc.zoo is not imported yet)
    minutes = max(1, round(steps * _DEMO_STEP_SECONDS / 60))
    return f"training two GPT-2 models of {steps} steps unless cached (about {minutes} min each; a bar shows each), then merging them {merging}"


def _add_data_options(parser: argparse.ArgumentParser, *, eval_required: bool, grid: bool = True) -> None:
    """The data flags every command names alike: the evaluation data (with the alpha grid), the
    fitting data, how both are batched, and the learned methods' training options (all but the
    data paths generated from :mod:`hf_lmc.options`)."""
    evaluation = parser.add_argument_group(
        "evaluation data" + ("" if eval_required else " (optional: adds the barrier table and plot to the card)")
    )
    REQUEST.add_to(evaluation, ["eval_data"], eval_data=eval_required)
    EVAL_SOURCE.add_to(evaluation)
    if grid:
        REQUEST.add_to(evaluation, ["alphas"])
    fitting = parser.add_argument_group("fitting data (--method activation, learned, dual)")
    REQUEST.add_to(fitting, ["data"])
    FIT_SOURCE.add_to(fitting)
    BATCHES.add_to(parser.add_argument_group("batching (both data sets)"))
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
        help="no progress bars (as TQDM_DISABLE=1 does); results, warnings and errors still print",
    )
    group.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="say what each stage does (downloads, alignment, training, writing, pushing); -vv adds details and transformers' own messages",
    )


def cmd_inspect(args: argparse.Namespace) -> int:
    count = len(args.models)
    if count < 2:
        raise UsageError(f"inspect needs at least 2 models, got {count}")
    revisions = _revisions(args, count)
    from .survey import inspect_models

    report = inspect_models(args.models, revisions=revisions, symmetries=args.symmetries)
    print(report.to_json() if args.json else report.table())
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    options = APPLY.build(args)
    from .moving import apply_transforms

    applied = apply_transforms(
        args.transforms,
        args.model,
        options.output,
        member=options.member,
        base_model=options.base_model,
        adapter_for_base=options.moved_base,
        revision=options.revision,
        dtype=args.dtype,
        shard_size=args.shard_size,
        overwrite=args.overwrite,
    )
    moved = "LoRA adapter" if applied.kind == "adapter" else "model"
    _say(f"{moved} moved by the transform of {applied.label} written to {applied.output}")
    return 0


def cmd_symmetries(args: argparse.Namespace) -> int:
    from .adapters import adapter_for, read_config
    from .hub import resolve_checkpoint
    from .symmetry import axes_of

    config = read_config(resolve_checkpoint(args.model))
    spec = adapter_for(config).spec(config)
    print(spec)
    names = (
        spec.names()
        if args.all_layers
        else [n for n in spec.names() if not n.startswith("layers.") or n.startswith("layers.0.")]
    )
    for name in names:
        axes = ", ".join("-" if a is None else f"{a[0]}:{a[1]}" for a in axes_of(name))
        print(f"  {name:<28} ({axes})")
    return 0


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
    merge.set_defaults(run=cmd_merge)

    bar = commands.add_parser(
        "barrier",
        help="measure the loss barrier along the vanilla and aligned linear paths (or over the simplex of 3+ models)",
        description="Evaluate held-out loss along (1-alpha)*A + alpha*B for vanilla averaging and for the "
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
    bar.set_defaults(run=cmd_barrier)

    why = commands.add_parser(
        "explain",
        help="where the barrier comes from: the midpoint's excess split into parts for the embeddings, per-layer QK, OV, MLP and head",
        description="Move the groups of tensors (embeddings; per layer the attention's QK and OV pairs and the MLP; the head)\n"
        "one at a time from each end of the path to its midpoint, on the vanilla path and on the path --method aligns, and\n"
        "print each group's part of the midpoint's excess (nats; positive = adds to the barrier). The parts add up to the\n"
        "excess; they are averaged over --orders orders of moving the groups, and their range over the orders is shown.",
        epilog=_examples("explain"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_options(why, pair=True)
    _add_data_options(why, eval_required=True, grid=False)
    report = why.add_argument_group("report")
    EXPLAIN.add_to(report, ["orders"])
    report.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="save a signed bar chart of the parts and total excess, as .png, .pdf or .svg",
    )
    FIGURE_OUTPUT.add_to(report)
    report.add_argument("--json", action="store_true", help="print JSON instead of tables")
    _add_messages(why)
    why.set_defaults(run=cmd_explain)

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
    check.set_defaults(run=cmd_check)

    demo = commands.add_parser(
        "demo",
        help="offline end-to-end run: merge a GPT-2 pair trained on Shakespeare, print the barrier table",
        description="Take two small GPT-2 models trained on the shipped Shakespeare plays from different seeds\n"
        "(the pair the package ships, or trained here with --train), merge them with weight matching, print\n"
        "the barrier of vanilla vs aligned interpolation on held-out plays, and write the merged model with\n"
        "its card and plot. Offline; about 20 s on 2 CPU cores with the shipped pair.",
        epilog=_examples("demo"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    DEMO.add_to(demo, ["output", "train"])
    DEMO.add_to(demo.add_argument_group("quick runs"), ["steps", "eval_chars", "cache_dir"])
    _add_messages(demo)
    demo.set_defaults(run=cmd_demo)

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
    survey.set_defaults(run=cmd_inspect)

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
    moved.set_defaults(run=cmd_apply)

    sym = commands.add_parser(
        "symmetries",
        help="print a model's canonical tensors and the symmetry space of each axis",
        epilog=_examples("symmetries"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sym.add_argument("model", metavar="MODEL", help="local folder or Hub id")
    sym.add_argument("--all-layers", action="store_true", help="list every layer, not only layer 0")
    _add_messages(sym)
    sym.set_defaults(run=cmd_symmetries)
    _add_recipe_commands(commands)
    return parser


def _overrides(args: argparse.Namespace) -> dict:
    from .recipe import parse_override

    overrides = dict(parse_override(text) for text in args.set)
    if getattr(args, "overwrite", False):
        overrides["output.overwrite"] = True
    return overrides


def cmd_run(args: argparse.Namespace) -> int:
    """Run a recipe and print its barrier table. A run that fails is recorded in the summary and
    the others go on (``--fail-fast``: the recipe stops at it); the merges that finished and the
    summary are written either way, each failure is one error line, and the exit code is then
    :data:`EXIT_FAILED`."""
    from .options import RecipeRunOptions
    from .recipe import check_outputs, load_recipe

    switched = OptionFlags(RecipeRunOptions, defaults="fields").given(args)  # --fail-fast: output.fail_fast
    overrides = _overrides(args) | {f"output.{name}": True for name, on in switched.items() if on}
    check_outputs(load_recipe(args.recipe, overrides), args.recipe)  # the recipe and its folders, before torch loads

    from .runner import SKIPPED, SUMMARY, RecipeFailedError, run_recipe

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


def cmd_recipe_check(args: argparse.Namespace) -> int:
    """Validate each recipe on its own, run every check that needs no weight (the recipe, the
    folders it writes against those it reads, each group's configs compared as the merge compares
    them) and list its runs; every invalid one is reported (as one error line) and the exit code is
    the worst of them. A check left out (a config not at hand here) is listed as a note."""
    from .recipe import check_outputs, load_recipe
    from .runner import check_models

    overrides, worst = _overrides(args), 0
    for path in args.recipes:
        try:
            recipe = load_recipe(path, overrides)
            check_outputs(recipe, path, tidy=False)  # the folders it writes against those it reads, changing nothing
            left_out = check_models(recipe, path)  # config.json alone: no weight is read or downloaded
            runs = recipe.runs()
        except (ValueError, OSError) as err:
            worst = max(worst, _report(err))
            continue
        print(f"{escape_controls(path)}: valid; {len(runs)} run(s) into {escape_controls(recipe.output.dir)}")
        for note in left_out:
            print(f"  note: {escape_controls(note)}")
        if recipe.output.fail_fast:
            print("  stops at its first failed run (output.fail_fast)")
        launch = recipe.launch.command(str(path))
        if launch:
            print(f"  runs as {recipe.launch.processes} processes: {launch}")
        push = recipe.output.push_to_hub
        for group, method, models in runs:
            target = f" -> {push.format(group=group, method=method)}" if push else ""
            print(f"  {recipe.run_folder(group, method)}: {method} of {', '.join(m.label for m in models)}{target}")
    return worst


def cmd_recipe_schema(args: argparse.Namespace) -> int:
    import json

    from .recipe import Recipe

    print(json.dumps(Recipe.model_json_schema(), indent=2))
    return 0


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
            from .options import RecipeRunOptions

            OptionFlags(RecipeRunOptions, defaults="fields").add_to(changes)  # --fail-fast (output.fail_fast)
    _add_messages(run)
    run.set_defaults(run=cmd_run)
    check.set_defaults(run=cmd_recipe_check)
    schema.set_defaults(run=cmd_recipe_schema)


def _return_freed_memory_promptly() -> None:
    """Have glibc serve large blocks with ``mmap`` at a fixed threshold, so freed tensors go back
    to the OS at once. By default the threshold grows with each freed block (up to 32 MB), and the
    layer-sized temporaries of a streamed merge then pile up in malloc arenas, raising the peak
    memory (docs/decisions.md#d-mmap-threshold). A no-op where glibc is not the allocator."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB
    except (OSError, AttributeError):
        pass


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
    transformers' and huggingface_hub's. transformers' notice that a GPT-2 gets the default loss
    (:class:`_DefaultLossNotice`) shows only under ``-vv``. Everything is put back afterwards, so
    that ``main`` can be called from Python."""
    verbose, quiet = getattr(args, "verbose", 0), getattr(args, "quiet", False)
    log = logging.getLogger("hf_lmc")
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("hf-lmc: %(message)s"))
    environment = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"} if quiet else {}
    if verbose > 1:
        environment["TRANSFORMERS_VERBOSITY"] = "info"
    saved = log.level, log.propagate, {key: os.environ.get(key) for key in environment}
    log.addHandler(handler)
    notice, loss_notice = logging.getLogger("transformers.modeling_utils"), _DefaultLossNotice()  # where it is logged
    if verbose < 2:
        notice.addFilter(loss_notice)
    log.setLevel(logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING)
    log.propagate = False
    os.environ.update(environment)  # read when a library is imported or a bar is made
    verbosity = _library_messages(quiet=quiet, verbose=verbose > 1)  # libraries already imported are told directly
    try:
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


def _library_messages(*, quiet: bool, verbose: bool, verbosity: int | None = None) -> int | None:
    """Turn the progress bars of transformers and huggingface_hub off (``quiet``) or back on,
    and transformers' verbosity to info (``verbose``) or back to ``verbosity``, where they are
    already imported (a fresh process reads the environment when it imports them). Returns
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
    elif verbosity is not None:
        hf_logging.set_verbosity(verbosity)
    return before


def _report(err: ValueError | OSError) -> int:
    """Print ``err`` as one ``hf-lmc: error:`` line, a parameter the library names shown as its
    flag, and return its exit code: :data:`EXIT_USAGE` for a usage error, else :data:`EXIT_FAILED`."""
    if isinstance(err, (UsageError, OutputExistsError)):
        named = err.named(flag_for(err.parameter)) if isinstance(err, (ParameterError, OutputExistsError)) else err
        print(f"hf-lmc: error: {escape_controls(named)}", file=sys.stderr)
        return EXIT_USAGE
    print(f"hf-lmc: error: {escape_controls(err)}", file=sys.stderr)  # one line, whatever a file's text held
    return EXIT_FAILED


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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    _return_freed_memory_promptly()
    if threading.current_thread() is threading.main_thread():
        exit_on_sigterm()
    with _owned_process_group():  # outermost: a failed run's traceback no longer holds the run
        try:
            with _messages(args):
                return args.run(args)
        except (ValueError, OSError) as err:
            return _report(err)
        except KeyboardInterrupt:  # what was half-written was removed on the way out (staging folders)
            print("hf-lmc: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
