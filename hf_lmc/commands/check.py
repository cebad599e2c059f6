"""``hf-lmc check``: canonical form, symmetries and export proven exact on a model
(:mod:`hf_lmc.canonical.exactness`)."""

from __future__ import annotations

import argparse
import logging

from hf_lmc.commands.common import (
    TOLERANCE,
)

logger = logging.getLogger(__name__)


def main(args: argparse.Namespace) -> int:
    import torch

    from hf_lmc.canonical.adapters import adapter_for
    from hf_lmc.canonical.exactness import check_exactness, tiny_configs
    from hf_lmc.config.options import escape_controls

    dtype = getattr(torch, args.dtype)
    if args.models:
        from hf_lmc.io.loading import load_model

        logger.info("loading %d models in %s", len(args.models), args.dtype)
        models = [(name, load_model(name).model.to(dtype)) for name in args.models]
    else:
        logger.info("building a tiny random model of each family (%s)", ", ".join(tiny_configs()))
        torch.manual_seed(args.seed)
        models = [(f"tiny-{arch}", adapter_for(cfg).model_class(cfg).to(dtype)) for arch, cfg in tiny_configs().items()]
    tolerance = TOLERANCE[args.dtype]
    print(f"relative logit error vs the original model ({args.dtype}, tolerance {tolerance:g})")
    print(f"{'model':<32} {'type':<9} {'params':>10} {'canonical':>10} {'symmetry':>10} {'reloaded':>10}")
    failed = False
    for name, model in models:
        logger.info(
            "%s: canonical form, a random %s symmetry, export, save and reload",
            escape_controls(name, 120),
            args.symmetries,
        )
        report = check_exactness(model, seed=args.seed, symmetries=args.symmetries)
        ok = report.worst < tolerance
        failed |= not ok
        print(
            f"{name:<32} {report.model_type:<9} {report.parameters:>10,} {report.canonical:>10.1e} "
            f"{report.symmetry:>10.1e} {report.reloaded:>10.1e}  {'ok' if ok else 'FAILED'}"
        )
    return 1 if failed else 0
