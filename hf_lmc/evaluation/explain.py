"""Where a barrier comes from: the midpoint's excess split into parts that add up to it.

The midpoint of the path ``M = (P + Q) / 2`` between ``P = T_A(A)`` and ``Q = T_B(B)`` stands
``E = L(M) - (L(A) + L(B)) / 2`` above the line between the endpoints (its excess). The
canonical tensors fall into groups (each input the embeddings add: tokens, positions, a ViT's
patches and class token; per layer the attention's query-key pair (QK), its value-output pair
(OV) and the MLP; the head), and :func:`explain` splits ``E`` among them by moving the groups to their midpoint values one at a time, from each end:

* for an order of the groups, start at ``P`` and move one group after another to the
  midpoint, recording each step's change in loss; the steps telescope to ``L(M) - L(P)``.
  Doing the same from ``Q`` gives steps that sum to ``L(M) - L(Q)``;
* a group's **part** for that order is the mean of its two steps, so a path's parts sum to
  ``L(M) - (L(P) + L(Q)) / 2 = E`` exactly (``T_A`` and ``T_B`` are symmetries, so ``L(P) =
  L(A)`` and ``L(Q) = L(B)`` up to float rounding);
* the parts are averaged over several orders, which keeps the sum. Over all orders the average
  is the Shapley value of the game ``v(S) = (L(P_S) + L(Q_S)) / 2`` (``S`` at the midpoint, the
  rest at the end); a few orders sample it.

A step depends on which groups moved before it: moved first, a group shows the loss it adds by
itself (the others at the ends); moved last, the loss the midpoint would lose without it. That
difference is the groups' interaction, and the range of a part over the orders shows it. The
default orders are the network's (input to output) and its reverse, an antithetic pair; more
orders add random ones, each with its reverse.

Both paths are explained: the average's (B as stored) and, with a method, the aligned one,
so a table shows which groups the alignment fixes and which it leaves. The work happens in
canonical form, where norms are folded into the tensors that read them (docs/design.md §2):
their gains travel with the QK, OV, MLP and head groups, and there is no separate norm group.
Every point is a stock HF model (:func:`hf_lmc.canonical.form.to_hf`), so the losses are those the
exported models compute.
"""

from __future__ import annotations

import json
import logging
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hf_lmc.canonical.adapters import read_config
from hf_lmc.canonical.form import canonicalize, from_state_dict, to_hf
from hf_lmc.canonical.widths import check_mergeable, spec_of
from hf_lmc.config.methods import METHODS, check_method
from hf_lmc.config.options import (
    DEFAULT_SYMMETRIES,
    EVAL_OPTIONS,
    EXPLAIN_EVAL_BATCHES,
    FIT_OPTIONS,
    EvalOptions,
    ExplainOptions,
    LearnOptions,
    check_orders,
)
from hf_lmc.evaluation.batches import fitting_batches, load_batches
from hf_lmc.evaluation.loss import evaluate
from hf_lmc.io.hub import resolve_checkpoint
from hf_lmc.io.loading import load_model
from hf_lmc.io.outputs import save_figure
from hf_lmc.merging.alignment import align_many
from hf_lmc.utils.progress import bar as progress_bar

logger = logging.getLogger(__name__)

#: Canonical tensor name -> group kind (the layer index is added in front for layer tensors).
_KINDS = (("attn.q.", "QK"), ("attn.k.", "QK"), ("attn.v.", "OV"), ("attn.o.", "OV"), ("mlp.", "MLP"))
#: Canonical embedding tensor name -> its group: each kind of input the embeddings add (a ViT's
#: patch projection, class token and position table; a language model's token and position
#: tables) is a group of its own, so a table shows which of them holds a barrier.
_EMBEDDING_GROUPS = (
    ("embed.tokens", "token embeddings"),
    ("embed.positions", "position embeddings"),
    ("embed.patch.", "patch embeddings"),
    ("embed.cls", "class-token embeddings"),
)
#: How to read a part, said under every table and in every picture.
HOW_TO_READ = (
    "each part is the nats of the midpoint's excess a group adds when it is interpolated "
    "(positive = adds to the barrier, negative = lowers it); a path's parts sum to its total excess"
)


