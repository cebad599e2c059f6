"""``hf-lmc inspect``: a pre-flight that says which merge fits, before any merge runs.

:func:`inspect_models` reads the models' configs and tensor headers, runs the merge's own
checks on them (:func:`hf_lmc.merging.pipeline._read_models`, which refuses what a merge refuses), and
streams both models once through their canonical forms, one layer at a time, comparing them
tensor by tensor. No model is loaded whole and nothing is trained or written. It reports:

* each model's architecture and :class:`~hf_lmc.canonical.spec.ArchSpec`, and every config difference
  that refuses the merge (the keys :func:`~hf_lmc.canonical.adapters.setting_differences` names and the
  spec fields no width embedding covers, :mod:`hf_lmc.canonical.widths`), with the merge's own message;
* how alike the weights are: per group (embeddings, each layer, head) the cosine similarity of
  the canonical tensors that carry a symmetry axis, and the inner products between the rows of
  the embedding and head matrices (tokens, positions, labels), which every function-preserving
  symmetry keeps (its residual maps are orthogonal). Similar weights everywhere (:data:`FINE_TUNE_COSINE`) mean fine-tunes of one
  base: alignment is the identity and a plain average (or mergekit's task-arithmetic family)
  is the tool. Unrelated weights with the same inner products (:data:`SAME_GRAM`) mean one model
  moved by a symmetry, which weight matching undoes exactly; unrelated weights with other ones
  mean independent trainings, which alignment is for (docs/inspect.md gives the measurements
  the thresholds come from);
* the symmetry groups that apply to the architecture;
* each method's estimated time and peak memory (:func:`hf_lmc.merging.pipeline.estimate_cost`, the
  model of ``merge --dry-run``), with the default amount of fitting data for the methods that
  read some; on a GPU too when torch sees one;
* the command to run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_lmc.canonical.adapters import adapter_for, read_config, setting_differences
from hf_lmc.canonical.form import block_rows, canonicalize
from hf_lmc.canonical.spec import ArchSpec, spec_differences
from hf_lmc.canonical.widths import WIDTH_FIELDS
from hf_lmc.commands.common import (
    model_revisions,
)
from hf_lmc.config.methods import METHODS
from hf_lmc.config.options import (
    DEFAULT_SYMMETRIES,
    FIT_OPTIONS,
    LearnOptions,
    MergeRequest,
    UsageError,
    clipped,
    revisions_per_model,
)
from hf_lmc.evaluation.batches import sampled_count
from hf_lmc.io.checkpoint import Checkpoint
from hf_lmc.io.export import stored_dtype
from hf_lmc.io.hub import resolve_checkpoint
from hf_lmc.merging.pipeline import (
    _counted,
    _duration,
    _gigabytes,
    _read_models,
    _sequence_tokens,
    estimate_cost,
)
from hf_lmc.symmetry import axes_of, resolve_kinds
from hf_lmc.utils.progress import bar as progress_bar

logger = logging.getLogger(__name__)

#: The smallest per-group cosine similarity at which two models read as fine-tunes of one base,
#: chosen in the gap between fine-tunes and unrelated pairs (docs/decisions.md#d-inspect-thresholds).
FINE_TUNE_COSINE = 0.5
#: The largest relative distance between the Gram matrices of the embedding and head rows at
#: which unrelated-looking weights read as one model moved by a symmetry: float32 rounding
#: against separate trainings (docs/decisions.md#d-inspect-thresholds).
SAME_GRAM = 1e-3
#: A rough rate of the passes over data on a GPU, in FLOP/s: one H100's forward and backward of
#: Pythia-160M, as the record learned_step-20261127 measured it (docs/results.md).
GPU_FLOPS = 5.1e13

RELATIONS = {
    "fine-tunes": "fine-tunes of one base: alignment is the identity, a plain average fits",
    "twins": "one model moved by a function-preserving symmetry: weight matching undoes it exactly",
    "independent": "independent trainings: alignment is what makes their average work",
    "different widths": "models of two widths (independent trainings): aligned at the wider shape",
}


@dataclass(frozen=True)
class ModelFacts:
    """One model as inspect read it: the reference given, its family, size and spec."""

    reference: str
    revision: str | None
    model_type: str
    parameters: int
    dtype: str
    spec: ArchSpec


@dataclass(frozen=True)
class Similarity:
    """How alike one model's weights are to the first's, compared group by group in canonical form.

    ``groups`` holds ``(group, cosine, relative distance)`` per group (``"embed"``, a layer's
    index as text, ``"head"``) over the tensors that carry a symmetry axis; ``gram`` is the
    relative distance between the Gram matrices of the embedding and head rows.
    """

    model: str
    groups: tuple[tuple[str, float, float], ...]  # none for models of two widths: no tensor pairs up
    gram: float | None
    relation: str

    @property
    def lowest(self) -> float | None:
        return min(cosine for _, cosine, _ in self.groups) if self.groups else None

    @property
    def median(self) -> float | None:
        return statistics.median(cosine for _, cosine, _ in self.groups) if self.groups else None


@dataclass(frozen=True)
class MethodCost:
    """A method's estimated time and peak memory (``gpu_seconds`` only where torch sees a GPU)."""

    method: str
    data: str
    seconds: float
    peak_bytes: int
    gpu_seconds: float | None = None


