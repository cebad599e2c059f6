"""Transforms as files (hf_lmc.symmetry.stored): what is loaded acts exactly as what was saved,
and a file made for another model, edited or short of a tensor is refused in one line; so is an
element that is not in its group, digest recomputed or not, by name, while every element the
project makes (drawn, or fitted by any method) loads."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import hf_lmc
from hf_lmc.canonical.adapters import adapter_for
from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.symmetry import (
    KINDS,
    PRESETS,
    AttentionMap,
    DenseAttentionMap,
    DenseMlpMap,
    MlpMap,
    Transform,
    load_transforms,
    random_symmetry,
)
from hf_lmc.symmetry.stored import (
    FORMAT,
    TransformsFileError,
    file_sha256,
    manifest_path,
    save_transforms,
)
from tests.models import ARCHITECTURES, CONFIGS, build_model, transform_tensors

TINY = tiny_configs()


def _permutation_matrix(perm: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``P`` with ``P[perm[h], h] = 1`` (``y = P x`` sends ``x[h]`` to ``y[perm[h]]``), as
    :class:`~hf_lmc.learned.params.PermutationParam` builds it."""
    return torch.eye(perm.numel(), dtype=dtype)[:, perm]


def _dense(transform: Transform, straight_through: bool) -> Transform:
    """The learned matchers' relaxed form of ``transform``: permutation matrices for its unit
    and head orders (their permutations kept alongside when ``straight_through``)."""
    maps = {}
    for space, element in transform.maps.items():
        if isinstance(element, MlpMap):
            perm = element.map.perm
            matrix = _permutation_matrix(perm, element.map.blocks.dtype)
            maps[space] = DenseMlpMap(matrix, element.map.blocks.reshape(-1), perm if straight_through else None)
        elif isinstance(element, AttentionMap):
            in_order, order = element.split()
            perm = order.qk.perm
            matrix = _permutation_matrix(perm, element.qk.blocks.dtype)
            maps[space] = DenseAttentionMap(in_order, matrix, perm if straight_through else None)
        else:
            maps[space] = element
    return Transform(maps)


def _assert_same_action(loaded: Transform, saved: Transform, canonical) -> None:
    expected, got = saved.apply(canonical).state_dict(), loaded.apply(canonical).state_dict()
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


@pytest.mark.parametrize("arch", sorted(TINY))
@pytest.mark.parametrize("form", ["pairwise", "split", "dense", "straight_through"])
def test_a_loaded_transform_acts_exactly_as_the_saved_one(arch, form, tmp_path):
    """Pairwise elements, their ordered split (learned matching's fixed assignments) and the
    dense relaxations of learned matching, on every family: tensor for tensor equal."""
    canonical = hf_lmc.canonicalize(build_model(TINY[arch]))
    transform = random_symmetry(canonical.spec, seed=5)
    if form == "split":
        transform = transform.split()[0]
    elif form != "pairwise":
        transform = _dense(transform, straight_through=form == "straight_through")
    path = tmp_path / "transforms.safetensors"
    transform.save(path, canonical.spec)
    loaded = Transform.load(path, canonical.spec)
    assert transform_tensors(loaded).keys() == transform_tensors(transform).keys()
    assert [type(e) for e in loaded.maps.values()] == [type(e) for e in transform.maps.values()]
    _assert_same_action(loaded, transform, canonical)
    manifest = json.loads(manifest_path(path).read_text())
    assert manifest["version"] == FORMAT and manifest["spec"]["model_type"] == canonical.spec.model_type


def test_several_models_and_what_they_were_fitted_on_round_trip(tmp_path):
    canonical = hf_lmc.canonicalize(build_model(TINY["llama"]))
    transforms = [Transform(), random_symmetry(canonical.spec, seed=1)]
    path = tmp_path / "transforms.safetensors"
    fitted = {"method": "weight", "options": {"seed": 0}}
    save_transforms(
        path, transforms, canonical.spec, names=["a", "b"], sources=[{"id": "x"}, {"id": "y"}], fitted=fitted
    )
    loaded, manifest = load_transforms(path, canonical.spec)
    assert [m.name for m in manifest.models] == ["a", "b"] and manifest.fitted == fitted
    assert loaded[0].maps == {}
    _assert_same_action(loaded[1], transforms[1], canonical)
    _assert_same_action(Transform.load(path, model=1), transforms[1], canonical)


def _saved(tmp_path):
    canonical = hf_lmc.canonicalize(build_model(TINY["gpt2"]))
    path = tmp_path / "transforms.safetensors"
    random_symmetry(canonical.spec, seed=2).save(path, canonical.spec)
    return canonical.spec, path