def explanation_group(name: str) -> str:
    """The explanation group of a canonical tensor: ``head``, ``layer i KIND``, or an embedding
    group (``token embeddings``, ``position embeddings``, ``patch embeddings``, ``class-token
    embeddings``; their kind, the last word, is ``embeddings``)."""
    layer = re.match(r"layers\.(\d+)\.(.*)", name)
    if layer is None:
        if name.startswith("head"):
            return "head"
        return next((group for prefix, group in _EMBEDDING_GROUPS if name.startswith(prefix)), "embeddings")
    kind = next((k for prefix, k in _KINDS if layer.group(2).startswith(prefix)), layer.group(2).split(".")[0])
    return f"layer {layer.group(1)} {kind}"


def orders_of(groups: Sequence[str], count: int, seed: int = 0) -> list[list[str]]:
    """``count`` orders of ``groups`` in reversed pairs: the given (network) order and its reverse,
    then random orders (from ``seed``), each followed by its reverse."""
    orders: list[list[str]] = []
    generator = torch.Generator().manual_seed(seed)
    while len(orders) < count:
        if len(orders) % 2:
            orders.append(orders[-1][::-1])
        elif not orders:
            orders.append(list(groups))
        else:
            orders.append([groups[i] for i in torch.randperm(len(groups), generator=generator).tolist()])
    return orders


def passes_per_path(groups: int, orders: int) -> int:
    """The evaluations :func:`explain` makes on one path: the midpoint and both ends, then per
    order and end every group moved but the last (the last step lands on the midpoint)."""
    return 3 + orders * 2 * (groups - 1)


def capped_options(options: EvalOptions, all_eval_data: bool = False) -> EvalOptions:
    """How :func:`explain` batches its evaluation data: ``options``, capped at
    :data:`~hf_lmc.config.options.EXPLAIN_EVAL_BATCHES` batches unless they set ``max_batches``
    themselves or ``all_eval_data`` lifts the cap."""
    if all_eval_data or options.max_batches is not None:
        return options
    return options.model_copy(update={"max_batches": EXPLAIN_EVAL_BATCHES})


@dataclass(frozen=True)
class ExplainCost:
    """What :func:`explain` is about to do: ``passes`` evaluations of a model over the evaluation
    data's ``batches`` (``tokens`` tokens, or ``examples`` images), ``capped`` where the cap of
    :func:`capped_options` cut the data short."""

    paths: int
    groups: int
    orders: int
    batches: int
    examples: int
    tokens: int | None
    capped: bool

    @property
    def passes(self) -> int:
        return self.paths * passes_per_path(self.groups, self.orders)

    def describe(self) -> str:
        """One line: the passes, what each reads, and the cap."""
        size = f"{self.tokens:,} tokens" if self.tokens is not None else f"{self.examples:,} images"
        each = f"{self.batches} batches of the evaluation data ({size})"
        total = (
            f"{self.passes * self.tokens:,} tokens through the model in all"
            if self.tokens is not None
            else f"{self.passes * self.examples:,} images through the model in all"
        )
        cap = (
            "; only the first batches: --max-batches sets another count, --all-eval-data reads it all"
            if self.capped
            else ""
        )
        return (
            f"{self.passes} passes ({self.paths} path{'s' if self.paths > 1 else ''} x {passes_per_path(self.groups, self.orders)}: "
            f"the ends and the midpoint, then {self.orders} orders x 2 ends x {self.groups - 1} of {self.groups} groups "
            f"moved), each over {each}: {total}{cap}"
        )


def cost_of(
    config, names: Sequence[str], batches: Sequence[dict], method: str, orders: int, options: EvalOptions
) -> ExplainCost:
    """The :class:`ExplainCost` of explaining a model of ``config`` whose canonical tensors are
    ``names``, on ``batches`` made with ``options``."""
    groups = len({explanation_group(name) for name in names})
    examples = sum(len(next(iter(batch.values()))) for batch in batches)
    tokens = sum(batch["input_ids"].numel() for batch in batches) if batches and "input_ids" in batches[0] else None
    capped = options.max_batches == EXPLAIN_EVAL_BATCHES and len(batches) == options.max_batches
    return ExplainCost(1 if method == "average" else 2, groups, orders, len(batches), examples, tokens, capped)