@dataclass(frozen=True)
class Report:
    """What :func:`inspect_models` found; :meth:`table` is what ``hf-lmc inspect`` prints and
    :meth:`to_json` the same facts for scripts."""

    models: tuple[ModelFacts, ...]
    mergeable: bool
    refusal: str | None  # the merge's own one-line refusal
    differences: tuple[str, ...]  # every config difference that refuses the merge, "model: key a vs b"
    notes: tuple[str, ...]  # what the merge would note (widths, inherited files) when it is allowed
    symmetries: str
    groups: tuple[tuple[str, str], ...]  # (kind, what it is on this architecture)
    similarities: tuple[Similarity, ...]
    relation: str | None
    costs: tuple[MethodCost, ...]
    recommended: str | None
    reason: str
    seconds: float  # how long the inspection took

    def to_dict(self) -> dict:
        facts = dataclasses.asdict(self)
        for similarity, entry in zip(self.similarities, facts["similarities"]):
            entry["lowest"], entry["median"] = similarity.lowest, similarity.median
            entry["groups"] = [{"group": g, "cosine": c, "distance": d} for g, c, d in similarity.groups]
        facts["groups"] = [{"kind": kind, "group": text} for kind, text in self.groups]
        return facts

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        lines = [
            f"inspect: {len(self.models)} models; configs and headers read, weights streamed once; nothing written"
        ]
        for k, model in enumerate(self.models):
            s = model.spec
            lines.append(
                f"  {_letter(k)}: {model.reference} ({model.model_type}, {_counted(model.parameters)} parameters, "
                f"{model.dtype})"
            )
            lines.append(
                f"     {s.num_layers} layers, hidden {s.hidden_size}, {s.num_heads} heads ({s.num_kv_heads} KV) of "
                f"{s.head_dim}, MLP {s.intermediate_size}{' gated' if s.gated_mlp else ''}, output {s.output_size}, "
                f"{s.norm}, rotary {s.rotary_dim}"
            )
        if self.mergeable:
            lines.append("  merge: allowed")
        else:
            lines.append(f"  merge: refused: {self.refusal}")
        lines += [f"     differs: {d}" for d in self.differences]
        lines += [f"     note: {n}" for n in self.notes]
        lines.append(f"  symmetry groups ({self.symmetries}):")
        lines += [f"     {kind}: {text}" for kind, text in self.groups]
        for sim in self.similarities:
            if not sim.groups:
                lines.append(f"  {sim.model} against A: {RELATIONS[sim.relation]}")
                continue
            lines.append(f"  {sim.model} against A (cosine per group of canonical tensors; 1 = the same weights):")
            lines.append("     " + "  ".join(f"{_shown_group(g)} {c:.3f}" for g, c, _ in sim.groups))
            lines.append(
                f"     lowest {sim.lowest:.3f}, median {sim.median:.3f}; the Gram matrices of the embedding and head rows "
                f"differ by {sim.gram:.1e}"
            )
            lines.append(f"     reads as {RELATIONS[sim.relation]}")
        if self.costs:
            gpu = any(c.gpu_seconds is not None for c in self.costs)
            lines.append("  estimates (scaled from 2 CPU cores, docs/decisions.md#d-dry-run-estimates):")
            lines.append(
                f"     {'method':<11} {'data':<40} {'time':>8} {'peak memory':>12}" + ("  on a GPU" if gpu else "")
            )
            for c in self.costs:
                row = f"     {c.method:<11} {c.data:<40} {'~' + _duration(c.seconds):>8} {'~' + _gigabytes(c.peak_bytes):>12}"
                lines.append(row + (f"  ~{_duration(c.gpu_seconds)}" if c.gpu_seconds is not None else ""))
        lines.append(f"  recommended: {self.recommended}" if self.recommended else "  recommended: no merge")
        lines.append(f"     ({self.reason})")
        return "\n".join(lines)


