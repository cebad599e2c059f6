"""``hf-lmc``: the command-line interface."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

EXAMPLES = """\
examples:
  hf-lmc check                                  # tiny GPT-2, Pythia, LLaMA and ViT models
  hf-lmc check ./my-llama EleutherAI/pythia-14m --dtype float64
  hf-lmc symmetries ./my-llama                  # which tensor axes live in which space
"""

TOLERANCE = {"float32": 1e-4, "float64": 1e-9}


def _load(reference: str, dtype):
    """A stock HF model from a local folder or a Hub id."""
    from transformers import AutoConfig

    from .adapters import adapter_for
    from .hub import resolve_checkpoint

    folder = resolve_checkpoint(reference)
    config = AutoConfig.from_pretrained(folder)
    return adapter_for(config).model_class.from_pretrained(folder, dtype=dtype)


def cmd_check(args: argparse.Namespace) -> int:
    import torch

    from .verify import check_exactness, tiny_configs
    from .adapters import adapter_for

    dtype = getattr(torch, args.dtype)
    if args.models:
        models = [(name, _load(name, dtype)) for name in args.models]
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

    sym = commands.add_parser(
        "symmetries",
        help="print a model's canonical tensors and the symmetry space of each axis",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sym.add_argument("model", metavar="MODEL", help="local folder or Hub id")
    sym.add_argument("--all-layers", action="store_true", help="list every layer, not only layer 0")
    sym.set_defaults(run=cmd_symmetries)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"hf-lmc: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