def explain_cost(
    model_a,
    model_b,
    data,
    *,
    method: str = "weight",
    orders: int = ExplainOptions.model_fields["orders"].default,
    eval_options: EvalOptions = EVAL_OPTIONS,
    all_eval_data: bool = ExplainOptions.model_fields["all_eval_data"].default,
    revisions: Sequence[str | None] = (None, None),
) -> ExplainCost:
    """What :func:`explain` would cost on these models and data, read from their configs and the
    tokenized data alone (no weight is loaded): ``hf-lmc explain --dry-run``."""
    check_orders(orders)
    folders = [
        resolve_checkpoint(m, r) if isinstance(m, (str, Path)) else None for m, r in zip((model_a, model_b), revisions)
    ]
    configs = [read_config(f) if f is not None else m.config for m, f in zip((model_a, model_b), folders)]
    check_mergeable(*configs)
    options = capped_options(eval_options, all_eval_data)
    batches = load_batches(data, configs[0], folders[0], options)
    return cost_of(configs[0], spec_of(configs[0]).names(), batches, method, orders, options)


@dataclass
class Explanation:
    """Losses of the endpoints and midpoints, and per path (``"average"``, B as stored, and the method's) the
    parts of its excess for each order in :attr:`orders`."""

    loss_a: float
    loss_b: float
    orders: list[list[str]] = field(default_factory=list)  # the orders the groups were moved in
    midpoint: dict[str, float] = field(default_factory=dict)  # path -> L(mid)
    by_order: dict[str, list[dict[str, float]]] = field(default_factory=dict)  # path -> per order, group -> part

    @property
    def excess(self) -> dict[str, float]:
        """The midpoint's excess over the line, per path."""
        return {path: loss - (self.loss_a + self.loss_b) / 2 for path, loss in self.midpoint.items()}

    @property
    def parts(self) -> dict[str, dict[str, float]]:
        """Per path, each group's part of the excess: its mean over the orders (they sum to the excess)."""
        return {
            path: {g: statistics.fmean(o[g] for o in orders) for g in orders[0]}
            for path, orders in self.by_order.items()
        }

    @property
    def spread(self) -> dict[str, dict[str, tuple[float, float]]]:
        """Per path, each group's lowest and highest part over the orders: how much it interacts."""
        return {
            path: {g: (min(o[g] for o in orders), max(o[g] for o in orders)) for g in orders[0]}
            for path, orders in self.by_order.items()
        }

    def by_kind(self) -> dict[str, dict[str, float]]:
        """Parts summed over layers, per kind (QK, OV, MLP, embeddings, head), per path; they too
        sum to the excess."""
        totals: dict[str, dict[str, float]] = {}
        for path, parts in self.parts.items():
            for group, value in parts.items():
                kind = group.split()[-1]
                totals.setdefault(path, {}).setdefault(kind, 0.0)
                totals[path][kind] += value
        return totals

    def footer(self) -> str:
        """One line on how to read the parts, with each path's sum of parts beside its excess."""
        sums = ", ".join(f"{p} {sum(self.parts[p].values()):.4f} of {self.excess[p]:.4f}" for p in self.midpoint)
        orders = f"averaged over {len(self.orders)} orders of moving the groups from both ends"
        return f"Reading: {HOW_TO_READ} (sum of parts: {sums}); {orders}" + (
            ", range: lowest to highest over the orders." if len(self.orders) > 1 else "."
        )

    def table(self) -> str:
        """A markdown table: the total excess, then per group each path's part (nats) and, with
        several orders, its range over them; the footer says how to read it."""
        paths, spread = list(self.midpoint), self.spread
        ranged = len(self.orders) > 1
        header = "| group | " + " | ".join(f"{p}" + (f" | range, {p}" if ranged else "") for p in paths) + " |"
        rows = [header, "|---|" + ("---|---|" if ranged else "---|") * len(paths)]
        total = (f"**{self.excess[p]:.4f}**" + (" | " if ranged else "") for p in paths)
        rows.append("| **total excess** | " + " | ".join(total) + " |")
        for group in self.parts[paths[0]]:
            cells = []
            for p in paths:
                cells.append(f"{self.parts[p][group]:.4f}")
                if ranged:
                    cells.append("{:.4f} to {:.4f}".format(*spread[p][group]))
            rows.append(f"| {group} | " + " | ".join(cells) + " |")
        return "\n".join(rows) + "\n\n" + self.footer()

    def to_json(self) -> str:
        computed = {"excess": self.excess, "parts": self.parts, "spread": self.spread, "by_kind": self.by_kind()}
        return json.dumps({**asdict(self), **computed, "how_to_read": HOW_TO_READ}, indent=2)


