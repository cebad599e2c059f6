"""Levers measured on the benchmark suite's pairs and left out of the defaults (docs/benchmarks.md §0.7).

Each lever is measured against the defaults on the same pairs, fitting and held-out data as
``benchmarks/suite.py``:

* ``activation-start``: learned matching at the defaults, started from activation matching's
  transform instead of weight matching's (``LearnedMatcher(init=...)``);
* ``repair``: the midpoint of weight and of learned matching with every GPT-2 MLP unit's
  pre-activation mean and std set to the average of the endpoints' (REPAIR, Jordan et al.
  2022) on 64 fitting batches; not a symmetry, only the merged point moves (GPT-2 pairs only);
* ``float32-similarity``: weight matching with float32 unit and head similarities in place of
  bfloat16;
* ``residual``: where learned matching's gain over weight matching sits. Weight and learned
  matching's barriers, each with the other's residual map swapped in (the layer maps kept), and
  how far each turns B's stream from A's: the per-token cosine of A's and ``T(B)``'s hidden
  states, averaged over every layer's input, on 4 held-out batches;
* ``fixed-residual``: learned matching at the defaults with the residual map held at weight
  matching's (its learning rate 1e-9), the head maps and MLP scales trained as usual;
* ``residual-structure``: whether any weight-space structure points to learned matching's
  residual map, as a data-free estimate would need. Per tensor kind, the cosine of A's tensor
  and ``T(B)``'s under each method; how much of B's principal token subspace (embeddings and
  head) each residual map sends into A's (chance: ``k/d``); and two controls: weight matching's layer maps under a
  Haar-random residual map, and re-solved (one sweep, weight similarities) under learned
  matching's;
* ``random-residual-start``: learned matching at the defaults started from weight matching's
  layer maps with a Haar-random residual map in place of weight matching's: whether the
  residual map weight matching finds is what learned matching builds on;
* ``start-parts``: learned matching at the defaults started from weight matching's transform
  with its MLP unit maps, or its head maps, left out (identity), and from the identity: which
  of the start's assignments its end point rests on.

    python -m benchmarks.levers activation-start --families gpt2 vit
    python -m benchmarks.levers repair --families gpt2
    python -m benchmarks.levers residual --pairs suite-llama-a width-llama-64 width-llama-256
    python -m benchmarks.levers residual-structure --families gpt2 pythia llama
    python -m benchmarks.levers random-residual-start --families gpt2 pythia llama
    python -m benchmarks.levers start-parts --pairs suite-llama-a suite-pythia-b
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence

import torch

from hf_lmc.alignment import align_many
from hf_lmc.barriers import barrier_of_loaded
from hf_lmc.canonical import canonicalize, combine, to_hf
from hf_lmc.evaluation import evaluate
from hf_lmc.loading import load_model
from hf_lmc.matching import ActivationMatcher, LearnedMatcher, TrainedMatcher, WeightMatcher
from hf_lmc.matching.solvers import polar, polar_fixing_ones
from hf_lmc.matching.weight import _ResidualStats
from hf_lmc.options import EvalOptions, LearnOptions
from hf_lmc.symmetry import Transform
from hf_lmc.symmetry.groups import ResidualMap

from . import suite, width_scaling


def _loaded(pair: suite.SuitePair):
    folders, evaluation, fitting = suite.pair_data(pair)
    loaded = [load_model(f) for f in folders]
    return loaded, [canonicalize(m.model) for m in loaded], evaluation, fitting


def _barrier(loaded, evaluation, method: str, transform_b: Transform) -> float:
    result = barrier_of_loaded(
        *loaded,
        evaluation,
        methods=(method,),
        alphas=11,
        symmetries="full",
        eval_options=EvalOptions(batch_size=16),
        progress=False,
        transforms={method: (Transform(), transform_b)},
    )
    return result.barriers[method]


def _learned(a, b, fitting, learn: LearnOptions | None = None, init="weight") -> Transform:
    """B's transform from learned matching (at the defaults unless ``learn``), its training
    draws seeded as in every lever's learned row."""
    torch.manual_seed(0)
    _, transform_b = TrainedMatcher(
        LearnedMatcher, fitting, learn=learn or LearnOptions(), progress=False, init=init
    ).fit([a, b])
    return transform_b


def activation_start(pair: suite.SuitePair) -> dict[str, float]:
    """Learned matching's barrier at the defaults from activation matching's start."""
    loaded, (a, b), evaluation, fitting = _loaded(pair)
    torch.manual_seed(0)
    start = ActivationMatcher(fitting, progress=False).match(a, b)
    _, t_b = TrainedMatcher(LearnedMatcher, fitting, learn=LearnOptions(), progress=False, init=start).fit([a, b])
    return {"learned, activation start": _barrier(loaded, evaluation, "learned", t_b)}


