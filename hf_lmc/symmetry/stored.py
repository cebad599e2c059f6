"""Transforms as files: the tensors of every group element in one safetensors file, and a typed
JSON manifest beside it (docs/transforms.md).

A saved set of transforms is two files, ``NAME.safetensors`` and ``NAME.json``. The manifest
names its format version (:data:`FORMAT`), the architecture spec the transforms were made for
(every :class:`~hf_lmc.canonical.spec.ArchSpec` field), and per model its elements: each element's kind,
the canonical space it acts on and the flags that are not tensors (``ordered``); with it what
the transforms were fitted on, as JSON, and the tensors file's size and sha256. The tensors are
keyed ``{model}/{space}/{part}`` (``0/attn.1/qk.blocks``).

Nothing here can run code: safetensors and JSON hold no objects. Loading checks the version,
the spec (where the caller names one), the tensors file's digest, and that every tensor the
manifest's elements need is there with the shape the spec gives, and nothing else; then that
every element is in its group for the manifest's spec (each kind's ``defect``, in
:mod:`hf_lmc.symmetry.groups`, to :data:`~hf_lmc.symmetry.groups.SYMMETRY_TOLERANCE`): a digest
proves the file unchanged since it was written, not that what was written is a symmetry. A file
that does not validate is refused in one line, naming the model and element, with nothing
returned.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field, JsonValue, NonNegativeInt, ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from hf_lmc.canonical.spec import ArchSpec
from hf_lmc.io.outputs import honour_umask
from hf_lmc.symmetry.groups import (
    SYMMETRY_TOLERANCE,
    AttentionMap,
    BlockMonomial,
    DenseAttentionMap,
    DenseMlpMap,
    Element,
    MlpMap,
    ResidualMap,
)

FORMAT = 1
#: The file an aligned merge saves its transforms in (its manifest beside it: ``transforms.json``).
TRANSFORMS_FILE = "transforms.safetensors"
_KIND = "hf_lmc transforms"
_LARGEST_MANIFEST = 64 << 20  # bytes: far above a real manifest, so a planted huge file is not read

ElementKind = Literal["residual", "mlp", "attention", "dense_mlp", "dense_attention"]


class TransformsFileError(ValueError):
    """A saved transform does not validate (another spec or format, a tensor missing, edited or
    unexpected, an element that is not a symmetry): refused before anything of it is returned."""


class StoredElement(BaseModel):
    """One group element: the space it acts on, its kind, and its flags that are not tensors."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    space: str
    kind: ElementKind
    ordered: bool = False  # the element's permutations are the identity (no gathers)
    heads_ordered: bool = False  # a dense attention map's per-head part is ordered
    straight_through: bool = False  # a dense map's matrix is exactly its stored permutation's
    transposed_inverse: bool = False  # the inverse blocks are the blocks' transpose (orthogonal), stored once


