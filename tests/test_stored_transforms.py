"""Transforms as files (hf_lmc.symmetry.stored): what is loaded acts exactly as what was saved,
and a file made for another model, edited or short of a tensor is refused in one line."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import hf_lmc
from hf_lmc.symmetry import AttentionMap, DenseAttentionMap, DenseMlpMap, MlpMap, Transform, random_symmetry
from hf_lmc.symmetry.stored import FORMAT, TransformsFileError, load_transforms, manifest_path, save_transforms
from hf_lmc.verify import tiny_configs
from tests.models import build_model, transform_tensors

TINY = tiny_configs()


def _dense(transform: Transform, straight_through: bool) -> Transform:
    """The learned matchers' relaxed form of ``transform``: permutation matrices for its unit
    and head orders (their permutations kept alongside when ``straight_through``)."""
    maps = {}
    for space, element in transform.maps.items():
        if isinstance(element, MlpMap):
            perm = element.map.perm
            matrix = torch.eye(perm.numel(), dtype=element.map.blocks.dtype)[:, torch.argsort(perm)]
            maps[space] = DenseMlpMap(matrix, element.map.blocks.reshape(-1), perm if straight_through else None)
        elif isinstance(element, AttentionMap):
            in_order, order = element.split()
            perm = order.qk.perm
            matrix = torch.eye(perm.numel(), dtype=element.qk.blocks.dtype)[:, torch.argsort(perm)]
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
    from safetensors.torch import load_file, save_file

    from hf_lmc.symmetry.stored import file_sha256

    spec, path = _saved(tmp_path)
    tensors = load_file(path)
    del tensors["0/mlp.0/map.blocks"]
    save_file(tensors, path)
    manifest = json.loads(manifest_path(path).read_text())
    manifest["tensors"] |= {"size": path.stat().st_size, "sha256": file_sha256(path)}
    manifest_path(path).write_text(json.dumps(manifest))
    _refused(path, spec, "'0/mlp.0/map.blocks' is missing")


def test_another_format_version_is_refused(tmp_path):
    spec, path = _saved(tmp_path)
    manifest = json.loads(manifest_path(path).read_text())
    manifest["version"] = FORMAT + 1
    manifest_path(path).write_text(json.dumps(manifest))
    _refused(path, spec, "format version")