def float32_similarity(pair: suite.SuitePair) -> dict[str, float]:
    """Weight matching's barrier with float32 similarities."""
    loaded, (a, b), evaluation, _ = _loaded(pair)
    t_b = WeightMatcher(similarity_dtype=torch.float32, progress=False).match(a, b)
    return {"weight, float32 similarities": _barrier(loaded, evaluation, "weight", t_b)}


def _hidden_states(model, batches) -> list[torch.Tensor]:
    """Every layer's input (and the last layer's output), one row per token over ``batches``."""
    per_batch = []
    with torch.no_grad():
        for batch in batches:
            out = model(**{k: v for k, v in batch.items() if k != "labels"}, output_hidden_states=True)
            per_batch.append(out.hidden_states)
    return [torch.cat([states[i].flatten(0, -2) for states in per_batch]) for i in range(len(per_batch[0]))]


def _stream_cosine(a, b, transform_b: Transform, batches) -> float:
    """Mean per-token cosine of A's and ``T(B)``'s hidden states, averaged over layers: near 1 when
    the transform lines B's stream up with A's, near 0 when it turns it away."""
    states_a = _hidden_states(to_hf(a).eval(), batches)
    states_b = _hidden_states(to_hf(transform_b.to(torch.float32).apply(b).materialize()).eval(), batches)
    cosines = [torch.nn.functional.cosine_similarity(x, y, dim=-1).mean().item() for x, y in zip(states_a, states_b)]
    return sum(cosines) / len(cosines)


def _with_residual(transform: Transform, residual_from: Transform) -> Transform:
    maps = {k: v for k, v in transform.maps.items() if k != "residual"}
    if "residual" in residual_from.maps:
        maps["residual"] = residual_from.maps["residual"]
    return Transform(maps)


def residual(pair: suite.SuitePair) -> dict[str, float]:
    """Weight and learned matching with each other's residual map, and how far each turns B's stream."""
    loaded, (a, b), evaluation, fitting = _loaded(pair)
    weight = WeightMatcher(progress=False).match(a, b)
    learned = _learned(a, b, fitting)
    return {
        "weight": _barrier(loaded, evaluation, "weight", weight),
        "weight, learned's residual": _barrier(loaded, evaluation, "weight", _with_residual(weight, learned)),
        "learned": _barrier(loaded, evaluation, "learned", learned),
        "learned, weight's residual": _barrier(loaded, evaluation, "learned", _with_residual(learned, weight)),
        "stream cosine, weight": _stream_cosine(a, b, weight, evaluation[:4]),
        "stream cosine, learned": _stream_cosine(a, b, learned, evaluation[:4]),
    }


def fixed_residual(pair: suite.SuitePair) -> dict[str, float]:
    """Learned matching at the defaults with the residual map held at weight matching's."""
    loaded, (a, b), evaluation, fitting = _loaded(pair)
    learned = _learned(a, b, fitting, LearnOptions(residual_lr=1e-9))
    return {
        "learned, residual fixed": _barrier(loaded, evaluation, "learned", learned),
        "stream cosine": _stream_cosine(a, b, learned, evaluation[:4]),
    }


def _kind(name: str) -> str:
    """``embed``, ``head`` or a layer tensor's role (``q``, ``up``, ``down``, ...)."""
    layer = re.match(r"layers\.\d+\.\w+\.(\w+)\.", name)
    return layer.group(1) if layer else name.split(".")[0]


def _tensor_cosines(a, b, transform: Transform) -> dict[str, float]:
    """Per tensor kind (embeddings, head, every layer's matrices together), the mean cosine of
    A's tensor and ``T(B)``'s: how close in weight space the transform brings B."""
    moved = transform.to(torch.float64).apply(b)
    cosines: dict[str, list[float]] = {"embed": [], "head": [], "layers": []}
    for group in a.spec.groups():
        ga, gb = a.group(group), moved.group(group)
        for name, ta in ga.items():
            x, y = ta.double().flatten(), gb[name].double().flatten()
            if ta.dim() == 2 and x.norm() > 0 and y.norm() > 0:
                kind = _kind(name)
                cosines[kind if kind in cosines else "layers"].append((x @ y / (x.norm() * y.norm())).item())
    return {kind: sum(v) / len(v) for kind, v in cosines.items() if v}


def _token_subspace(model, k: int) -> torch.Tensor:
    """The top ``k`` eigenvectors of ``E^T E / |E|^2 + H^T H / |H|^2`` (token embeddings ``E``,
    head ``H``, one row per token): the stream directions the vocabulary uses most. No layer
    map touches these two tensors, so the subspace moves with the residual map alone."""
    gram = 0
    for group, name in (("embed", "embed.tokens"), ("head", "head.weight")):
        x = model.group(group)[name].double()
        gram = gram + x.T @ x / x.square().sum()
    _, vectors = torch.linalg.eigh(gram)
    return vectors[:, -k:]


