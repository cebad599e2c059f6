"""``hf-lmc symmetries``: a model's canonical tensors and the symmetry space of each axis."""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


def main(args: argparse.Namespace) -> int:
    from hf_lmc.canonical.adapters import adapter_for, read_config
    from hf_lmc.config.options import escape_controls
    from hf_lmc.io.hub import resolve_checkpoint
    from hf_lmc.symmetry import axes_of

    logger.info("reading the config of %s", escape_controls(args.model, 120))
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