def explain(
    model_a,
    model_b,
    data,
    *,
    method: str = "weight",
    symmetries=DEFAULT_SYMMETRIES,
    orders: int = ExplainOptions.model_fields["orders"].default,
    eval_options: EvalOptions = EVAL_OPTIONS,
    fit_data=None,
    fit_options: EvalOptions = FIT_OPTIONS,
    learn: LearnOptions = LearnOptions(),
    all_eval_data: bool = ExplainOptions.model_fields["all_eval_data"].default,
    announce: Callable[[ExplainCost], None] | None = None,
    progress: bool = True,
) -> Explanation:
    """Split the midpoint excess of the average's path (and, unless ``method`` is ``"average"``,
    of the path ``method`` aligns) into parts per group of tensors, averaged over ``orders``
    orders of moving the groups; see the module's text.

    Models are HF model instances, local folders or Hub ids; ``data`` is held-out data and
    ``fit_data`` feeds the data-driven methods, as for :func:`hf_lmc.barrier`. Each order costs
    two evaluations per group and path, each over the evaluation data: unless ``eval_options``
    set ``max_batches`` or ``all_eval_data`` is true, only its first
    :data:`~hf_lmc.config.options.EXPLAIN_EVAL_BATCHES` batches are read (:func:`capped_options`).
    ``announce`` is called with the cost (:class:`ExplainCost`) before the first evaluation.
    """
    check_orders(orders)
    check_method(method, fit_data, data_parameter="fit_data")
    logger.info("loading the two models")
    a, b = load_model(model_a), load_model(model_b)
    check_mergeable(a.model.config, b.model.config)
    options = capped_options(eval_options, all_eval_data)
    batches = load_batches(data, a.model.config, a.folder, options)
    canonical_a, canonical_b = canonicalize(a.model), canonicalize(b.model)
    state_a = canonical_a.state_dict()
    cost = cost_of(a.model.config, list(state_a), batches, method, orders, options)
    logger.info("explaining: %s", cost.describe())
    if announce is not None:
        announce(cost)
    dtype = next(iter(state_a.values())).dtype
    ends = {"average": (state_a, canonical_b.state_dict())}
    if method != "average":
        logger.info("aligning the models: %s matching", method)
        fit_batches = (
            fitting_batches(
                fit_data, a.model.config, a.folder, fit_options, models=[a.model, b.model], progress=progress
            )
            if METHODS[method].needs_data
            else None
        )
        t_a, t_b = align_many(
            method,
            [canonical_a, canonical_b],
            symmetries=symmetries,
            batches=fit_batches,
            learn=learn,
            progress=progress,
        )
        # dual matching moves A too: its path runs between T_A(A), which computes what A does, and T_B(B)
        moved_a = t_a.to(dtype).apply(canonical_a).state_dict() if t_a.maps else state_a
        ends[method] = (moved_a, t_b.to(dtype).apply(canonical_b).state_dict())

    def loss(state: dict[str, torch.Tensor]) -> float:
        return evaluate(to_hf(from_state_dict(canonical_a.spec, canonical_a.config, state)), batches).loss

    groups: dict[str, list[str]] = {}
    for name in state_a:
        groups.setdefault(explanation_group(name), []).append(name)
    result = Explanation(0.0, 0.0, orders=orders_of(list(groups), orders))
    steps_per_path = passes_per_path(len(groups), len(result.orders))
    bar = progress_bar(total=len(ends) * steps_per_path, desc="explaining the barrier", show=progress)
    for path, (start, end) in ends.items():
        logger.info("%s path: moving %d groups to the midpoint in %d orders", path, len(groups), len(result.orders))
        middle = {k: torch.lerp(start[k], end[k], 0.5) for k in start}
        result.midpoint[path] = loss(middle)
        end_losses = (loss(start), loss(end))  # a symmetry moved them: L(A) and L(B) up to rounding
        if path == "average":
            result.loss_a, result.loss_b = end_losses
        bar.update(3)
        result.by_order[path] = []
        for order in result.orders:
            parts = dict.fromkeys(order, 0.0)
            for side, side_loss in zip((start, end), end_losses):
                state, before = dict(side), side_loss
                for i, group in enumerate(order):
                    state.update({k: middle[k] for k in groups[group]})
                    after = result.midpoint[path] if i == len(order) - 1 else loss(state)
                    parts[group] += (after - before) / 2
                    before = after
                bar.update(len(order) - 1)
            result.by_order[path].append(parts)
    bar.close()
    return result