def _shown_group(group: str) -> str:
    return f"L{group}" if group.isdigit() else group


def _letter(k: int) -> str:
    return chr(ord("A") + k) if k < 26 else f"model {k + 1}"


def inspect_models(
    models: Sequence[str | Path],
    *,
    revisions: Sequence[str | None] | None = None,
    symmetries: str = DEFAULT_SYMMETRIES,
    progress: bool = True,
) -> Report:
    """Inspect two or more models (local folders or Hub ids, each at its revision) for a merge
    with the first: the facts of :class:`Report` (``progress``: a bar per model compared). A reference that names no model, or a folder
    whose weights do not match its config, raises as the merge would; a pair the merge refuses is
    reported (``mergeable`` false), not raised."""
    start = time.perf_counter()
    if len(models) < 2:
        raise ValueError(f"inspect needs at least 2 models, got {len(models)}")
    models = [str(m) for m in models]
    revisions = revisions_per_model(revisions, len(models))
    kinds = resolve_kinds(symmetries)
    logger.info("reading the configs and tensor headers of %d models", len(models))
    folders = [resolve_checkpoint(m, r) for m, r in zip(models, revisions)]
    configs = [read_config(f) for f in folders]
    facts = []
    for model, revision, folder, config in zip(models, revisions, folders, configs):
        adapter = adapter_for(config)
        Checkpoint(folder, adapter, config).close()  # every tensor present and shaped as the config says
        with torch.device("meta"):
            parameters = sum(p.numel() for p in adapter.model_class(config).parameters())
        dtype = str(stored_dtype(config)).removeprefix("torch.")
        facts.append(ModelFacts(model, revision, config.model_type, parameters, dtype, adapter.spec(config)))
    request = MergeRequest(models=models, output="unused", revisions=revisions)
    try:
        _, _, width_notes, inherited = _read_models(request, revisions, [])
        refusal, notes = None, tuple(width_notes) + tuple(inherited)
    except ValueError as err:
        refusal, notes = str(err), ()
    differences = tuple(_differences(configs, [f.spec for f in facts]))
    similarities = ()
    if refusal is None:
        logger.info("comparing the weights of each model with A's, a layer at a time")
        similarities = tuple(
            _similarity(folders[0], folders[k], _letter(k), progress=progress)
            if facts[k].spec == facts[0].spec
            else Similarity(_letter(k), (), None, "different widths")
            for k in range(1, len(folders))
        )
    relation = _overall(similarities) if refusal is None else None
    logger.info("estimating each method's time and memory")
    costs = () if refusal is not None else tuple(_costs(facts, configs[0]))
    recommended, reason = _recommend(models, revisions, symmetries, relation, refusal, costs)
    return Report(
        tuple(facts),
        refusal is None,
        refusal,
        differences,
        notes,
        symmetries,
        tuple(symmetry_groups(facts[0].spec, kinds)),
        similarities,
        relation,
        costs,
        recommended,
        reason,
        time.perf_counter() - start,
    )


def _differences(configs: Sequence, specs: Sequence[ArchSpec]) -> list[str]:
    """Every config difference between the first model and each other that refuses a merge: the
    family, the keys :func:`setting_differences` names, the spec fields besides the widths."""
    found = []
    for k in range(1, len(configs)):
        a, b, who = configs[0], configs[k], f"A vs {_letter(k)}"
        if a.model_type != b.model_type:
            found.append(f"{who}: model_type {a.model_type} vs {b.model_type}")
            continue
        found += [
            f"{who}: {key} {clipped(getattr(a, key, None))} vs {clipped(getattr(b, key, None))}"
            for key in setting_differences(a, b)
        ]
        found += [f"{who}: {d}" for d in spec_differences(specs[0], specs[k]) if d.split(" ", 1)[0] not in WIDTH_FIELDS]
    return found


#: Canonical tensors whose rows' inner products every symmetry keeps: one residual axis, the
#: other axes (tokens, positions, pixels, labels) fixed.
_INVARIANT_ROWS = ("embed.tokens", "embed.positions", "embed.patch.weight", "head.weight")
#: Rows of each of them compared, evenly spaced (a few seconds at any vocabulary).
_GRAM_ROWS = 1024