def _refused(path, spec, match: str) -> None:
    with pytest.raises(TransformsFileError, match=match) as refused:
        Transform.load(path, spec)
    assert "\n" not in str(refused.value)


def _rewrite(path, tensors: dict[str, torch.Tensor], **flags) -> None:
    """Write ``tensors`` to ``path`` and make its manifest match them (size, sha256): ``flags``
    (``{space: {flag: value}}``) are set on model 0's elements too."""
    save_file(tensors, path)
    manifest = json.loads(manifest_path(path).read_text())
    manifest["tensors"] |= {"size": path.stat().st_size, "sha256": file_sha256(path)}
    for element in manifest["models"][0]["elements"]:
        element |= flags.get(element["space"], {})
    manifest_path(path).write_text(json.dumps(manifest))


def test_a_manifest_for_another_spec_is_refused(tmp_path):
    spec, path = _saved(tmp_path)
    _refused(path, dataclasses.replace(spec, num_layers=spec.num_layers + 1), "made for another model: num_layers")


def test_an_edited_or_missing_tensors_file_is_refused(tmp_path):
    spec, path = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    _refused(path, spec, "changed after it was saved")
    path.unlink()
    _refused(path, spec, "missing")


def test_a_tensor_missing_from_a_consistent_file_is_refused_by_name(tmp_path):
    """Even where the digest was recomputed to match (a file rewritten without one tensor)."""
    spec, path = _saved(tmp_path)
    tensors = load_file(path)
    del tensors["0/mlp.0/map.blocks"]
    _rewrite(path, tensors)
    _refused(path, spec, "'0/mlp.0/map.blocks' is missing")


def test_another_format_version_is_refused(tmp_path):
    spec, path = _saved(tmp_path)
    manifest = json.loads(manifest_path(path).read_text())
    manifest["version"] = FORMAT + 1
    manifest_path(path).write_text(json.dumps(manifest))
    _refused(path, spec, "format version")


# Elements checked against their groups on load: each file below is edited with its manifest's
# size and sha256 recomputed, so the file checks pass and only the group check can refuse it.


def _spec(arch: str):
    return adapter_for(TINY[arch]).spec(TINY[arch])


def _edited(tmp_path, arch: str, edit, **flags):
    """``arch``'s spec and a saved random element of its group, whose tensors ``edit`` changes in
    place (then :func:`_rewrite` with ``flags``)."""
    spec = _spec(arch)
    path = tmp_path / "transforms.safetensors"
    random_symmetry(spec, seed=2).save(path, spec)
    tensors = load_file(path)
    edit(tensors)
    _rewrite(path, tensors, **flags)
    return spec, path


def _refused_element(path, spec, space: str) -> str:
    """The one-line refusal of the element on ``space``, with the file named."""
    with pytest.raises(TransformsFileError) as refused:
        Transform.load(path, spec)
    message = str(refused.value)
    assert "\n" not in message and str(path) in message and space in message, message
    return message


def test_the_elements_refused_below_load_unedited(tmp_path):
    """The edits are what the refusals below are about: rewritten unchanged, each file loads."""
    for arch in ("gpt2", "llama"):
        spec, path = _edited(tmp_path, arch, lambda tensors: None)
        Transform.load(path, spec)


def test_a_residual_map_that_is_not_orthogonal_is_refused(tmp_path):
    """RMSNorm (LLaMA): the residual map must be orthogonal, ``n(O x) = O n(x)``; here a stretched
    rotation, stored with its exact inverse."""

    def stretch(tensors):
        rotation = tensors["0/residual/map.blocks"][0]
        stretched = rotation * torch.linspace(0.5, 1.5, rotation.shape[0], dtype=rotation.dtype)
        tensors["0/residual/map.blocks"] = stretched[None].contiguous()
        tensors["0/residual/map.inverse_blocks"] = torch.linalg.inv(stretched)[None].contiguous()

    spec, path = _edited(tmp_path, "llama", stretch, residual={"transposed_inverse": False})
    _refused_element(path, spec, "residual")


def test_a_layernorm_models_residual_map_must_keep_its_centred_stream(tmp_path):
    """GPT-2: an orthogonal map that does not send ``u = 1/sqrt(d)`` to ``+-u`` takes the centred
    stream out of ``1-perp``."""
    from hf_lmc.symmetry.sample import random_orthogonal

    def rotate(tensors):
        d = tensors["0/residual/map.blocks"].shape[-1]
        tensors["0/residual/map.blocks"] = random_orthogonal(d, torch.Generator().manual_seed(0))[None].contiguous()

    spec, path = _edited(tmp_path, "gpt2", rotate)
    _refused_element(path, spec, "residual")