def plot_explanation(
    result: Explanation,
    path: str | Path,
    title: str = "where the midpoint's excess comes from",
    *,
    overwrite: bool = False,
) -> Path:
    """Save a figure: per path, a signed horizontal bar per group (its part, nats, with its range
    over the orders) under a reference bar for the total excess, a zero line, and how to read it;
    written as :func:`hf_lmc.evaluation.barriers.plot` writes (:func:`hf_lmc.io.outputs.save_figure`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = list(result.midpoint)
    parts, spread = result.parts, result.spread
    labels = ["total excess", *parts[paths[0]]]
    height = 0.8 / len(paths)
    fig, ax = plt.subplots(figsize=(7, 1.6 + 0.22 * len(labels) * len(paths) ** 0.5), dpi=120)
    for i, name in enumerate(paths):
        values = [result.excess[name], *parts[name].values()]
        rows = [r + (i - (len(paths) - 1) / 2) * height for r in range(len(labels))]
        colour = f"C{i}"
        bars = ax.barh(rows, values, height, color=colour, label=f"{name} (excess {result.excess[name]:.3f} nats)")
        bars[0].set_hatch("//")
        bars[0].set_edgecolor("black")
        if len(result.orders) > 1:
            low = [parts[name][g] - spread[name][g][0] for g in labels[1:]]
            high = [spread[name][g][1] - parts[name][g] for g in labels[1:]]
            ax.errorbar(values[1:], rows[1:], xerr=[low, high], fmt="none", ecolor="black", elinewidth=0.6, capsize=1.5)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.axhline(0.5, color="grey", linewidth=0.5, linestyle=":")
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()  # the total on top, then the groups from input to output
    ax.set_xlabel("part of the midpoint's excess (nats); positive = adds to the barrier")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="best")
    whiskers = f"; whiskers: range over {len(result.orders)} orders" if len(result.orders) > 1 else ""
    reading = f"How to read: {HOW_TO_READ} (the hatched bar){whiskers}."
    fig.text(0.01, 0.005, reading, fontsize=6, wrap=True, va="bottom")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path = Path(path)
    try:
        return save_figure(fig, path, overwrite=overwrite)
    finally:
        plt.close(fig)


def kinds_table(result: Explanation, paths: Sequence[str] | None = None) -> str:
    """A markdown table of the parts summed per kind (QK, OV, MLP, embeddings, head), with the
    total excess they add up to."""
    totals = result.by_kind()
    paths = list(paths or totals)
    kinds = list(totals[paths[0]])
    rows = ["| kind | " + " | ".join(paths) + " |", "|---|" + "---|" * len(paths)]
    rows.append("| **total excess** | " + " | ".join(f"**{result.excess[p]:.4f}**" for p in paths) + " |")
    rows += [f"| {kind} | " + " | ".join(f"{totals[p][kind]:.4f}" for p in paths) + " |" for kind in kinds]
    return "\n".join(rows)