def _subspace_overlap(a, b, transform: Transform, k: int) -> float:
    """Share of B's top-``k`` token subspace that the residual map sends into A's: 1 when it
    lines them up, ``k/d`` on average for a map with no relation to either."""
    matrix = transform.maps["residual"].matrix.double()
    return ((_token_subspace(a, k).T @ matrix @ _token_subspace(b, k)).square().sum() / k).item()


def _haar_residual(d: int, centred: bool, seed: int) -> Transform:
    """A Haar-random residual map (one fixing the ones vector for LayerNorm models): the polar
    factor of a Gaussian matrix."""
    gaussian = torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return Transform({"residual": ResidualMap.from_matrix(polar_fixing_ones(gaussian) if centred else polar(gaussian))})


def _layer_maps_under(a, b, residual_from: Transform) -> Transform:
    """Weight matching's layer maps solved in one sweep under ``residual_from``'s residual map,
    which is kept (what weight matching's sweep does between its residual refits)."""
    matcher = WeightMatcher(progress=False)
    residual_map = residual_from.maps["residual"]
    layer_maps: dict = {}
    stats = _ResidualStats(a.spec.hidden_size, matcher.device)  # filled by the sweep, not read here
    rotate = Transform({"residual": residual_map}).to(device=matcher.device)
    matcher._sweep(a.spec, a, b, rotate, stats, layer_maps, desc="")
    return Transform(layer_maps | {"residual": residual_map})


def residual_structure(pair: suite.SuitePair) -> dict[str, float]:
    """How learned matching's residual map relates to weight space, against weight matching's and chance."""
    loaded, (a, b), evaluation, fitting = _loaded(pair)
    weight = WeightMatcher(progress=False).match(a, b)
    learned = _learned(a, b, fitting)
    d = a.spec.hidden_size
    k = d // 4
    haar = _haar_residual(d, a.spec.centred, seed=0)
    out = {
        "weight": _barrier(loaded, evaluation, "weight", weight),
        "learned": _barrier(loaded, evaluation, "learned", learned),
        "weight's layer maps, random residual": _barrier(loaded, evaluation, "weight", _with_residual(weight, haar)),
        "weight's layer maps re-solved under learned's residual": _barrier(
            loaded, evaluation, "weight", _layer_maps_under(a, b, learned)
        ),
        "token subspace overlap (top d/4), weight": _subspace_overlap(a, b, weight, k),
        "token subspace overlap (top d/4), learned": _subspace_overlap(a, b, learned, k),
        "token subspace overlap (top d/4), chance": k / d,
    }
    for method, transform in (("weight", weight), ("learned", learned)):
        for kind, cosine in _tensor_cosines(a, b, transform).items():
            out[f"cosine {kind}, {method}"] = cosine
    return out


def random_residual_start(pair: suite.SuitePair) -> dict[str, float]:
    """Learned matching from weight matching's layer maps and a Haar-random residual map."""
    loaded, (a, b), evaluation, fitting = _loaded(pair)
    weight = WeightMatcher(progress=False).match(a, b)
    start = _with_residual(weight, _haar_residual(a.spec.hidden_size, a.spec.centred, seed=0))
    learned = _learned(a, b, fitting, init=start)
    k = a.spec.hidden_size // 4
    return {
        "start (weight's layer maps, random residual)": _barrier(loaded, evaluation, "weight", start),
        "learned from it": _barrier(loaded, evaluation, "learned", learned),
        "token subspace overlap (top d/4), learned from it": _subspace_overlap(a, b, learned, k),
    }


def start_parts(pair: suite.SuitePair) -> dict[str, float]:
    """Learned matching from weight matching's transform less its unit maps or its head maps, and from the identity."""
    loaded, (a, b), evaluation, fitting = _loaded(pair)
    weight = WeightMatcher(progress=False).match(a, b)
    starts = {
        "without unit maps": Transform({k: v for k, v in weight.maps.items() if not k.startswith("mlp.")}),
        "without head maps": Transform({k: v for k, v in weight.maps.items() if not k.startswith("attn.")}),
        "identity": "identity",
    }
    return {
        f"learned from weight's start {label}" if label != "identity" else "learned from the identity": _barrier(
            loaded, evaluation, "learned", _learned(a, b, fitting, init=start)
        )
        for label, start in starts.items()
    }


