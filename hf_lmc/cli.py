"""``hf-lmc``: the command-line interface."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

EXAMPLES = """\
examples:
  hf-lmc demo                                                         # train a pair, merge, barrier table
  hf-lmc merge org/model-a org/model-b --output ./merged              # weight matching, alpha 0.5
  hf-lmc merge ./a ./b --output ./merged --eval-data plays.txt --push-to-hub user/merged
  hf-lmc merge ./a ./b --output ./avg --method average                # vanilla baseline
  hf-lmc merge ./a ./b --output ./act --method activation --data train.txt      # align on activations
  hf-lmc merge ./a ./b --output ./dual --method dual --data train.txt --steps 200   # both learn
  hf-lmc merge ./a ./b ./c --output ./abc --weights 0.5 0.25 0.25     # universe matching of 3 models
  hf-lmc barrier ./a ./b --data plays.txt --plot path.png             # vanilla vs aligned path
  hf-lmc barrier ./a ./b --data test.txt --method learned --fit-data train.txt
  hf-lmc barrier ./a ./b ./c --data plays.txt --plot simplex.png      # 3+ models: worst point of the simplex
  hf-lmc check ./my-llama EleutherAI/pythia-14m --dtype float64       # prove the rewrite exact
  hf-lmc symmetries ./my-llama                                        # axes -> symmetry spaces
  hf-lmc run recipes/zoo-offline.yaml                                 # a whole run (or sweep) from a YAML recipe
  hf-lmc recipe schema                                                # the recipe JSON schema
"""

RECIPE_EXAMPLES = """\
examples:
  hf-lmc run recipes/zoo-offline.yaml                                 # offline: zoo pairs, weight + activation
  hf-lmc run recipes/pythia-scaling-weight.yaml                       # Pythia 14m..410m, seed1 vs seed2
  hf-lmc run recipes/zoo-offline.yaml --set zoo.steps=50 --set output.dir=quick --overwrite
  hf-lmc recipe check recipes/pythia-scaling-dual.yaml                # validate and list the runs
  hf-lmc recipe schema > recipe.schema.json                           # for editors (yaml-language-server)
