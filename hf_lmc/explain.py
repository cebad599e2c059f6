"""Where a barrier comes from: the midpoint's excess attributed to groups of tensors.

The midpoint of the path ``mid = (T_A(A) + T_B(B)) / 2`` stands ``E = L(mid) - (L(A) + L(B)) / 2``
above the line between the endpoints (its excess). :func:`explain` interpolates one group of
canonical tensors at a time (the embeddings; per layer the attention's query-key pair (QK), its
value-output pair (OV) and the MLP; the head), in two ways:

* **alone**: every other group held at A, the group at its midpoint value:
  ``L(A with g at mid) - L(A)``, the loss that interpolating this group by itself adds;
* **knock-out**: every other group at the midpoint, the group held at A's value:
  ``L(mid) - L(mid with g at A)``, the loss the midpoint would lose if this group needed no
  interpolating.

Both are measured on the vanilla path (B as stored) and, with a method, on the aligned one, so a
table shows which groups the alignment fixes and which it leaves. The work happens in canonical
form, where norms are folded into the tensors that read them (docs/design.md §2): their gains
travel with the QK, OV, MLP and head groups, and there is no separate norm group. Every point
is a stock HF model (:func:`hf_lmc.canonical.to_hf`), so the losses are those the exported
models compute.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .alignment import align_many
from .canonical import canonicalize, from_state_dict, to_hf
from .evaluation import evaluate, fitting_batches, load_batches
from .loading import load_model
from .methods import METHODS, check_method
from .options import EVAL_OPTIONS, FIT_OPTIONS, EvalOptions, LearnOptions
from .progress import bar as progress_bar
from .widths import check_mergeable

#: Canonical tensor name -> group kind (the layer index is added in front for layer tensors).
_KINDS = (("attn.q.", "QK"), ("attn.k.", "QK"), ("attn.v.", "OV"), ("attn.o.", "OV"), ("mlp.", "MLP"))


def group_of(name: str) -> str:
    """The explanation group of a canonical tensor: ``embeddings``, ``head``, or ``layer i KIND``."""
    layer = re.match(r"layers\.(\d+)\.(.*)", name)
    if layer is None:
        return "head" if name.startswith("head") else "embeddings"
    kind = next((k for prefix, k in _KINDS if layer.group(2).startswith(prefix)), layer.group(2).split(".")[0])
    return f"layer {layer.group(1)} {kind}"


@dataclass
class Explanation:
    """Losses of the endpoints and midpoints, and per group the alone and knock-out effects on
    each path (``"vanilla"`` and the method's)."""

    loss_a: float
    loss_b: float
    midpoint: dict[str, float] = field(default_factory=dict)  # path -> L(mid)
    alone: dict[str, dict[str, float]] = field(default_factory=dict)  # path -> group -> effect
    knockout: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def excess(self) -> dict[str, float]:
        """The midpoint's excess over the line, per path."""
        return {path: loss - (self.loss_a + self.loss_b) / 2 for path, loss in self.midpoint.items()}

    def table(self) -> str:
        """A markdown table: per group, each path's alone and knock-out effect (nats), and the
        total excess on top."""
        paths = list(self.midpoint)
        header = "| group | " + " | ".join(f"alone, {p} | knock-out, {p}" for p in paths) + " |"
        rows = [header, "|---|" + "---|---|" * len(paths)]
        rows.append("| **midpoint excess** | " + " | ".join(f"**{self.excess[p]:.4f}** | " for p in paths) + "|")
        for group in self.alone[paths[0]]:
            rows.append(f"| {group} | " + " | ".join(f"{self.alone[p][group]:.4f} | {self.knockout[p][group]:.4f}" for p in paths) + " |")
        return "\n".join(rows)

    def by_kind(self) -> dict[str, dict[str, float]]:
        """Knock-out effects summed over layers, per kind (QK, OV, MLP, embeddings, head), per path."""
        totals: dict[str, dict[str, float]] = {}
        for path, effects in self.knockout.items():
            for group, value in effects.items():
                kind = group.split()[-1]
                totals.setdefault(path, {}).setdefault(kind, 0.0)
                totals[path][kind] += value
        return totals

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "excess": self.excess, "by_kind": self.by_kind()}, indent=2)


