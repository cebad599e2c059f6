"""The canonical form (docs/design.md §2) and the exact round trip to stock Hugging Face models.

A :class:`CanonicalModel` is an architecture spec, the source's HF config, and a function from
*group* (``"embed"``, a layer index, ``"head"``) to that group's canonical tensors. Groups are
computed on demand, so a model backed by a safetensors folder materialises one layer at a
time, and transforms / interpolations compose lazily on top without copying the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from transformers import PretrainedConfig, PreTrainedModel

from hf_lmc.canonical.adapters import Adapter, UnsupportedModelError, adapter_for, read_config
from hf_lmc.canonical.spec import ArchSpec, Group, group_of
from hf_lmc.io.checkpoint import Checkpoint, all_finite
from hf_lmc.io.weights import CheckpointError

#: ``(group, rows)`` -> the group's canonical tensors; ``rows`` (a slice or None for all)
#: restricts the tensors with one row per vocabulary token (see ``ArchSpec.token_row_names``).
GroupLoader = Callable[[Group, "slice | None"], dict[str, Tensor]]


@dataclass(frozen=True)
class CanonicalModel:
    """A model in canonical form: unit RMSNorms, gains and biases folded into readers.

    Attributes:
        spec: shapes and structure (``hidden_size``, heads, rotary dims, norm kind, ...).
        config: the source model's HF config; export starts from it.
        load_group: ``(group, rows) -> {canonical name: tensor}``; may read from disk on each
            call, and returns a fresh dict each time (callers may empty it to free tensors
            early). With ``rows`` a slice, token-row tensors hold only those rows: the algebra
            of the embed and head groups is row by row, so export streams them in blocks.
        source: the checkpoint a folder-backed model reads (``None`` otherwise; views and
            combinations do not carry it): a merge asks it whether its files changed before
            its output is put in place (:meth:`~hf_lmc.io.checkpoint.Checkpoint.verify_unchanged`).
    """

    spec: ArchSpec
    config: PretrainedConfig
    load_group: GroupLoader
    source: Checkpoint | None = field(default=None, compare=False, repr=False)

    @property
    def adapter(self) -> Adapter:
        return adapter_for(self.config)

    def group(self, group: Group, rows: slice | None = None) -> dict[str, Tensor]:
        return self.load_group(group, rows)

    def groups(self) -> Iterator[tuple[Group, dict[str, Tensor]]]:
        """``(group, tensors)`` in export order, one group alive at a time."""
        for group in self.spec.groups():
            yield group, self.load_group(group, None)

    def __getitem__(self, name: str) -> Tensor:
        return self.load_group(group_of(name), None)[name]

    def state_dict(self) -> dict[str, Tensor]:
        """Every canonical tensor, materialised."""
        return {name: t for _, tensors in self.groups() for name, t in tensors.items()}

    def materialize(self) -> CanonicalModel:
        """An in-memory copy (evaluates any lazy transforms once)."""
        return from_state_dict(self.spec, self.config, self.state_dict())

    def map_tensors(self, fn: Callable[[str, Tensor], Tensor]) -> CanonicalModel:
        """A lazy view with ``fn(name, tensor)`` applied to every tensor."""

        def load(group: Group, rows: slice | None = None) -> dict[str, Tensor]:
            tensors = self.load_group(group, rows)  # a fresh dict: draining frees each source tensor once mapped
            return {name: fn(name, t) for name, t in drain(tensors)}

        return CanonicalModel(self.spec, self.config, load)

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> CanonicalModel:
        return self.map_tensors(lambda _, t: t.to(dtype=dtype, device=device))


def interpolate(a: CanonicalModel, b: CanonicalModel, alpha: float) -> CanonicalModel:
    """``(1 - alpha) a + alpha b``, tensor by tensor (lazy): alpha=0 is A, alpha=1 is B.

    Exports under A's config, so B must be aligned to A's architecture and shapes. The
    two-model :func:`combine` (one ``torch.lerp`` per tensor).
    """
    return combine([a, b], [1 - alpha, alpha])


def weighted_sum(tensors: Sequence[Tensor], weights: Sequence[float | Tensor]) -> Tensor:
    """``sum_k weights[k] tensors[k]`` in the first tensor's dtype; ``weights`` sum to 1.

    Two tensors go through ``torch.lerp(t0, t1, w1)``, the very operation :func:`interpolate`
    runs, so a two-model merge through the M-model code is bit for bit the two-model merge.
    Differentiable in the tensors and in tensor weights.
    """
    first = tensors[0]
    if len(tensors) == 2:
        return torch.lerp(first, tensors[1].to(first.dtype), weights[1])
    total = first * weights[0]
    for t, w in zip(tensors[1:], weights[1:]):
        total = total + t.to(first.dtype) * w
    return total


def combine(models: Sequence[CanonicalModel], weights: Sequence[float]) -> CanonicalModel:
    """``sum_k weights[k] models[k]``, tensor by tensor (lazy): the M-model :func:`interpolate`.

    ``weights`` must sum to 1 (a point of the simplex); the result exports under the first
    model's config, so every model must be aligned to the same architecture and shapes. One
    group of each model is alive at a time.
    """
    if len(models) != len(weights) or not models:
        raise ValueError(f"combine needs one weight per model, got {len(weights)} weights for {len(models)} models")
    first = models[0]
    for other in models[1:]:
        if other.spec != first.spec:
            raise ValueError(f"cannot combine models of different architectures: {first.spec} vs {other.spec}")
    weights = [float(w) for w in weights]

    def load(group: Group, rows: slice | None = None) -> dict[str, Tensor]:
        loaded = [m.group(group, rows) for m in models]  # fresh dicts: popping frees each input once used
        return {name: weighted_sum([t] + [g.pop(name) for g in loaded[1:]], weights) for name, t in drain(loaded[0])}

    return CanonicalModel(first.spec, first.config, load)


def drain(tensors: dict[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
    """``tensors.items()``, emptying the dict as it goes (so a consumed tensor can be freed)."""
    for name in list(tensors):
        yield name, tensors.pop(name)


def from_state_dict(spec: ArchSpec, config: PretrainedConfig, tensors: dict[str, Tensor]) -> CanonicalModel:
    """A canonical model over an in-memory ``{canonical name: tensor}`` dict."""
    by_group: dict[Group, dict[str, Tensor]] = {}
    for name, t in tensors.items():
        by_group.setdefault(group_of(name), {})[name] = t
    missing = set(spec.names()) - set(tensors)
    if missing:
        raise ValueError(f"canonical state dict is missing {sorted(missing)[:5]}")
    token_rows = spec.token_row_names()

    def load(group: Group, rows: slice | None = None) -> dict[str, Tensor]:
        if rows is None:
            return dict(by_group[group])
        return {name: t[rows] if name in token_rows else t for name, t in by_group[group].items()}

    return CanonicalModel(spec, config, load)


def canonicalize(
    model: PreTrainedModel | CanonicalModel | str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> CanonicalModel:
    """Rewrite a stock HF model exactly into canonical form (docs/design.md §2).

    Args:
        model: a ``GPT2LMHeadModel``, ``GPTNeoXForCausalLM``, ``LlamaForCausalLM`` or
            ``ViTForImageClassification`` instance (canonicalised in memory), or the path of a
            local checkpoint folder (``config.json`` + safetensors), which stays on disk and is
            read lazily, one layer at a time. A :class:`CanonicalModel` is returned as it is.
        dtype: compute and return canonical tensors in this dtype (default: the stored one).
        device: compute and return them on this device (default: where they are stored). A
            folder's tensors are moved there as read, in their stored dtype, so the widening
            and the canonical algebra run on the device.
    """
    if isinstance(model, CanonicalModel):  # already canonical: only the dtype and device may change
        return model.to(dtype, device) if dtype is not None or device is not None else model
    if isinstance(model, PreTrainedModel):
        config = model.config
        adapter = adapter_for(config)
        if not isinstance(model, adapter.model_class):
            raise UnsupportedModelError(
                f"{type(model).__name__} is not supported for model type {config.model_type!r}; "
                f"pass a {adapter.model_class.__name__}"
            )
        source = dict(model.state_dict())
        bad = [k for k, t in source.items() if t.is_floating_point() and not all_finite(t)]
        if bad:
            raise CheckpointError(f"{bad[0]!r} contains NaN or Inf values; this model cannot be merged")
        spec = adapter.spec(config)
        tensors = {}
        with torch.no_grad():
            for group in spec.groups():
                tensors |= _convert(
                    adapter.canonical_group(_Widened(source, dtype, device), config, spec, group), dtype
                )
        return from_state_dict(spec, config, tensors)
    if isinstance(model, (str, Path)):
        folder = Path(model)
        config = read_config(folder)  # a folder that is not a model is told apart there
        adapter = adapter_for(config)
        checkpoint = Checkpoint(folder, adapter, config)  # every tensor present, shaped and float before any work
        spec = adapter.spec(config)

        def load(
            group: Group, rows: slice | None = None
        ) -> dict[str, Tensor]:  # nothing cached: a model never sits in memory
            source = checkpoint if rows is None else _TokenRows(checkpoint, adapter.vocab_keys, rows)
            with torch.no_grad():
                return _convert(adapter.canonical_group(_Widened(source, dtype, device), config, spec, group), dtype)

        return CanonicalModel(spec, config, load, checkpoint)
    raise TypeError(f"canonicalize() takes a transformers model or a checkpoint folder, not {type(model).__name__}")


class _SourceView(Mapping[str, Tensor]):
    """A checkpoint seen through a per-tensor view (same keys; subclasses change the values)."""

    def __init__(self, source: Mapping[str, Tensor]):
        self.source = source

    def __getitem__(self, key: str) -> Tensor:
        return self.source[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.source)

    def __len__(self) -> int:
        return len(self.source)

    def __contains__(self, key: object) -> bool:
        return key in self.source


class _TokenRows(_SourceView):
    """A checkpoint whose vocabulary tensors (``keys``) show only ``rows``."""

    def __init__(self, source: Mapping[str, Tensor], keys: tuple[str, ...], rows: slice):
        super().__init__(source)
        self.keys_with_rows, self.rows = frozenset(keys), rows

    def __getitem__(self, key: str) -> Tensor:
        if key not in self.keys_with_rows:
            return self.source[key]
        if isinstance(self.source, Checkpoint):  # read only the rows, not the whole vocabulary each block
            return self.source.rows(key, self.rows)
        return self.source[key][self.rows]


class _Widened(_SourceView):
    """Source tensors read in the wider of their stored dtype and ``dtype``, on ``device``.

    The canonical algebra (centring, norm folding) then rounds once, in the working precision,
    rather than once in a narrow stored dtype (float16) and again on conversion. Tensors move
    before they widen: half the bytes to copy from a float16 file to a GPU.
    """

    def __init__(
        self, source: Mapping[str, Tensor], dtype: torch.dtype | None, device: torch.device | str | None = None
    ):
        super().__init__(source)
        self.dtype, self.device = dtype, device

    def __getitem__(self, key: str) -> Tensor:
        t = self.source[key]
        if self.device is not None:
            t = t.to(self.device)
        if self.dtype is None or not t.is_floating_point():
            return t
        return t.to(torch.promote_types(t.dtype, self.dtype))


def _convert(tensors: dict[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    if dtype is None:
        return {k: v.contiguous() for k, v in tensors.items()}
    return {k: v.to(dtype).contiguous() for k, v in tensors.items()}


def export_config(canonical: CanonicalModel, dtype: torch.dtype | None = None) -> PretrainedConfig:
    """The stock HF config that :func:`to_hf` exports ``canonical`` under.

    Its ``dtype`` is ``dtype`` or, by default, that of the canonical tensors, read off one group
    (for a lazy merge that builds a layer: pass ``dtype`` where it is known).
    """
    # Embedding and head only matter for tying; they are the largest groups, so load them only then.
    tied = bool(getattr(canonical.config, "tie_word_embeddings", False))
    embed, head = (canonical.group("embed"), canonical.group("head")) if tied else ({}, {})
    config = canonical.adapter.export_config(canonical.config, embed, head)
    if dtype is None:
        sample = head or canonical.group(0 if canonical.spec.num_layers else "head")
        dtype = next(t for t in sample.values() if t.is_floating_point()).dtype
    config.dtype = dtype
    return config


def block_rows(spec: ArchSpec, budget: int = 64 << 20) -> int:
    """Token rows per export block: ``budget`` bytes of one float32 ``(rows, d)`` block."""
    return max(1, budget // (4 * spec.hidden_size))


@dataclass
class RowBlocks:
    """A vocabulary group exported in blocks of token rows (see :func:`hf_state_dict_groups`).

    ``blocks`` yields the group's HF dicts over successive token rows: each tensor under
    ``keys`` is the next rows of a ``(total_rows, ...)`` tensor; any other tensor is the same in
    every block. Peak memory is one block instead of several vocabulary-sized copies.
    """

    keys: frozenset[str]
    total_rows: int
    blocks: Iterator[dict[str, Tensor]]


def hf_state_dict_groups(
    canonical: CanonicalModel, config: PretrainedConfig | None = None, *, block_rows: int | None = None
) -> Iterator[dict[str, Tensor] | RowBlocks]:
    """HF state-dict entries group by group (for streaming export), under ``export_config``.

    With ``block_rows``, embed and head groups of language models come as :class:`RowBlocks`
    of that many token rows (:func:`hf_lmc.io.export.write_checkpoint` streams them).
    """
    config = config or export_config(canonical)
    adapter, spec = canonical.adapter, canonical.spec
    tied = getattr(config, "tie_word_embeddings", False)

    def exported(group: Group, rows: slice | None) -> dict[str, Tensor]:
        out = adapter.hf_group(canonical.group(group, rows), config, spec, group)
        if tied and group == "head":
            out.pop("lm_head.weight", None)
        return out

    for group in spec.groups():
        blocks = spec.row_blocks(group, block_rows) if block_rows else None
        if blocks and len(blocks) > 1:
            yield RowBlocks(frozenset(adapter.vocab_keys), spec.output_size, (exported(group, rows) for rows in blocks))
        else:
            yield exported(group, None)


def to_hf(canonical: CanonicalModel) -> PreTrainedModel:
    """A stock model of the source's class computing the canonical model's function.

    Inner norms get unit gain and zero shift; LayerNorm models without a head bias use the
    ``u = 1/sqrt(d)`` export trick (docs/design.md §2); tying is dropped when it cannot survive.
    The result saves with ``save_pretrained`` and reloads with ``from_pretrained``.
    """
    config = export_config(canonical)
    state = {k: v for group in hf_state_dict_groups(canonical, config) for k, v in group.items()}
    model = skeleton(canonical.adapter.model_class, config)
    # Fresh storage: the exported model must not alias the canonical tensors.
    state = {k: v.detach().clone(memory_format=torch.contiguous_format) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [k for k, v in model.state_dict().items() if v.is_meta]
    if missing:
        raise RuntimeError(f"export left parameters uninitialised: {missing[:5]}")
    return model.eval()


def skeleton(model_class: type[PreTrainedModel], config: PretrainedConfig) -> PreTrainedModel:
    """A model of ``model_class`` with parameters on the meta device (no weight memory) and real
    non-persistent buffers: a structure for ``load_state_dict(assign=True)`` or ``functional_call``."""
    with torch.device("meta"):
        model = model_class(config)
    _materialize_buffers(model)
    return model


def _materialize_buffers(model: PreTrainedModel) -> None:
    """Recompute non-persistent buffers (rotary frequencies) that a meta-device init left empty.

    Only the owning module is rebuilt (e.g. ``LlamaRotaryEmbedding(config)``), never the model.
    """
    owners = {name.rpartition(".")[0] for name, b in model.named_buffers() if b.is_meta}
    for owner in sorted(owners):
        module = model.get_submodule(owner)
        fresh = type(module)(config=model.config)
        for attr, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                module._buffers[attr] = fresh._buffers[attr]
