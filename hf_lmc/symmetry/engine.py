"""One generic symmetry engine: a table of axes -> spaces, and transforms that act through it.

Canonical tensor names are shared by every architecture, so one table serves all of them:
each entry lists, per axis, the space that axis lives in and its role there (``None`` for an
axis no symmetry touches, e.g. the vocabulary). Layer-local spaces get the layer index
appended (``attn`` on layer 3 is the space ``attn.3``). A :class:`Transform` maps space names to
group elements; applying it to a tensor applies each axis's element in its role.

Spaces and roles (docs/design.md §3):

==============  ==================================  =======================================
space           group                               roles
==============  ==================================  =======================================
``residual``    O(d) (O(d-1) on 1-perp for          ``out`` (writers), ``in`` (readers)
                LayerNorm models), permutations
``attn.{i}``    head permutation (GQA-aware) x      ``q``, ``k`` (QK vectors / covectors),
                per-KV-head QK and OV maps          ``v``, ``o`` (OV vectors / covectors)
``mlp.{i}``     permutation (x scaling for SwiGLU)  ``up``, ``gate`` (perm only), ``down``
==============  ==================================  =======================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import Tensor

from hf_lmc.canonical.form import CanonicalModel
from hf_lmc.canonical.spec import local_name
from hf_lmc.symmetry import stored
from hf_lmc.symmetry.groups import Element

Axis = tuple[str, str] | None  # (space, role)

_RES_IN: Axis = ("residual", "in")
_RES_OUT: Axis = ("residual", "out")

#: Per-layer canonical tensors: axis -> (space, role). Layer spaces are suffixed with ``.{i}``.
LAYER_AXES: dict[str, tuple[Axis, ...]] = {
    "attn.q.weight": (("attn", "q"), _RES_IN),
    "attn.q.bias": (("attn", "q"),),
    "attn.k.weight": (("attn", "k"), _RES_IN),
    "attn.k.bias": (("attn", "k"),),
    "attn.v.weight": (("attn", "v"), _RES_IN),
    "attn.v.bias": (("attn", "v"),),
    "attn.o.weight": (_RES_OUT, ("attn", "o")),
    "attn.o.bias": (_RES_OUT,),
    "mlp.up.weight": (("mlp", "up"), _RES_IN),
    "mlp.up.bias": (("mlp", "up"),),
    "mlp.gate.weight": (("mlp", "gate"), _RES_IN),
    "mlp.gate.bias": (("mlp", "gate"),),
    "mlp.down.weight": (_RES_OUT, ("mlp", "down")),
    "mlp.down.bias": (_RES_OUT,),
}

#: Embedding and head tensors (whichever of them an architecture has).
GLOBAL_AXES: dict[str, tuple[Axis, ...]] = {
    "embed.tokens": (None, _RES_OUT),
    "embed.positions": (None, _RES_OUT),
    "embed.patch.weight": (_RES_OUT, None, None, None),
    "embed.patch.bias": (_RES_OUT,),
    "embed.cls": (_RES_OUT,),
    "head.weight": (None, _RES_IN),
    "head.bias": (None,),
}


def axes_of(name: str) -> tuple[Axis, ...]:
    """The ``(space, role)`` of every axis of canonical tensor ``name``."""
    if name in GLOBAL_AXES:
        return GLOBAL_AXES[name]
    layer = name.split(".", 2)[1]
    axes = LAYER_AXES[local_name(name)]
    return tuple(a if a is None or a[0] == "residual" else (f"{a[0]}.{layer}", a[1]) for a in axes)


@dataclass(frozen=True)
class Transform:
    """A function-preserving reparameterisation: space name -> group element.

    Spaces that are absent act as the identity. ``apply`` is lazy and differentiable in the
    elements' tensors; ``compose`` and ``inverse`` stay inside the group.
    """

    maps: Mapping[str, Element] = field(default_factory=dict)

    def prepare(self) -> Transform:
        """Compute what elements cache for moving tensors (gather indices, query-level head maps)
        now. Call it before checkpointed code moves tensors: a value first computed inside a
        checkpointed region is saved there but not in its recomputation, which
        ``torch.utils.checkpoint`` refuses."""
        for element in self.maps.values():
            element.prepare()
        return self

    def apply_tensor(self, name: str, tensor: Tensor) -> Tensor:
        for axis, entry in enumerate(axes_of(name)):
            if entry is not None and entry[0] in self.maps:
                tensor = self.maps[entry[0]].act(tensor, axis, entry[1])
        return tensor

    def apply_rows(self, name: str, tensor: Tensor, rows: slice) -> Tensor:
        """Rows ``rows`` of ``apply_tensor(name, tensor)``, at their share of its cost.

        The first axis's element computes those rows alone (reading only the input rows they
        depend on); the other axes act within each row, so they move just those. A sharded build
        (:mod:`hf_lmc.learned.sharing`) has each of N processes compute 1/N of the rows so.
        """
        return self._first_axis_share(axes_of(name), tensor, rows)

    def apply_columns(self, name: str, tensor: Tensor, columns: slice) -> Tensor:
        """Columns ``columns`` (of the second axis) of ``apply_tensor(name, tensor)``, at their
        share of its cost: :meth:`apply_rows` of the tensor with its first two axes swapped.

        The second axis's element computes those columns alone; the others act within them. A
        tensor-parallel output projection is built so: each process its columns, the input
        features of its heads or units.
        """
        axes = axes_of(name)
        swapped = (axes[1], axes[0], *axes[2:])
        return self._first_axis_share(swapped, tensor.movedim(1, 0), columns).movedim(0, 1)

    def _first_axis_share(self, axes: tuple[Axis, ...], tensor: Tensor, share: slice) -> Tensor:
        """Entries ``share`` of the first axis of ``tensor`` moved along ``axes``: that axis's
        element computes them alone, the others act within them."""
        first = axes[0] if axes else None
        if first is not None and first[0] in self.maps:
            tensor = self.maps[first[0]].act(tensor, 0, first[1], share)
        else:
            tensor = tensor[share]
        if tensor.shape[0] == 0:  # none here (more processes than entries): the maps are square
            return tensor
        for axis, entry in enumerate(axes[1:], start=1):
            if entry is not None and entry[0] in self.maps:
                tensor = self.maps[entry[0]].act(tensor, axis, entry[1])
        return tensor

    def apply(self, canonical: CanonicalModel) -> CanonicalModel:
        """``canonical`` with every tensor transformed (a lazy view; ``.materialize()`` to copy)."""
        return canonical.map_tensors(self.apply_tensor)

    def compose(self, first: Transform) -> Transform:
        """``self o first``: apply ``first``, then ``self``."""
        maps = dict(first.maps)
        for space, element in self.maps.items():
            maps[space] = element.compose(first.maps[space]) if space in first.maps else element
        return Transform(maps)

    def split(self) -> tuple[Transform, Transform]:
        """``(in_order, assignments)`` with ``self = in_order o assignments``: every unit and head
        permutation, then the continuous maps with their blocks where it put them (their
        elements ``ordered``: moving a tensor needs no gather). Learned matching with fixed
        assignments applies ``assignments`` to the stored model once and trains from ``in_order``."""
        in_order, assignments = {}, {}
        for space, element in self.maps.items():
            in_order[space], assignment = element.split()
            if assignment is not None:
                assignments[space] = assignment
        return Transform(in_order), Transform(assignments)

    def inverse(self) -> Transform:
        return Transform({space: element.inverse() for space, element in self.maps.items()})

    def to(self, dtype=None, device=None) -> Transform:
        return Transform({space: element.to(dtype, device) for space, element in self.maps.items()})

    def save(self, path, spec, **details) -> None:
        """Write this transform, made for architecture ``spec``, to tensors file ``path`` and a
        JSON manifest beside it (:func:`hf_lmc.symmetry.stored.save_transforms`; no pickle)."""
        stored.save_transforms(path, [self], spec, **details)

    @staticmethod
    def load(path, spec=None, *, model: int = 0) -> Transform:
        """The transform saved at ``path`` (of the ``model``-th model where a merge saved one per
        model); with ``spec``, one made for another architecture spec is refused in one line."""
        transforms, _ = load_transforms(path, spec)
        if not 0 <= model < len(transforms):
            raise stored.TransformsFileError(
                f"{path}: holds {len(transforms)} transform(s), not a model number {model}"
            )
        return transforms[model]


def load_transforms(path, spec=None) -> tuple[list[Transform], stored.TransformsManifest]:
    """The transforms saved at ``path`` (one per model, in order) and their manifest, every element
    checked against its group (:func:`hf_lmc.symmetry.stored.read_transforms`); with ``spec``, a
    manifest made for another architecture spec is refused in one line."""
    maps, manifest = stored.read_transforms(path, spec)
    return [Transform(elements) for elements in maps], manifest
