"""Models of one family at two widths: the narrower embedded exactly into the wider shape.

Two checkpoints may differ in residual width ``d``, MLP width ``F`` and, with the head size
fixed, in the number of (query and KV) heads. Each is rewritten, exactly, into one common
shape (the larger of each width), so that everything downstream (matching, interpolation,
export) sees two models of one spec, and the merge exports as a stock checkpoint of that shape.
A model already at the common shape is left as it is.

The math (canonical form, docs/design.md §2; ``n_d(x) = x / sqrt(|x|^2 / d + eps)``; B of width
``d_B`` into A's ``d_A >= d_B``):

* **Residual stream.** ``E`` (``d_A x d_B``, orthonormal columns) carries B's stream into A's,
  and writers are scaled by ``c = sqrt(d_A / d_B)``: ``W_out <- c E W_out``. Then
  ``|c E x|^2 / d_A = |x|^2 / d_B``: the stream keeps its per-coordinate RMS, so
  ``n_{d_A}(c E x) = c E n_{d_B}(x)`` with the *same* eps, and readers take
  ``W_in <- W_in E^T / c``, which gives ``W_in n_{d_B}(x)`` back exactly. (docs/design.md §3 keeps the
  writers and scales eps by ``d_B/d_A`` instead; both are exact for B alone, but the two eps
  differ by the global scale symmetry ``n(c x; c^2 eps) = n(x; eps)``, and spending that
  symmetry on the writers keeps one eps for the whole merge: no endpoint is approximate.)
* **LayerNorm models** keep their stream in ``1-perp``. Here ``E x = pad(C_B x) + (u_B . x) u_A``
  (``C`` centres, ``u = 1/sqrt(d)``, ``pad`` appends zeros): it maps ``1-perp`` of ``d_B`` into
  ``1-perp`` of ``d_A`` and ``u_B`` to ``u_A``, the direction no centred stream reaches, so the
  exported inner LayerNorms (unit gain, zero shift) and the ``u`` head trick stay exact. RMSNorm
  models (LLaMA) use plain padding, ``E x = pad(x)``.
* **MLP units** beyond ``F_B``: zero ``up`` (and ``gate``) rows and biases, zero ``down``
  columns. A unit whose ``down`` column is zero adds nothing, whatever its activation.
* **Heads** (same ``head_dim``): B's query head ``i`` of KV group ``j`` goes to A's slot
  ``(j, i)``; the slots left over get zero Q/K/V rows and biases and zero output-projection
  columns, so they add nothing (a zero query head in a live KV group attends uniformly to a
  live value, but its zero output columns drop it).

Every alignment then runs on two models of one shape, and the rectangular problems of
docs/design.md §3 are exactly the square ones on the embedded model: the residual Procrustes over
``O(d_A)`` (fixing ``u`` for LayerNorm models) gives ``R E``, a ``d_A x d_B`` map with
orthonormal columns (``max_R tr(R^T M E^T)`` over orthogonal ``R`` is the rectangular
Procrustes problem for the cross-covariance ``M``), and padded units and heads are all-zero,
so their similarity column is 0 and the square assignment is the rectangular one.

What is exact: each embedded model computes its source's logits to rounding, so a merge at
alpha=0 is A's function and at alpha=1 B's, both in the common shape, with A's config (one eps:
models must share it). What is not: nothing else claims to be (the merge in between is the
merge). What is not supported (a one-line error each): different layer counts, vocabularies or
label sets, head sizes, rotary dims, norm kinds or eps.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor
from transformers import PretrainedConfig

from hf_lmc.canonical.adapters import adapter_for, setting_differences
from hf_lmc.canonical.form import CanonicalModel, drain
from hf_lmc.canonical.spec import ArchSpec, Group, spec_differences
from hf_lmc.config.options import clipped
from hf_lmc.symmetry import axes_of

#: Spec fields that may differ between two models to merge; every other field must agree.
WIDTH_FIELDS = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads")


class WidthError(ValueError):
    """Two models whose shapes differ in a way no width embedding covers."""


def common_spec(a: ArchSpec, b: ArchSpec, name_a: str = "A", name_b: str = "B") -> ArchSpec:
    """The shape both models are merged in: each width the larger of the two.

    Raises :class:`WidthError` (one line, naming the fields) when the models differ in anything
    but the widths. GQA: the common shape has the larger number of KV heads and the larger
    number of query heads per KV head, so both layouts nest in it (usually one model's).
    """
    if a == b:
        return a
    other = [d for d in spec_differences(a, b) if d.split(" ", 1)[0] not in WIDTH_FIELDS]
    if other:
        raise WidthError(
            f"{name_a} and {name_b} differ in {'; '.join(other)}; hf_lmc merges models of one architecture that differ at most "
            f"in width (residual, MLP, number of heads)"
        )
    kv = max(a.num_kv_heads, b.num_kv_heads)
    group = max(a.group_size, b.group_size)
    return dataclasses.replace(
        a,
        hidden_size=max(a.hidden_size, b.hidden_size),
        intermediate_size=max(a.intermediate_size, b.intermediate_size),
        num_heads=kv * group,  # every KV group of either model nests in one of these
        num_kv_heads=kv,
    )


def check_mergeable(config_a: PretrainedConfig, config_b: PretrainedConfig, a: str = "A", b: str = "B") -> list[str]:
    """Refuse two models no merge covers, in one line naming what differs: another family, a
    setting that changes what they compute (:func:`hf_lmc.canonical.adapters.setting_differences`), or
    shapes no width embedding covers. Returns the model card's notes for models of two widths
    (none for one)."""
    if config_a.model_type != config_b.model_type:
        raise ValueError(
            f"{a} is a {config_a.model_type} model but {b} is a {config_b.model_type} model; merge needs one architecture"
        )
    differ = setting_differences(config_a, config_b)
    if differ:
        shown = ", ".join(
            f"{key} {clipped(getattr(config_a, key, None))} vs {clipped(getattr(config_b, key, None))}"
            for key in differ
        )
        raise ValueError(
            f"{a} and {b} compute differently ({shown}); a merge under one config would not be what it says"
        )
    spec_a, spec_b = spec_of(config_a), spec_of(config_b)
    common = common_spec(spec_a, spec_b, a, b)  # one line naming what no width embedding covers
    return [f"{name} was {describe(spec, common)}." for name, spec in ((a, spec_a), (b, spec_b)) if spec != common]


def spec_of(config: PretrainedConfig) -> ArchSpec:
    """The architecture spec of ``config``, as its adapter reads it."""
    return adapter_for(config).spec(config)


def resized_config(config: PretrainedConfig, spec: ArchSpec) -> PretrainedConfig:
    """``config`` with its widths set to ``spec``'s (via the adapter's table of width keys)."""
    adapter = adapter_for(config)
    widths = {key: getattr(spec, field) for field, key in adapter.width_keys.items()}
    try:  # built anew, so that the config class validates the new widths
        resized = config.__class__.from_dict({**config.to_dict(), **widths})
    except Exception as err:  # transformers raises several types, some over several lines
        reason = str(err).strip().splitlines()[-1].strip()
        raise WidthError(f"the common shape ({widths}) is not a valid {config.model_type} config: {reason}") from err
    if adapter.spec(resized) != spec:  # a table entry missing or a config that derives widths its own way
        raise WidthError(f"cannot express the shape {spec} as a {config.model_type} config")
    return resized


def embed(model: CanonicalModel, spec: ArchSpec, config: PretrainedConfig | None = None) -> CanonicalModel:
    """``model`` rewritten exactly into the wider shape ``spec`` (a lazy view, group by group).

    ``config``: the HF config the result exports under (default: the model's own, resized).
    """
    source = model.spec
    if source == spec:
        return model
    common = common_spec(source, spec, "the model", "the target shape")
    if common != spec:
        raise WidthError(f"cannot embed a model of shape {source} into the narrower shape {spec}")
    config = config if config is not None else resized_config(model.config, spec)
    scale = math.sqrt(spec.hidden_size / source.hidden_size)
    query_slots = _query_slots(source, spec)

    def embed_tensor(name: str, t: Tensor) -> Tensor:
        for axis, entry in enumerate(axes_of(name)):
            if entry is None:
                continue
            space, role = entry
            if space == "residual":
                t = embed_residual(t, axis, spec.hidden_size, centred=spec.centred)
                t = t * scale if role == "out" else t / scale
            elif space.startswith("mlp."):
                t = _scatter(t, axis, torch.arange(source.intermediate_size, device="cpu"), spec.intermediate_size, 1)
            elif role in ("q", "o"):  # query-head axes
                t = _scatter(t, axis, query_slots, spec.num_heads, spec.head_dim)
            else:  # key and value heads
                t = _scatter(t, axis, torch.arange(source.num_kv_heads, device="cpu"), spec.num_kv_heads, spec.head_dim)
        return t

    def load(group: Group, rows: slice | None = None) -> dict[str, Tensor]:  # token rows embed row by row
        tensors = model.load_group(group, rows)  # a fresh dict: each source tensor is freed once embedded
        return {name: embed_tensor(name, t) for name, t in drain(tensors)}

    return CanonicalModel(spec, config, load)


def to_common_shape(
    a: CanonicalModel, b: CanonicalModel, name_a: str = "A", name_b: str = "B"
) -> tuple[CanonicalModel, CanonicalModel]:
    """Both models in their common shape (unchanged when they already share one).

    The results export under A's config, resized: the merge's config is A's whichever model is
    wider, so ``alpha`` keeps meaning "the weight of B".
    """
    spec = common_spec(a.spec, b.spec, name_a, name_b)
    if a.spec == b.spec:
        return a, b
    config = resized_config(a.config, spec)
    return embed(a, spec, config), embed(b, spec, config)


def embed_residual(t: Tensor, axis: int, d: int, *, centred: bool) -> Tensor:
    """``E t`` along ``axis`` (from its size ``d_B`` to ``d``): the isometry of the module docstring.

    RMSNorm: ``pad(x)``. LayerNorm: ``pad(x - mean(x)) + mean(x) sqrt(d_B / d) 1``, which is
    ``pad(C_B x) + (u_B . x) u_A`` with ``u = 1/sqrt(d)``.
    """
    x = t.movedim(axis, -1)
    d_b = x.shape[-1]
    if not centred:
        return torch.nn.functional.pad(x, (0, d - d_b)).movedim(-1, axis)
    mean = x.mean(-1, keepdim=True)
    return (torch.nn.functional.pad(x - mean, (0, d - d_b)) + mean * math.sqrt(d_b / d)).movedim(-1, axis)


def residual_embedding(d_b: int, d: int, *, centred: bool, dtype=torch.float64) -> Tensor:
    """The dense ``d x d_b`` matrix ``E`` of :func:`embed_residual` (for tests and small widths)."""
    return embed_residual(torch.eye(d_b, dtype=dtype), 0, d, centred=centred)


def _query_slots(source: ArchSpec, spec: ArchSpec) -> Tensor:
    """Where B's query heads go: head ``i`` of KV group ``j`` to A's slot ``j * g_A + i``."""
    kv, g = source.num_kv_heads, source.group_size
    return (torch.arange(kv, device="cpu")[:, None] * spec.group_size + torch.arange(g, device="cpu")[None, :]).reshape(
        -1
    )


def _scatter(t: Tensor, axis: int, slots: Tensor, count: int, block: int) -> Tensor:
    """``t``'s blocks of ``block`` entries along ``axis`` placed at ``slots`` of ``count``; zeros elsewhere."""
    index = (slots[:, None] * block + torch.arange(block, device=slots.device)[None, :]).reshape(-1).to(t.device)
    shape = list(t.shape)
    shape[axis] = count * block
    return t.new_zeros(shape).index_copy(axis, index, t)


def describe(source: ArchSpec, spec: ArchSpec) -> str:
    """One line for a model card: what an embedding changed, and that it is exact."""
    changes = [
        f"{k} {getattr(source, k)} → {getattr(spec, k)}" for k in WIDTH_FIELDS if getattr(source, k) != getattr(spec, k)
    ]
    return (
        f"embedded exactly into the common shape ({', '.join(changes)}): residual map with orthonormal columns and "
        f"writers scaled by sqrt({spec.hidden_size}/{source.hidden_size}), zero-padded MLP units and heads; "
        f"it computes its original function to rounding"
    )