def test_query_heads_split_from_their_kv_heads_are_refused(tmp_path):
    """GQA (LLaMA, 4 query heads on 2 KV heads): swapping two query heads of different groups
    is a permutation, but not of the group (a query head must go where its KV head goes)."""
    spec = _spec("llama")
    assert spec.num_heads == 2 * spec.num_kv_heads

    def swap(tensors):
        query_perm = tensors["0/attn.1/query_perm"]
        query_perm[[0, spec.group_size]] = query_perm[[spec.group_size, 0]].clone()

    spec, path = _edited(tmp_path, "llama", swap)
    _refused_element(path, spec, "attn.1")


@pytest.mark.parametrize("part", ["attn.0/ov.inverse_blocks", "attn.1/qk.inverse_blocks", "mlp.1/map.inverse_blocks"])
def test_inverse_blocks_that_do_not_invert_their_blocks_are_refused(part, tmp_path):
    def perturb(tensors):
        tensors[f"0/{part}"][0] *= 1.1

    spec, path = _edited(tmp_path, "llama", perturb)
    _refused_element(path, spec, part.split("/")[0])


@pytest.mark.parametrize("factor", [2.0, -1.0])
def test_scaled_gelu_units_are_refused(factor, tmp_path):
    """GPT-2's units may only be permuted: GELU is not positively homogeneous (nor odd), so a
    scaled unit with its inverse scale on ``down`` changes the function."""

    def scale(tensors):
        blocks = tensors["0/mlp.1/map.blocks"]
        blocks[1] *= factor
        tensors["0/mlp.1/map.inverse_blocks"] = 1.0 / blocks

    spec, path = _edited(tmp_path, "gpt2", scale, **{"mlp.1": {"transposed_inverse": False}})
    _refused_element(path, spec, "mlp.1")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_tensors_are_refused_by_dtype(dtype, tmp_path):
    def round_off(tensors):
        for part in ("qk.blocks", "qk.inverse_blocks"):
            tensors[f"0/attn.1/{part}"] = tensors[f"0/attn.1/{part}"].to(dtype)

    spec, path = _edited(tmp_path, "gpt_neox", round_off)
    assert str(dtype).removeprefix("torch.") in _refused_element(path, spec, "attn.1")


@pytest.mark.parametrize("part", ["residual/map.blocks", "attn.0/qk.blocks", "mlp.1/map.blocks"])
def test_nan_in_a_transform_is_refused(part, tmp_path):
    def poison(tensors):
        tensors[f"0/{part}"].view(-1)[0] = float("nan")

    spec, path = _edited(tmp_path, "llama", poison)
    _refused_element(path, spec, part.split("/")[0])


def test_a_qk_map_that_does_not_commute_with_rope_is_refused(tmp_path):
    """GPT-NeoX (RoPE on a quarter of each head): a cross term between a rotary pair and a
    pass-through dimension, stored with its exact inverse, is invertible but no symmetry."""
    spec = _spec("gpt_neox")

    def cross(tensors):
        blocks = tensors["0/attn.0/qk.blocks"]
        blocks[0, 0, spec.rotary_dim] += 0.5
        tensors["0/attn.0/qk.inverse_blocks"] = torch.linalg.inv(blocks).contiguous()

    spec, path = _edited(tmp_path, "gpt_neox", cross)
    _refused_element(path, spec, "attn.0")


def test_a_unit_order_that_is_not_a_permutation_is_refused(tmp_path):
    def repeat(tensors):
        tensors["0/mlp.0/map.perm"][1] = tensors["0/mlp.0/map.perm"][0]

    spec, path = _edited(tmp_path, "llama", repeat)
    _refused_element(path, spec, "mlp.0")


def test_a_soft_permutation_matrix_is_refused(tmp_path):
    """A dense MLP map acts by its matrix: a doubly stochastic one (Sinkhorn's, unhardened) mixes units."""
    spec = _spec("llama")
    relaxed = _dense(random_symmetry(spec, seed=2), straight_through=False)
    n = spec.intermediate_size
    soft = 0.9 * relaxed.maps["mlp.1"].matrix + 0.1 / n
    relaxed.maps["mlp.1"] = DenseMlpMap(soft, relaxed.maps["mlp.1"].scale)
    path = tmp_path / "transforms.safetensors"
    relaxed.save(path, spec)
    _refused_element(path, spec, "mlp.1")


# Every transform the project makes loads: drawn elements of each group, and the matchers' output.

_KIND_SETS = st.one_of(st.sampled_from(sorted(PRESETS)), st.sets(st.sampled_from(KINDS)).map(frozenset))
_FORMS = ("pairwise", "inverse", "composed", "in_order", "assignments", "dense", "straight_through")