def explain(
    model_a,
    model_b,
    data,
    *,
    method: str = "weight",
    symmetries="full",
    eval_options: EvalOptions = EVAL_OPTIONS,
    fit_data=None,
    fit_options: EvalOptions = FIT_OPTIONS,
    learn: LearnOptions = LearnOptions(),
    progress: bool = True,
) -> Explanation:
    """Attribute the midpoint excess of the vanilla path (and, unless ``method`` is
    ``"average"``, of the path ``method`` aligns) to groups of tensors; see the module's text.

    Models are HF model instances, local folders or Hub ids; ``data`` is held-out data and
    ``fit_data`` feeds the data-driven methods, as for :func:`hf_lmc.barrier`.
    """
    check_method(method, fit_data, data_parameter="fit_data")
    a, b = load_model(model_a), load_model(model_b)
    check_mergeable(a.model.config, b.model.config)
    batches = load_batches(data, a.model.config, a.folder, eval_options)
    canonical_a, canonical_b = canonicalize(a.model), canonicalize(b.model)
    state_a = canonical_a.state_dict()
    dtype = next(iter(state_a.values())).dtype
    ends = {"vanilla": (state_a, canonical_b.state_dict())}
    if method != "average":
        fit_batches = (
            fitting_batches(fit_data, a.model.config, a.folder, fit_options, models=[a.model, b.model], progress=progress)
            if METHODS[method].needs_data else None
        )
        t_a, t_b = align_many(method, [canonical_a, canonical_b], symmetries=symmetries, batches=fit_batches, learn=learn, progress=progress)
        # dual matching moves A too: its path runs between T_A(A), which computes what A does, and T_B(B)
        moved_a = t_a.to(dtype).apply(canonical_a).state_dict() if t_a.maps else state_a
        ends[method] = (moved_a, t_b.to(dtype).apply(canonical_b).state_dict())

    def loss(state: dict[str, torch.Tensor]) -> float:
        return evaluate(to_hf(from_state_dict(canonical_a.spec, canonical_a.config, state)), batches).loss

    groups: dict[str, list[str]] = {}
    for name in state_a:
        groups.setdefault(group_of(name), []).append(name)
    bar = progress_bar(total=2 + len(ends) * (1 + 2 * len(groups)), desc="explaining the barrier", show=progress)
    result = Explanation(loss(state_a), loss(ends["vanilla"][1]))
    bar.update(2)
    for path, (start, end) in ends.items():
        middle = {k: torch.lerp(start[k], end[k], 0.5) for k in start}
        result.midpoint[path] = loss(middle)
        bar.update()
        result.alone[path], result.knockout[path] = {}, {}
        for group, names in groups.items():
            result.alone[path][group] = loss({**start, **{k: middle[k] for k in names}}) - result.loss_a
            result.knockout[path][group] = result.midpoint[path] - loss({**middle, **{k: start[k] for k in names}})
            bar.update(2)
    bar.close()
    return result


def plot_explanation(result: Explanation, path: str | Path, title: str = "where the midpoint's excess comes from") -> Path:
    """Save a PNG: one bar per group and path, its knock-out effect (nats)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = list(result.knockout)
    groups = list(result.knockout[paths[0]])
    fig, ax = plt.subplots(figsize=(max(5, 0.35 * len(groups) + 2), 3.5), dpi=120)
    width = 0.8 / len(paths)
    for i, name in enumerate(paths):
        ax.bar([g + i * width for g in range(len(groups))], [result.knockout[name][g] for g in groups], width,
               label=f"{name} (excess {result.excess[name]:.3f})")
    ax.set_xticks([g + width * (len(paths) - 1) / 2 for g in range(len(groups))], groups, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("knock-out effect (nats)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def kinds_table(result: Explanation, paths: Sequence[str] | None = None) -> str:
    """A markdown table of the knock-out effects summed per kind (QK, OV, MLP, embeddings, head)."""
    totals = result.by_kind()
    paths = list(paths or totals)
    kinds = list(totals[paths[0]])
    rows = ["| kind | " + " | ".join(paths) + " |", "|---|" + "---|" * len(paths)]
    rows += [f"| {kind} | " + " | ".join(f"{totals[p][kind]:.4f}" for p in paths) + " |" for kind in kinds]
    return "\n".join(rows)