def _similarity(folder_a: Path, folder_b: Path, name: str, *, progress: bool = False) -> Similarity:
    """B's weights against A's, one canonical layer of each in memory at a time, and the
    embeddings and head a block of token rows at a time (as the export streams them)."""
    a, b = canonicalize(folder_a, dtype=torch.float32), canonicalize(folder_b, dtype=torch.float32)
    spec, rows, gram = a.spec, [], [0.0, 0.0]
    token_rows = spec.token_row_names()
    try:
        for group in progress_bar(spec.groups(), show=progress, desc=f"comparing {name} with A", unit="group"):
            dot = norm_a = norm_b = distance = 0.0
            picked: dict[str, tuple[list, list]] = {}  # the Gram rows of each tensor, gathered block by block
            for k, block in enumerate(spec.row_blocks(group, block_rows(spec)) or [None]):
                ta, tb = a.group(group, block), b.group(group, block)
                for tensor in list(ta):
                    x, y = ta.pop(tensor), tb.pop(tensor)
                    blocked = block is not None and tensor in token_rows
                    if k > 0 and not blocked:  # whole in every block: counted in the first
                        continue
                    if tensor in _INVARIANT_ROWS:
                        ra, rb = (_rows(t, tensor) for t in (x, y))
                        total = spec.output_size if blocked else len(ra)
                        chosen = _gram_rows(total) - (block.start if blocked else 0)
                        chosen = chosen[(chosen >= 0) & (chosen < len(ra))]
                        lists = picked.setdefault(tensor, ([], []))
                        lists[0].append(ra[chosen].double())
                        lists[1].append(rb[chosen].double())
                    if all(axis is None for axis in axes_of(tensor)):  # no symmetry acts on it (a head bias)
                        continue
                    x, y = x.flatten(), y.flatten()
                    difference = x - y
                    dot += float(torch.dot(x, y))
                    norm_a += float(torch.dot(x, x))
                    norm_b += float(torch.dot(y, y))
                    distance += float(torch.dot(difference, difference))
            for matrices_a, matrices_b in picked.values():
                ga, gb = (_products(torch.cat(m), spec) for m in (matrices_a, matrices_b))
                gram[0] += float((ga - gb).square().sum())
                gram[1] += float(ga.square().sum())
            cosine = dot / (norm_a * norm_b) ** 0.5 if norm_a and norm_b else 1.0
            rows.append((str(group), cosine, (distance / norm_a) ** 0.5 if norm_a else 0.0))
    finally:
        for model in (a, b):
            model.source.close()
    gram_distance = (gram[0] / gram[1]) ** 0.5 if gram[1] else 0.0
    lowest = min(cosine for _, cosine, _ in rows)
    if lowest >= FINE_TUNE_COSINE:
        relation = "fine-tunes"
    elif gram_distance <= SAME_GRAM:
        relation = "twins"
    else:
        relation = "independent"
    return Similarity(name, tuple(rows), gram_distance, relation)