class StoredModel(BaseModel):
    """One model's transform (the map that carries it into the merge's basin) and where it came from."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    source: dict[str, JsonValue] = Field(default_factory=dict)
    elements: list[StoredElement]


class TensorsFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    size: NonNegativeInt
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class TransformsManifest(BaseModel):
    """The JSON beside the tensors (format :data:`FORMAT`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    format: Literal["hf_lmc transforms"] = _KIND
    version: int = FORMAT
    spec: ArchSpec
    models: list[StoredModel]
    fitted: dict[str, JsonValue] = Field(default_factory=dict)
    tensors: TensorsFile


def manifest_path(path: str | Path) -> Path:
    """The manifest beside tensors file ``path`` (``transforms.safetensors`` -> ``transforms.json``)."""
    return Path(path).with_suffix(".json")


def _monomial(prefix: str, monomial: BlockMonomial, out: dict[str, Tensor], transposed: bool = False) -> None:
    out[f"{prefix}perm"], out[f"{prefix}blocks"] = monomial.perm, monomial.blocks
    if not transposed:
        out[f"{prefix}inverse_blocks"] = monomial.inverse_blocks


def _transposed_inverse(monomial: BlockMonomial) -> bool:
    """Whether the inverse is the blocks' transposed view (an orthogonal map as
    :meth:`BlockMonomial.orthogonal` builds it): loaded as that view again, so the maps move
    tensors through the same kernels and give the same bits."""
    inverse, transposed = monomial.inverse_blocks, monomial.blocks.mT
    return inverse.stride()[-2:] == transposed.stride()[-2:] and torch.equal(inverse, transposed)


def _attention(prefix: str, element: AttentionMap, out: dict[str, Tensor]) -> None:
    _monomial(f"{prefix}qk.", element.qk, out)
    _monomial(f"{prefix}ov.", element.ov, out)
    out[f"{prefix}query_perm"] = element.query_perm


def _encode(space: str, element: Element) -> tuple[StoredElement, dict[str, Tensor]]:
    out: dict[str, Tensor] = {}
    if isinstance(element, ResidualMap | MlpMap):
        transposed = _transposed_inverse(element.map)
        _monomial("map.", element.map, out, transposed)
        kind = "residual" if isinstance(element, ResidualMap) else "mlp"
        return StoredElement(space=space, kind=kind, ordered=element.map.ordered, transposed_inverse=transposed), out
    if isinstance(element, AttentionMap):
        _attention("", element, out)
        return StoredElement(space=space, kind="attention", ordered=element.ordered), out
    if isinstance(element, DenseMlpMap | DenseAttentionMap):
        out["matrix"] = element.matrix
        if element.perm is not None:
            out["perm"] = element.perm
        if isinstance(element, DenseMlpMap):
            out["scale"] = element.scale
            return StoredElement(space=space, kind="dense_mlp", straight_through=element.perm is not None), out
        _attention("heads.", element.heads, out)
        return StoredElement(
            space=space,
            kind="dense_attention",
            heads_ordered=element.heads.ordered,
            straight_through=element.perm is not None,
        ), out
    raise TypeError(f"cannot save a {type(element).__name__} (space {space})")


class _Maps(Protocol):
    """What saving reads of a transform (:class:`hf_lmc.symmetry.Transform`): its elements by space."""

    maps: dict[str, Element]


def save_transforms(
    path: str | Path,
    transforms: Sequence[_Maps],
    spec: ArchSpec,
    *,
    names: Sequence[str] | None = None,
    sources: Sequence[dict] | None = None,
    fitted: dict | None = None,
) -> Path:
    """Write ``transforms`` (one per model, for ``spec``) to ``path`` and its manifest beside it
    (:func:`manifest_path`); ``names`` and ``sources`` say per model what it is, ``fitted`` what
    the transforms were fitted on (JSON). The tensors are written first, the manifest last."""
    path = Path(path)
    names = list(names) if names is not None else [str(i) for i in range(len(transforms))]
    sources = list(sources) if sources is not None else [{} for _ in transforms]
    tensors: dict[str, Tensor] = {}
    models = []
    for index, (transform, name, source) in enumerate(zip(transforms, names, sources, strict=True)):
        elements = []
        for space, element in transform.maps.items():
            stored, parts = _encode(space, element)
            elements.append(stored)
            for part, tensor in parts.items():  # own, contiguous CPU copies: safetensors refuses shared storage
                tensors[f"{index}/{space}/{part}"] = tensor.detach().to("cpu", copy=True).contiguous()
        models.append(StoredModel(name=name, source=source, elements=elements))
    save_file(tensors, str(path), metadata={"format": _KIND, "version": str(FORMAT)})
    honour_umask(path)  # safetensors writes its file private; hf_lmc's files follow the umask
    manifest = TransformsManifest(
        spec=spec,
        models=models,
        fitted=fitted or {},
        tensors=TensorsFile(name=path.name, size=path.stat().st_size, sha256=file_sha256(path)),
    )
    manifest_path(path).write_text(manifest.model_dump_json(indent=2) + "\n", encoding="utf-8")
    return path


def read_manifest(path: str | Path) -> TransformsManifest:
    """The typed manifest beside tensors file ``path``, refused in one line where it is not one."""
    file = manifest_path(path)
    if not file.is_file():
        raise TransformsFileError(f"{file}: no transforms manifest there")
    if file.stat().st_size > _LARGEST_MANIFEST:
        raise TransformsFileError(f"{file}: too large to be a transforms manifest")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TransformsFileError(f"{file}: not JSON ({_line(err)})") from None
    if isinstance(raw, dict) and raw.get("version") not in (None, FORMAT):
        raise TransformsFileError(
            f"{file}: transforms format version {raw.get('version')!r}, this hf_lmc reads version {FORMAT}"
        )
    try:
        return TransformsManifest.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise TransformsFileError(f"{file}: not a transforms manifest ({where}: {first['msg']})") from None


def read_transforms(
    path: str | Path, spec: ArchSpec | None = None
) -> tuple[list[dict[str, Element]], TransformsManifest]:
    """The elements saved at ``path`` (per model, in order, by space; :func:`hf_lmc.symmetry.load_transforms`
    makes them transforms) and their manifest; with
    ``spec``, a manifest made for another architecture spec is refused. Every element is checked
    against its group (:data:`~hf_lmc.symmetry.groups.SYMMETRY_TOLERANCE`): one that is not a
    symmetry of the manifest's spec (a residual map that is not orthogonal, query heads split
    from their KV heads, inverses that do not invert, scaled GELU units, half precision, NaN)
    raises :class:`TransformsFileError` naming the model, the element and what is wrong."""
    path = Path(path)
    manifest = read_manifest(path)
    if spec is not None and manifest.spec != spec:
        differing = [
            f"{name} {getattr(manifest.spec, name)!r} (not {getattr(spec, name)!r})"
            for name in ArchSpec.__dataclass_fields__
            if getattr(manifest.spec, name) != getattr(spec, name)
        ]
        raise TransformsFileError(f"{manifest_path(path)}: made for another model: {', '.join(differing)}")
    if manifest.tensors.name != path.name:
        raise TransformsFileError(
            f"{manifest_path(path)}: names tensors file {manifest.tensors.name!r}, not {path.name!r}"
        )
    if not path.is_file():
        raise TransformsFileError(f"{path}: the transforms' tensors file is missing")
    if path.stat().st_size != manifest.tensors.size or file_sha256(path) != manifest.tensors.sha256:
        raise TransformsFileError(f"{path}: does not match its manifest's size and sha256 (changed after it was saved)")
    try:
        with safe_open(str(path), framework="pt") as opened:  # safetensors: tensors only, nothing to run
            tensors = {key: opened.get_tensor(key) for key in opened.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except (SafetensorError, OSError) as err:
        raise TransformsFileError(f"{path}: not a readable safetensors file ({_line(err)})") from None
    reader = _Reader(path, tensors, manifest.spec)
    transforms = []
    for index, model in enumerate(manifest.models):
        maps = {element.space: reader.element(f"{index}/{element.space}/", element) for element in model.elements}
        transforms.append(maps)
    reader.nothing_else()
    for index, (model, maps) in enumerate(zip(manifest.models, transforms)):  # the files are whole: now each
        for space, element in maps.items():  # element against its group, the costly check
            defect = element.defect(manifest.spec, SYMMETRY_TOLERANCE)
            if defect is not None:
                raise TransformsFileError(f"{path}: model {index} ({model.name!r}), element {space}: {defect}")
    return transforms, manifest


class _Reader:
    """Takes the tensors the elements need out of a loaded file, checking each one's shape."""

    def __init__(self, path: Path, tensors: dict[str, Tensor], spec: ArchSpec):
        self.path, self.tensors, self.spec, self.used = path, tensors, spec, set()

    def take(self, key: str, shape: tuple[int, ...] | None = None) -> Tensor:
        if key not in self.tensors:
            raise TransformsFileError(f"{self.path}: tensor {key!r} is missing")
        tensor = self.tensors[key]
        if shape is not None and tuple(tensor.shape) != shape:
            raise TransformsFileError(f"{self.path}: tensor {key!r} has shape {tuple(tensor.shape)}, expected {shape}")
        self.used.add(key)
        return tensor

    def monomial(self, prefix: str, n: int, b: int, ordered: bool = False, transposed: bool = False) -> BlockMonomial:
        blocks = self.take(f"{prefix}blocks", (n, b, b))
        inverse = blocks.mT if transposed else self.take(f"{prefix}inverse_blocks", (n, b, b))
        return BlockMonomial(self.take(f"{prefix}perm", (n,)), blocks, inverse, ordered)

    def attention(self, prefix: str, ordered: bool) -> AttentionMap:
        kv, dh = self.spec.num_kv_heads, self.spec.head_dim
        return AttentionMap(
            self.monomial(f"{prefix}qk.", kv, dh, ordered),
            self.monomial(f"{prefix}ov.", kv, dh, ordered),
            self.take(f"{prefix}query_perm", (self.spec.num_heads,)),
            ordered,
        )

    def element(self, prefix: str, stored: StoredElement) -> Element:
        spec, space = self.spec, stored.space
        expected = {"residual": "residual", "mlp": "mlp", "attention": "attn", "dense_mlp": "mlp"}.get(
            stored.kind, "attn"
        )
        wrong = space != "residual" if expected == "residual" else not _is_layer_space(space, expected, spec.num_layers)
        if wrong:
            raise TransformsFileError(f"{self.path}: a {stored.kind} element cannot act on space {space!r}")
        if stored.kind == "residual":
            shape = (1, spec.hidden_size)
            return ResidualMap(self.monomial(prefix + "map.", *shape, stored.ordered, stored.transposed_inverse))
        if stored.kind == "mlp":
            shape = (spec.intermediate_size, 1)
            return MlpMap(self.monomial(prefix + "map.", *shape, stored.ordered, stored.transposed_inverse))
        if stored.kind == "attention":
            return self.attention(prefix, stored.ordered)
        if stored.kind == "dense_mlp":
            n = spec.intermediate_size
            perm = self.take(prefix + "perm", (n,)) if stored.straight_through else None
            return DenseMlpMap(self.take(prefix + "matrix", (n, n)), self.take(prefix + "scale", (n,)), perm)
        kv = spec.num_kv_heads
        perm = self.take(prefix + "perm", (kv,)) if stored.straight_through else None
        heads = self.attention(prefix + "heads.", stored.heads_ordered)
        return DenseAttentionMap(heads, self.take(prefix + "matrix", (kv, kv)), perm)

    def nothing_else(self) -> None:
        unexpected = sorted(set(self.tensors) - self.used)
        if unexpected:
            raise TransformsFileError(f"{self.path}: tensor {unexpected[0]!r} is not named by its manifest")


def _is_layer_space(space: str, kind: str, num_layers: int) -> bool:
    name, _, layer = space.partition(".")
    return name == kind and layer.isdigit() and int(layer) < num_layers


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB chunks (the manifests of saved transforms and
    of training states check their tensors files with it)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _line(err: BaseException, most: int = 200) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= most else text[: most - 3] + "..."


__all__ = [
    "FORMAT",
    "StoredElement",
    "StoredModel",
    "TransformsFileError",
    "TransformsManifest",
    "manifest_path",
    "read_manifest",
    "read_transforms",
    "save_transforms",
]