@settings(max_examples=40, deadline=None)
@given(
    config=st.sampled_from(ARCHITECTURES).flatmap(lambda arch: CONFIGS[arch]()),
    seed=st.integers(0, 2**16),
    kinds=_KIND_SETS,
    dtype=st.sampled_from([torch.float32, torch.float64]),
    form=st.sampled_from(_FORMS),
)
def test_every_group_element_loads(config, seed, kinds, dtype, form):
    """Any element of a group (drawn, inverted, composed, split, relaxed), in float32 or float64,
    for any config the adapters take (GQA groups, partial RoPE, widths), passes the checks on
    load: they test membership of the group each element acts in, no more."""
    spec = adapter_for(config).spec(config)
    transform = random_symmetry(spec, seed=seed, kinds=kinds, dtype=dtype)
    if form == "inverse":
        transform = transform.inverse()
    elif form == "composed":
        transform = transform.compose(random_symmetry(spec, seed=seed + 1, dtype=dtype))
    elif form in ("in_order", "assignments"):
        transform = transform.split()[form == "assignments"]
    elif form != "pairwise":
        transform = _dense(transform, straight_through=form == "straight_through")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "transforms.safetensors"
        transform.save(path, spec)
        loaded = Transform.load(path, spec)
    assert transform_tensors(loaded).keys() == transform_tensors(transform).keys()


#: (method, models, learning options) by name: every search method, and the trained ones under
#: each parameterisation of their maps.
_MATCHERS = {
    "weight": ("weight", 2, {}),
    "activation": ("activation", 2, {}),
    "universe": ("weight", 3, {}),
    "learned": ("learned", 2, {}),
    "learned-ste": ("learned", 2, {"permutations": "ste"}),
    "learned-sinkhorn": ("learned", 2, {"permutations": "sinkhorn"}),
    "learned-exp-both": ("learned", 2, {"orthogonal": "exp", "frame": "both"}),
    "learned-polar": ("learned", 2, {"orthogonal": "polar"}),
    "learned-permutations-ste": ("learned", 2, {"trained": "permutations", "permutations": "ste"}),
    "learned-permutations-sinkhorn": ("learned", 2, {"trained": "permutations", "permutations": "sinkhorn"}),
    "dual": ("dual", 2, {}),
    "dual-exp-target": ("dual", 2, {"orthogonal": "exp", "frame": "target"}),
    "learned-simplex": ("learned", 3, {}),
    "dual-simplex": ("dual", 3, {}),
}
#: Each method on the families that cover its groups between them: the search methods on three
#: (LayerNorm and GELU; RoPE on part of each head; RMSNorm, SwiGLU and GQA), the rest on one each.
_CASES = [
    *(("weight", arch) for arch in ("gpt2", "gpt_neox", "llama")),
    *(("activation", arch) for arch in ("gpt2", "llama")),
    *(
        pytest.param(matcher, arch, marks=pytest.mark.slow)
        for matcher, arch in (
            ("universe", "gpt_neox"),
            ("learned", "gpt_neox"),
            ("learned-ste", "llama"),
            ("learned-sinkhorn", "gpt2"),
            ("learned-exp-both", "llama"),
            ("learned-polar", "gpt2"),
            ("learned-permutations-ste", "llama"),
            ("learned-permutations-sinkhorn", "gpt2"),
            ("dual", "llama"),
            ("dual-exp-target", "gpt_neox"),
            ("learned-simplex", "gpt2"),
            ("dual-simplex", "llama"),
        )
    ),
]


@pytest.mark.parametrize(("matcher", "arch"), _CASES)
def test_every_method_saves_transforms_that_load(matcher, arch, tmp_path):
    """What each method fits (two tiny models, or three; trained methods two steps at a large
    rate, so the maps move), saved in float64 (as a merge saves it) and in float32, loads."""
    from hf_lmc.config.options import LearnOptions
    from hf_lmc.merging.alignment import align_many

    method, count, options = _MATCHERS[matcher]
    config = TINY[arch]
    models = [hf_lmc.canonicalize(build_model(config, seed=seed)) for seed in range(1, count + 1)]
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, config.vocab_size, (2, 10), generator=g)} for _ in range(2)]
    learn = LearnOptions(steps=2, lr=0.1, seed=0, target_barrier=None, **options)
    symmetries = "permutation" if options.get("trained") == "permutations" else "full"
    transforms = align_many(method, models, batches=batches, learn=learn, symmetries=symmetries, progress=False)
    for dtype in (torch.float64, torch.float32):
        path = tmp_path / f"{dtype}.safetensors"
        save_transforms(path, [t.to(dtype) for t in transforms], models[0].spec)
        loaded, _ = load_transforms(path, models[0].spec)
        assert len(loaded) == count