def _rows(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """``tensor`` as a (rows x residual) matrix: a symmetry acts on the residual axis alone."""
    axis = next(k for k, a in enumerate(axes_of(name)) if a is not None and a[0] == "residual")
    return tensor.movedim(axis, -1).reshape(-1, tensor.shape[axis])


def _gram_rows(count: int) -> torch.Tensor:
    """The rows of ``count`` compared: all, or :data:`_GRAM_ROWS` evenly spaced."""
    if count <= _GRAM_ROWS:
        return torch.arange(count)
    return torch.linspace(0, count - 1, _GRAM_ROWS).round().long()


def _products(matrix: torch.Tensor, spec: ArchSpec) -> torch.Tensor:
    """The inner products between the rows of ``matrix`` (float64): a symmetry moves the residual
    axis by an orthogonal map, so they are the same for the model and for every copy of it a
    symmetry moves. A centred stream's part along the all-ones direction is left out first: the
    stream never reaches it (the export may store a head's there), and no symmetry keeps it."""
    if spec.centred:
        matrix = matrix - matrix.mean(dim=1, keepdim=True)
    return matrix @ matrix.T


def _overall(similarities: Sequence[Similarity]) -> str:
    """One relation for the whole set: fine-tunes only if every model is one of the first's base."""
    relations = {s.relation for s in similarities}
    if relations == {"fine-tunes"}:
        return "fine-tunes"
    if relations == {"twins"}:
        return "twins"
    return "different widths" if "different widths" in relations else "independent"


def _costs(facts: Sequence[ModelFacts], config) -> list[MethodCost]:
    """Every method that takes this many models, estimated as ``merge --dry-run`` does with no
    evaluation data and, for the methods that fit on data, the default amount of it (as many
    sequences as ``--data sampled`` draws, of the default length)."""
    count = len(facts)
    parameters = [f.parameters for f in facts]
    stored = [f.parameters * getattr(torch, f.dtype).itemsize for f in facts]
    sequences = sampled_count(FIT_OPTIONS)
    tokens = sequences * _sequence_tokens(config, FIT_OPTIONS)
    fit = (-(-sequences // FIT_OPTIONS.batch_size), tokens)
    steps = LearnOptions().steps
    gpu = torch.cuda.is_available()
    costs = []
    for method, entry in METHODS.items():
        if count > 2 and not entry.multi:
            continue
        data = "none"
        if entry.needs_data:
            data = f"{sequences} sequences of {tokens // sequences} tokens"
            data += f", {steps} steps" if entry.trained else ""
        options = {"fit_batches": fit, "steps": steps}
        seconds, peak = estimate_cost(method, parameters, stored, **options)
        gpu_seconds = estimate_cost(method, parameters, stored, flops=GPU_FLOPS, **options)[0] if gpu else None
        costs.append(MethodCost(method, data, seconds, peak, gpu_seconds))
    return costs


def _recommend(models, revisions, symmetries, relation, refusal, costs) -> tuple[str | None, str]:
    """The command to run, and why."""
    if refusal is not None:
        return None, "the merge refuses these models; see the differences above"
    command = ["hf-lmc", "merge", *models, "--output", "./merged"]
    if any(r is not None for r in revisions):
        command += ["--revisions", *("-" if r is None else r for r in revisions)]
    if relation == "fine-tunes":
        return shlex.join([*command, "--method", "average"]), (
            "fine-tunes of one base: their weights agree layer by layer, so the plain average needs no alignment "
            "(mergekit's task arithmetic, TIES or DARE fit too)"
        )
    if symmetries != DEFAULT_SYMMETRIES:
        command += ["--symmetries", symmetries]
    trained = next((c for c in costs if c.method == "dual"), None)
    further = (
        f"; with data at hand, --method dual --data TEXT flattens the path further (~{_duration(trained.seconds)})"
        if trained
        else ""
    )
    if relation == "twins":
        return shlex.join(command), "one model moved by a symmetry: weight matching (the default) undoes it exactly"
    return shlex.join(command), f"{RELATIONS[relation]}; weight matching (the default) needs no data{further}"


def symmetry_groups(spec: ArchSpec, kinds: frozenset[str]) -> list[tuple[str, str]]:
    """Each symmetry kind of ``kinds`` (docs/design.md §3) as it acts on ``spec``'s architecture,
    or why it does not apply."""
    d, kv, g, dh, r, f = (
        spec.hidden_size,
        spec.num_kv_heads,
        spec.group_size,
        spec.head_dim,
        spec.rotary_dim,
        spec.intermediate_size,
    )
    described = {
        "residual": f"an orthogonal map of the {d}-dimensional residual stream"
        + (" fixing the all-ones direction (the stream is centred)" if spec.centred else ""),
        "residual_permutation": f"a permutation of the {d} residual coordinates",
        "heads": f"per layer, a permutation of the {kv} KV heads"
        + (f" and of the {g} query heads sharing each" if g > 1 else ""),
        "qk": (
            f"per layer and KV head, an invertible {dh}x{dh} map between queries and keys"
            if r == 0
            else f"per layer and KV head, a scaled rotation of each of the {r // 2} rotary pairs"
            + (f" and an invertible {dh - r}x{dh - r} map of the other dimensions" if dh > r else "")
        ),
        "ov": f"per layer and KV head, an invertible {dh}x{dh} map between values and the output projection",
        "mlp": f"per layer, a permutation of the {f} MLP units",
        "mlp_scale": f"per layer, a sign and scale of each of the {f} SwiGLU units"
        if spec.gated_mlp
        else "does not apply: the MLP is not gated",
    }
    return [(kind, described[kind]) for kind in sorted(kinds, key=list(described).index)]


# -- the command ------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    count = len(args.models)
    if count < 2:
        raise UsageError(f"inspect needs at least 2 models, got {count}")
    revisions = model_revisions(args, count)
    report = inspect_models(args.models, revisions=revisions, symmetries=args.symmetries)
    print(report.to_json() if args.json else report.table())
    return 0