"""

TOLERANCE = {"float32": 1e-4, "float64": 1e-9}
METHODS = ("average", "weight", "activation", "learned", "dual")  # hf_lmc.alignment.METHODS, without importing torch
SCHEDULES = ("constant", "cosine", "linear")  # transformers scheduler names offered on the command line
PERMUTATIONS = ("fixed", "ste", "sinkhorn")  # hf_lmc.matching.trainable.PERMUTATIONS, without importing torch
FRAMES = ("own", "target", "both")  # hf_lmc.symmetry.params.FRAMES, without importing torch
OBJECTIVES = ("labels", "ensemble")  # hf_lmc.matching.learned.OBJECTIVES, without importing torch
FOCI = ("worst", "excess")  # hf_lmc.matching.learned.FOCI, without importing torch


def cmd_check(args: argparse.Namespace) -> int:
    import torch

    from .verify import check_exactness, tiny_configs
    from .adapters import adapter_for

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


def _eval_options(args: argparse.Namespace, split: str | None = None):
    from .evaluation import EvalOptions

    return EvalOptions(batch_size=args.batch_size, seq_len=args.seq_len, max_batches=args.max_batches, split=split or args.split)


def _learn_options(args: argparse.Namespace):
    from .alignment import LearnOptions

    return LearnOptions(
        steps=args.steps, lr=args.lr, residual_lr=args.residual_lr, schedule=args.schedule, warmup=args.warmup, permutations=args.permutations,
        orthogonal=args.orthogonal, frame=args.frame, concentration=args.concentration, objective=args.objective, worst_fraction=args.worst_fraction,
        focus=args.focus, input_noise=args.input_noise, seed=args.seed,
    )


def cmd_merge(args: argparse.Namespace) -> int:
    from .pipeline import merge, merge_models

    models = args.models
    if len(models) < 2:
        raise ValueError(f"merge needs at least 2 models, got {len(models)}")
    if args.alpha is not None and args.weights is not None:
        raise ValueError("pass either --alpha (two models) or --weights (one per model), not both")
    if args.alpha is not None and len(models) != 2:
        raise ValueError(f"--alpha is the weight of MODEL_B when merging two models; for {len(models)} pass --weights w1 ... w{len(models)}")
    revisions = _revisions(args, len(models))
    options = dict(
        method=args.method, symmetries=args.symmetries,
        data=args.data, data_options=_eval_options(args, args.data_split), learn=_learn_options(args),
        dtype=args.dtype, shard_size=args.shard_size, eval_data=args.eval_data, eval_options=_eval_options(args),
        alphas=args.alphas, push_to_hub=args.push_to_hub, private=args.private, overwrite=args.overwrite, device=args.device,
    )
    if args.weights is None and len(models) == 2:
        alpha = 0.5 if args.alpha is None else args.alpha
        result = merge(*models, args.output, alpha=alpha, revision_a=revisions[0], revision_b=revisions[1], **options)
    else:
        result = merge_models(models, args.output, weights=args.weights, revisions=revisions, **options)
    if result.barrier is not None:
        print(result.barrier.table())
    print(f"merged model written to {result.output}")
    if result.url:
        print(f"pushed to {result.url}")
    return 0


def cmd_barrier(args: argparse.Namespace) -> int:
    from .barriers import barrier, barrier_over_simplex, plot, plot_simplex

    models = args.models
    if len(models) < 2:
        raise ValueError(f"barrier needs at least 2 models, got {len(models)}")
    revisions = _revisions(args, len(models))
    methods = ("average",) if args.method == "average" else ("average", args.method)
    common = dict(
        methods=methods, symmetries=args.symmetries, eval_options=_eval_options(args), fit_data=args.fit_data,
        fit_options=_eval_options(args, args.data_split), learn=_learn_options(args),
    )
    if len(models) == 2:
        result = barrier(*models, args.data, alphas=args.alphas or 11, revision_a=revisions[0], revision_b=revisions[1], **common)
        if args.plot:
            plot(result, args.plot)
    else:
        if args.plot and len(models) != 3:
            raise ValueError(f"--plot draws the simplex of three models, got {len(models)}; drop --plot or pass three")
        result = barrier_over_simplex(models, args.data, points=args.alphas or 5, revisions=revisions, **common)
        if args.plot:
            plot_simplex(result, args.plot)
    print(result.to_json() if args.json else result.table())
    return 0


def _revisions(args: argparse.Namespace, count: int) -> list[str | None]:
    """One revision per model from ``--revisions`` or ``--revision-a/--revision-b``."""
    if args.revisions is not None and (args.revision_a or args.revision_b):
        raise ValueError("pass either --revisions or --revision-a/--revision-b, not both")
    if args.revisions is None:
        return [args.revision_a, args.revision_b] + [None] * (count - 2)
    if len(args.revisions) != count:
        raise ValueError(f"--revisions takes one entry per model ('-' for the default branch): got {len(args.revisions)} for {count} models")
    return [None if r == "-" else r for r in args.revisions]


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    result = run_demo(args.output, steps=args.steps, eval_chars=args.eval_chars, cache=args.cache_dir)
    a, b = result.train_loss
    print(f"GPT-2 pair trained from seeds 0 and 1 (final training loss {a:.3f} / {b:.3f} nats per character)")
    print(f"  {result.model_a}\n  {result.model_b}")
    print(f"\nheld-out loss along the path (two unseen plays):\n\n{result.merge.barrier.table()}\n")
    print(f"merged model, card and plot written to {result.merge.output} ({result.seconds:.0f} s)")
    return 0


def _add_eval_options(parser: argparse.ArgumentParser, title: str) -> None:
    group = parser.add_argument_group(title)
    group.add_argument("--alphas", type=int, default=None, metavar="N", help="points on the alpha grid; for 3+ models per edge of the simplex grid (default: 11; 5)")
    group.add_argument("--batch-size", type=int, default=8, metavar="N", help="batch size of every data set (default: 8)")
    group.add_argument("--seq-len", type=int, default=None, metavar="N", help="tokens per block (default: min(128, context))")
    group.add_argument("--max-batches", type=int, default=None, metavar="N", help="use at most N batches of each data set")
    group.add_argument("--split", default="test", help="split of a datasets id for evaluation (default: test)")
    group.add_argument("--data-split", default="train", metavar="SPLIT", help="split of a datasets id for fitting (default: train)")


def _number(low: float, high: float | None = None) -> Callable[[str], float]:
    """An argparse type: a number in ``[low, high]`` (``[low, inf)`` without ``high``; NaN refused)."""
    if high is None:
        wanted, verdict = f">= {low:g}", f"must be >= {low:g}"
    else:
        wanted = f"in [{low:g}, {high:g}]"
        verdict = f"must lie {wanted}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number {wanted}, got {text!r}") from None
        if not (low <= value and (high is None or value <= high)):
            raise argparse.ArgumentTypeError(f"{verdict}, got {value}")
        return value

    return parse


_fraction = _number(0.0, 1.0)
_non_negative = _number(0.0)


def _add_learn_options(parser: argparse.ArgumentParser, data_flag: str) -> None:
    group = parser.add_argument_group(
        "data-driven alignment (--method activation, learned, dual)",
        "activation matching reads calibration batches; learned (B learns) and dual (A and B learn) matching "
        "train the symmetry transforms on the loss along the path, starting from weight matching; with 3+ models "
        "they start from universe matching and train at Dirichlet-sampled weights (learned: the first model stays)",
    )
    group.add_argument(data_flag, default=None, metavar="DATA", help="calibration / training data: text file or folder, datasets id or path, .pt tensors for ViT")
    group.add_argument("--steps", type=int, default=200, metavar="N", help="training steps of learned and dual matching (default: 200)")
    group.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate of learned and dual matching (default: 3e-3)")
    group.add_argument(
        "--residual-lr", type=float, default=None, metavar="LR",
        help="learning rate of the residual (orthogonal) maps, which turn every layer's stream at once (default: --lr)",
    )
    group.add_argument("--schedule", choices=SCHEDULES, default="constant", help="learning-rate schedule (default: constant)")
    group.add_argument("--warmup", type=int, default=0, metavar="N", help="linear warmup steps of the schedule (default: 0)")
    group.add_argument(
        "--permutations", choices=PERMUTATIONS, default="fixed",
        help="MLP unit and head permutations: fixed at weight matching's, or trained as straight-through Hungarian or Sinkhorn (default: fixed)",
    )
    group.add_argument("--orthogonal", choices=["cayley", "exp", "polar"], default="cayley", help="residual map parametrisation (default: cayley)")
    group.add_argument(
        "--frame", choices=FRAMES, default="own",
        help="where each map's trained factor sits: after the start, stepping in the model's own coordinates (own), "
        "before it, in the coordinates of the model it is aligned to (target), or one factor on each side, as dual matching's "
        "relative map has (both); target and both need cayley or exp (default: own)",
    )
    group.add_argument(
        "--objective", choices=OBJECTIVES, default="labels",
        help="train the merge toward the data's labels, or toward the models' own predictions mixed at the same weights "
        "(ensemble: one extra forward per model and step; lower barriers on the zoo language models, see the README) (default: labels)",
    )
    group.add_argument(
        "--worst-fraction", type=_fraction, default=0.5, metavar="F",
        help="two models: share of training weights drawn near the path's current worst point, the rest from U(0.4, 0.6) "
        "(re-located every 50 steps; 0: all uniform) (default: 0.5)",
    )
    group.add_argument(
        "--focus", choices=FOCI, default="worst",
        help="two models: those draws go near the single worst grid point, or near every point above the line in "
        "proportion to its excess (for paths with two humps of about one height) (default: worst)",
    )
    group.add_argument(
        "--input-noise", type=_non_negative, default=0.0, metavar="SIGMA",
        help="image models: std of Gaussian noise added to the training images at every step, against transforms that "
        "fit images the models have memorised (0.25 on the zoo ViT, pixels in [-1, 1]; see the README) (default: 0)",
    )
    group.add_argument(
        "--seed", type=int, default=None, metavar="N",
        help="seed of the training draws (interpolation weights, input noise): the same seed, data and settings give the "
        "same merge (default: torch's starting state, the same in every fresh process)",
    )
    group.add_argument("--concentration", type=float, default=0.1, metavar="C", help="3+ models: training weights drawn from Dirichlet(C * 1) (default: 0.1; 1.0 gave lower simplex barriers on the zoo triples, see the README)")


def _add_model_options(parser: argparse.ArgumentParser, weights: bool = False) -> None:
    """Two or more models, their revisions and the method; ``weights``: --alpha / --weights (merge)."""
    parser.add_argument("models", nargs="+", metavar="MODEL", help="two or more local folders or Hub ids (MODEL_A MODEL_B ...)")
    group = parser.add_argument_group("models")
    group.add_argument("--revision-a", default=None, metavar="REV", help="Hub revision of MODEL_A")
    group.add_argument("--revision-b", default=None, metavar="REV", help="Hub revision of MODEL_B")
    group.add_argument("--revisions", nargs="+", default=None, metavar="REV", help="Hub revision of every model, in order ('-' for the default branch)")
    method = parser.add_argument_group("method")
    method.add_argument("--method", choices=list(METHODS), default="weight", help="alignment before interpolation (default: weight, data-free; universe matching for 3+ models)")
    method.add_argument("--symmetries", choices=["full", "permutation"], default="full", help="symmetry group the alignment searches (default: full)")
    if weights:
        method.add_argument("--alpha", type=float, default=None, help="two models: weight of MODEL_B in [0, 1] (default: 0.5)")
        method.add_argument("--weights", type=float, nargs="+", default=None, metavar="W", help="one weight per model, >= 0, summing to 1 (default: uniform)")
        method.add_argument(
            "--device", default=None, metavar="DEVICE",
            help="where weight matching and the export's products run: cpu, cuda or cuda:N (default: a GPU when torch sees one, else cpu)",
        )


def cmd_symmetries(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from .adapters import adapter_for
    from .hub import resolve_checkpoint
    from .symmetry import axes_of

    config = AutoConfig.from_pretrained(resolve_checkpoint(args.model))
    spec = adapter_for(config).spec(config)
    print(spec)
    names = spec.names() if args.all_layers else [n for n in spec.names() if not n.startswith("layers.") or n.startswith("layers.0.")]
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
    from . import __version__

    parser.add_argument("--version", action="version", version=f"hf-lmc {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    merge = commands.add_parser(
        "merge",
        help="merge two or more checkpoints into one stock HF checkpoint with a model card",
        description="Align the models (weight matching by default) and write (1-alpha)*A + alpha*aligned(B) "
        "as an ordinary HF folder: sharded safetensors, config, tokenizer files, model card. With three or "
        "more models: sum_k w_k*aligned(model k), every model aligned to one shared reference (universe matching).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_options(merge, weights=True)
    out = merge.add_argument_group("output")
    out.add_argument("--output", "-o", required=True, metavar="DIR", help="folder to write (must not exist unless --overwrite)")
    out.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    out.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None, help="dtype of the written weights (default: MODEL_A's)")
    out.add_argument("--shard-size", default="5GB", metavar="SIZE", help="maximum shard size, e.g. 5GB or 500MB (default: 5GB)")
    hub = merge.add_argument_group("hub")
    hub.add_argument("--push-to-hub", default=None, metavar="REPO_ID", help="upload the merged folder to this model repo")
    hub.add_argument("--private", action="store_true", help="create the Hub repo as private")
    evaluation = merge.add_argument_group("evaluation (optional: adds the barrier table and plot to the card)")
    evaluation.add_argument("--eval-data", default=None, metavar="DATA", help="text file/folder, datasets id/path, or .pt tensors for ViT")
    _add_eval_options(merge, "data settings")
    _add_learn_options(merge, "--data")
    merge.set_defaults(run=cmd_merge)

    bar = commands.add_parser(
        "barrier",
        help="measure the loss barrier along the vanilla and aligned linear paths (or over the simplex of 3+ models)",
        description="Evaluate held-out loss along (1-alpha)*A + alpha*B for vanilla averaging and for the "
        "aligned path, and report the barrier: the largest excess over the line between the endpoints. With 3+ "
        "models, the same over a grid of the simplex: the largest L(sum_k w_k theta_k) - sum_k w_k L(theta_k).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_options(bar)
    data = bar.add_argument_group("data")
    data.add_argument("--data", required=True, metavar="DATA", help="text file/folder, datasets id/path, or .pt tensors for ViT")
    _add_eval_options(bar, "data settings")
    _add_learn_options(bar, "--fit-data")
    report = bar.add_argument_group("report")
    report.add_argument("--plot", default=None, metavar="FILE.png", help="save the loss-along-path plot (three models: the simplex triangle)")
    report.add_argument("--json", action="store_true", help="print JSON instead of a table")
    bar.set_defaults(run=cmd_barrier)

    check = commands.add_parser(
        "check",
        help="prove on your own model that canonical form, symmetries and export are exact",
        description="Canonicalise each model, apply a random symmetry, export to its stock HF class, "
        "save and reload it, and compare logits with the original.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument("models", nargs="*", metavar="MODEL", help="local folders or Hub ids (default: tiny built-in models)")
    numerics = check.add_argument_group("numerics")
    numerics.add_argument(
        "--dtype", choices=sorted(TOLERANCE), default="float32",
        help="compute dtype; float64 checks to 1e-9 (LLaMA's RMSNorm runs without its float32 downcast)",
    )
    numerics.add_argument("--seed", type=int, default=0, help="seed of the random symmetry and inputs (default: 0)")
    group = check.add_argument_group("symmetry")
    group.add_argument("--symmetries", choices=["full", "permutation"], default="full", help="group to sample from (default: full)")
    check.set_defaults(run=cmd_check)

    demo = commands.add_parser(
        "demo",
        help="offline end-to-end run: train a GPT-2 pair on Shakespeare, merge, print the barrier table",
        description="Train (or load from the cache) two small GPT-2 models on the shipped Shakespeare plays\n"
        "from different seeds, merge them with weight matching, print the barrier of vanilla vs aligned\n"
        "interpolation on held-out plays, and write the merged model with its card and plot. Offline.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--output", "-o", default="hf-lmc-demo", metavar="DIR", help="where to write the merge (default: ./hf-lmc-demo)")
    quick = demo.add_argument_group("quick runs")
    quick.add_argument("--steps", type=int, default=None, metavar="N", help="training steps per model (default: the zoo's 600)")
    quick.add_argument("--eval-chars", type=int, default=16384, metavar="N", help="held-out characters to evaluate (default: 16384)")
    quick.add_argument("--cache-dir", type=Path, default=None, metavar="DIR", help="folder for trained zoo models (default: $HF_LMC_CACHE/zoo or ~/.cache/hf_lmc/zoo)")
    demo.set_defaults(run=cmd_demo)

    sym = commands.add_parser(
        "symmetries",
        help="print a model's canonical tensors and the symmetry space of each axis",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sym.add_argument("model", metavar="MODEL", help="local folder or Hub id")
    sym.add_argument("--all-layers", action="store_true", help="list every layer, not only layer 0")
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
    from .runner import SUMMARY, run_recipe

    result = run_recipe(args.recipe, overrides=_overrides(args))
    print(result.table())
    print(f"\n{len(result.runs)} merged model(s) and {SUMMARY}.md/.json/.csv written to {result.output}")
    for run in result.runs:
        if run.url:
            print(f"pushed {run.group} / {run.method} to {run.url}")
    return 0


def cmd_recipe_check(args: argparse.Namespace) -> int:
    from .recipe import load_recipe

    recipe = load_recipe(args.recipe, _overrides(args))
    runs = recipe.runs()
    print(f"{args.recipe}: valid; {len(runs)} run(s) into {recipe.output.dir}")
    push = recipe.output.push_to_hub
    for group, method, models in runs:
        target = f" -> {push.format(group=group, method=method)}" if push else ""
        print(f"  {recipe.run_folder(group, method)}: {method} of {', '.join(m.label for m in models)}{target}")
    return 0


def cmd_recipe_schema(args: argparse.Namespace) -> int:
    import json

    from .recipe import Recipe

    print(json.dumps(Recipe.model_json_schema(), indent=2))
    return 0


def _add_recipe_commands(commands) -> None:
    """``hf-lmc run RECIPE`` and ``hf-lmc recipe {check,schema}``."""
    formatting = {"epilog": RECIPE_EXAMPLES, "formatter_class": argparse.RawDescriptionHelpFormatter}
    run = commands.add_parser(
        "run",
        help="run a YAML recipe: merges, barriers and a summary table (one pair or a sweep)",
        description="Validate RECIPE.yaml, then merge every group of models with every method it lists, and write\n"
        "the merged models and summary.md/.json/.csv (barrier per group and method) into its output folder.\n"
        "recipes/README.md describes the keys; `hf-lmc recipe schema` prints them all.",
        **formatting,
    )
    recipe = commands.add_parser("recipe", help="check a recipe or print the recipe schema", **formatting)
    actions = recipe.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser("check", help="validate a recipe and list the runs it makes", **formatting)
    schema = actions.add_parser("schema", help="print the JSON schema of recipes", **formatting)
    for parser in (run, check):
        parser.add_argument("recipe", metavar="RECIPE.yaml", help="the recipe file")
        changes = parser.add_argument_group("changes to the recipe")
        changes.add_argument(
            "--set", action="append", default=[], metavar="KEY=VALUE",
            help="override a key: dotted path, value read as YAML (e.g. zoo.steps=50, method=[weight,dual], sweep.0.name=tiny); repeatable",
        )
        if parser is run:
            changes.add_argument("--overwrite", action="store_true", help="replace an existing output folder (output.overwrite)")
    run.set_defaults(run=cmd_run)
    check.set_defaults(run=cmd_recipe_check)
    schema.set_defaults(run=cmd_recipe_schema)


def _return_freed_memory_promptly() -> None:
    """Have glibc serve large blocks with ``mmap`` at a fixed threshold, so freed tensors go back
    to the OS at once. By default the threshold grows with each freed block (up to 32 MB), and the
    layer-sized temporaries of a streamed merge then pile up in malloc arenas: about 0.6 GB more
    peak RSS at Pythia-1B shape. A no-op where glibc is not the allocator."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB
    except (OSError, AttributeError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _return_freed_memory_promptly()
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError, OSError) as err:
        print(f"hf-lmc: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