def repair(pair: suite.SuitePair) -> dict[str, float]:
    """Midpoint excess of weight and learned matching, before and after renormalising the MLP units."""
    if pair.family != "gpt2":
        raise ValueError(f"repair is written for GPT-2's MLP (c_fc with a bias), not {pair.family}")
    _, canonical, evaluation, fitting = _loaded(pair)
    out = {}
    for method in ("weight", "learned"):
        torch.manual_seed(0)
        t_a, t_b = align_many(
            method, canonical, batches=fitting if method != "weight" else None, learn=LearnOptions(), progress=False
        )
        moved = [t.apply(c).materialize() if t.maps else c for t, c in zip((t_a, t_b), canonical)]
        ends = [to_hf(combine(moved, w)) for w in ((1.0, 0.0), (0.0, 1.0))]
        line = sum(evaluate(m, evaluation).loss for m in ends) / 2
        midpoint = to_hf(combine(moved, (0.5, 0.5)))
        out[f"{method}, midpoint"] = evaluate(midpoint, evaluation).loss - line
        _renormalise(midpoint, ends, fitting[:64])
        out[f"{method}, midpoint renormalised"] = evaluate(midpoint, evaluation).loss - line
    return out


def _unit_moments(model, batches) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per MLP layer, each unit's pre-activation mean and std over ``batches`` (float64)."""
    layers = [block.mlp.c_fc for block in model.transformer.h]
    sums = [[0, 0.0, 0.0] for _ in layers]

    def hook(index):
        def record(_module, _inputs, output):
            h = output.detach().double().reshape(-1, output.shape[-1])
            sums[index][0] += h.shape[0]
            sums[index][1] = sums[index][1] + h.sum(0)
            sums[index][2] = sums[index][2] + h.square().sum(0)

        return record

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    with torch.no_grad():
        for batch in batches:
            model(**{k: v for k, v in batch.items() if k != "labels"})
    for handle in handles:
        handle.remove()
    moments = []
    for n, total, squares in sums:
        mean = total / n
        moments.append((mean, (squares / n - mean.square()).clamp_min(1e-12).sqrt()))
    return moments


def _renormalise(midpoint, ends, batches) -> None:
    """Set each MLP unit's pre-activation mean and std in ``midpoint`` to the endpoints' average,
    layer by layer (a layer's statistics are taken after the layers below it are set)."""
    ends_moments = [_unit_moments(m, batches) for m in ends]
    for i, layer in enumerate(block.mlp.c_fc for block in midpoint.transformer.h):
        mean, std = _unit_moments(midpoint, batches)[i]
        target_mean = (ends_moments[0][i][0] + ends_moments[1][i][0]) / 2
        target_std = (ends_moments[0][i][1] + ends_moments[1][i][1]) / 2
        gain = target_std / std
        with torch.no_grad():
            layer.weight.mul_(gain.to(layer.weight.dtype)[None, :])  # Conv1D weight: (in, out)
            layer.bias.copy_(((layer.bias.double() - mean) * gain + target_mean).to(layer.bias.dtype))


#: Each lever by the name the command line takes.
MEASURES = {
    "activation-start": activation_start,
    "repair": repair,
    "float32-similarity": float32_similarity,
    "residual": residual,
    "fixed-residual": fixed_residual,
    "residual-structure": residual_structure,
    "random-residual-start": random_residual_start,
    "start-parts": start_parts,
}


def _pairs(tier: str, families: Sequence[str], names: Sequence[str] | None) -> list[suite.SuitePair]:
    """The tier's pairs of ``families``, or the pairs ``names`` names: the tier's, or
    ``width-FAMILY-WIDTH`` for :mod:`benchmarks.width_scaling`'s."""
    if not names:
        return [pair for pair in suite.TIERS[tier] if pair.family in families]
    out = []
    for name in names:
        if name.startswith("width-"):
            _, family, width = name.split("-")
            out.append(width_scaling.pair_at(family, int(width)))
            continue
        try:
            out.append(suite.pair_named(name))
        except ValueError as err:
            raise SystemExit(f"{err}, or width-FAMILY-WIDTH") from None
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("lever", choices=list(MEASURES))
    parser.add_argument("--tier", choices=list(suite.TIERS), default="cpu")
    parser.add_argument("--families", nargs="+", choices=suite.FAMILIES, default=list(suite.FAMILIES))
    parser.add_argument(
        "--pairs", nargs="+", default=None, help="pairs by name instead (the tiers', or width-FAMILY-WIDTH)"
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="N",
        help="language pairs read a BPE of N tokens (suite.with_vocabulary)",
    )
    parser.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    args = parser.parse_args(argv)
    rows = []
    for pair in _pairs(args.tier, args.families, args.pairs):
        pair = suite.with_vocabulary(pair, args.vocab_size)
        values = MEASURES[args.lever](pair)
        rows.append({"pair": pair.entry.name, **values})
        print(f"{pair.entry.name}: {json.dumps(values)}", file=sys.stderr)
    columns = list(dict.fromkeys(k for row in rows for k in row if k != "pair"))
    print("| pair | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns))
    for row in rows:
        print(f"| {row['pair']} | " + " | ".join(f"{row[c]:.3f}" if c in row else "—" for c in columns) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
