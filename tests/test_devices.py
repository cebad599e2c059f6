"""Weight matching and the merge it exports run on the device asked for and create nothing elsewhere.

CI has no GPU, so the check runs the other way round: the data stays on the CPU
(``device="cpu"``) while every tensor made without an explicit device lands on the ``meta``
device (``with torch.device("meta")``). A factory call that forgot its device, the bug that
stops a GPU run with "expected all tensors to be on the same device", then meets CPU data and
fails here the same way; and a meta tensor read back as a number or index fails or differs.
``tests/test_cuda.py`` runs the merges on a GPU where there is one.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors import safe_open

import hf_lmc
from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.cli import main
from hf_lmc.matching.solvers import assign_product
from hf_lmc.merging.pipeline import merge, merge_models
from hf_lmc.utils.devices import compute_device
from tests.models import (
    ARCHITECTURES,
    build_model,
    merged_error,
    transform_tensors,
    twin_folders,
)


@pytest.fixture(autouse=True)
def one_thread():
    """Per-head solves run on worker threads when torch may use several, and ``torch.device``
    contexts do not reach other threads: with one, they run here, under the meta default."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _fit_off_device(a, b, **options) -> None:
    """Weight matching with every unplaced tensor on meta gives the CPU's transform, bit for bit."""
    expected = hf_lmc.WeightMatcher(progress=False, device="cpu", **options).match(a, b)
    with torch.device("meta"):
        got = hf_lmc.WeightMatcher(progress=False, device="cpu", **options).match(a, b)
    expected, got = transform_tensors(expected), transform_tensors(got)
    assert expected.keys() == got.keys() and expected
    for name, tensor in expected.items():
        assert got[name].device.type == "cpu", name
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("symmetries", ["full", "permutation"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_weight_matching_places_every_tensor(arch, symmetries):
    config = tiny_configs()[arch]
    a = hf_lmc.canonicalize(build_model(config, seed=1, dtype=torch.float32))
    b = hf_lmc.canonicalize(build_model(config, seed=2, dtype=torch.float32))
    _fit_off_device(a, b, symmetries=symmetries)


def test_weight_matching_places_the_residual_completion_and_least_squares_heads():
    """5 tokens fixing the first residual estimate on 10 of a 32-wide stream's 31 directions (the
    layer circuits complete it), and heads of 8 dims in a 4-wide stream (GL maps by least squares)."""
    config = transformers.GPTNeoXConfig(
        vocab_size=5,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=8,
        attention_bias=False,
        tie_word_embeddings=False,
        max_position_embeddings=32,
        rope_parameters={"rope_theta": 10000, "partial_rotary_factor": 0.25, "rope_type": "default"},
    )
    a = hf_lmc.canonicalize(build_model(config, seed=136, dtype=torch.float32))
    _fit_off_device(a, hf_lmc.random_symmetry(a.spec, seed=137, dtype=torch.float32).apply(a).materialize())
    narrow = transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=4,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=6,
        max_position_embeddings=16,
    )
    a = hf_lmc.canonicalize(build_model(narrow, seed=3, dtype=torch.float32))
    _fit_off_device(a, hf_lmc.canonicalize(build_model(narrow, seed=4, dtype=torch.float32)))


def test_sparse_unit_assignment_places_every_tensor():
    """FFN 1024 and up: the certified sparse assignment (top-k candidates, duals, screens)."""
    g = torch.Generator().manual_seed(0)
    left, right = torch.randn(1024, 24, generator=g), torch.randn(1024, 24, generator=g)
    expected = assign_product(left, right)
    with torch.device("meta"):
        got = assign_product(left, right)
    assert got.device.type == "cpu" and torch.equal(got, expected)


def _stored(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            tensors |= {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    return tensors


def _merges_off_device(tmp_path, merge_fn) -> None:
    """``merge_fn(output)`` writes the same tensors, bit for bit, with unplaced tensors on meta."""
    merge_fn(tmp_path / "expected")
    with torch.device("meta"):
        merge_fn(tmp_path / "got")
    expected, got = _stored(tmp_path / "expected"), _stored(tmp_path / "got")
    assert expected.keys() == got.keys() and expected
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_merge_places_every_tensor(arch, tmp_path):
    """The whole pipeline: read, canonicalise, match, move B, sum, write."""
    model, folders = twin_folders(tmp_path, arch, [8])
    _merges_off_device(tmp_path, lambda out: merge(*folders, out, progress=False, device="cpu"))
    assert merged_error(tmp_path / "got", model) < 1e-3


def test_universe_merge_places_every_tensor(tmp_path):
    model, folders = twin_folders(tmp_path, "llama", [8, 9])
    _merges_off_device(tmp_path, lambda out: merge_models(folders, out, progress=False, device="cpu"))
    assert merged_error(tmp_path / "got", model) < 1e-3


def test_merge_of_two_widths_places_every_tensor(tmp_path):
    narrow, wide = tiny_configs()["gpt2"], tiny_configs()["gpt2"]
    wide.n_embd, wide.n_head, wide.n_inner = (
        2 * narrow.n_embd,
        2 * narrow.n_head,
        2 * (narrow.n_inner or 4 * narrow.n_embd),
    )
    build_model(narrow, seed=1, dtype=torch.float32).save_pretrained(tmp_path / "narrow")
    build_model(wide, seed=2, dtype=torch.float32).save_pretrained(tmp_path / "wide")
    _merges_off_device(
        tmp_path, lambda out: merge(tmp_path / "narrow", tmp_path / "wide", out, progress=False, device="cpu")
    )


def test_device_defaults_to_a_gpu_when_there_is_one_and_refuses_unknown_ones():
    assert compute_device() == (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    )
    assert compute_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device 'tpu9'"):
        compute_device("tpu9")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            compute_device("cuda")


def test_cli_refuses_a_bad_device_before_any_work(tmp_path, capsys):
    _, folders = twin_folders(tmp_path, "llama", [8])
    out = tmp_path / "out"
    assert main(["merge", *map(str, folders), "-o", str(out), "--device", "tpu9"]) == 2
    assert "unknown device 'tpu9'" in capsys.readouterr().err and not out.exists()
    assert (
        main(["merge", *map(str, folders), "-o", str(out), "--device", "cpu"]) == 0 and (out / "config.json").is_file()
    )


def test_matching_and_export_multiply_in_full_float32_whatever_the_session_set(tmp_path, monkeypatch):
    """``set_float32_matmul_precision("high")`` (TF32 on GPUs, bfloat16 in oneDNN) would leave a
    merged twin ~1e-3 off: matching and export run at ``"highest"`` and restore the setting."""
    fits, writes = [], []
    fit, add = hf_lmc.WeightMatcher._fit, hf_lmc.io.export._ShardWriter.add

    def recording_fit(self, a, b):
        fits.append(torch.get_float32_matmul_precision())
        return fit(self, a, b)

    def recording_add(self, key, tensor):  # each tensor is transformed and summed just before
        writes.append(torch.get_float32_matmul_precision())
        return add(self, key, tensor)

    monkeypatch.setattr(hf_lmc.WeightMatcher, "_fit", recording_fit)
    monkeypatch.setattr(hf_lmc.io.export._ShardWriter, "add", recording_add)
    model, folders = twin_folders(tmp_path, "llama", [8])
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        out = merge(*folders, tmp_path / "merged", progress=False, device="cpu").output
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(previous)
    assert fits == ["highest"] and writes and set(writes) == {"highest"}
    assert merged_error(out, model) < 1e-3


@pytest.mark.parametrize(
    ("env", "cuda", "expected"),
    [
        ({}, False, "cpu"),
        ({"ACCELERATE_USE_CPU": "true", "LOCAL_RANK": "1"}, True, "cpu"),  # accelerate launch --cpu on a GPU machine
        ({"LOCAL_RANK": "2"}, True, "cuda:2"),  # each process of a multi-GPU launch on its own GPU
        ({"LOCAL_RANK": "5"}, True, "cuda:1"),  # more processes than GPUs: shared round robin
        ({}, True, "cuda:0"),  # no launch: the current CUDA device
    ],
)
def test_launch_device_reads_the_launch_from_the_environment(monkeypatch, env, cuda, expected):
    from hf_lmc.utils.devices import launch_device

    for name in ("ACCELERATE_USE_CPU", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert launch_device() == torch.device(expected)


@pytest.mark.parametrize("matcher", ["dual", "simplex"])
def test_learned_matchers_start_where_asked_or_where_the_launch_put_them(monkeypatch, matcher):
    """The weight-matching start of the learned matchers runs on ``init_device``, by default
    this process's launch device (under ``accelerate launch --cpu`` the CPU, even beside a GPU)."""
    from hf_lmc.learned import paths as learned

    seen = []
    for name in ("WeightMatcher", "UniverseMatcher"):
        original = getattr(learned, name)
        recording = type(
            name,
            (original,),
            {"__init__": lambda self, *a, _o=original, **k: seen.append(k.get("device")) or _o.__init__(self, *a, **k)},
        )
        monkeypatch.setattr(learned, name, recording)
    config = tiny_configs()["gpt2"]
    models = [build_model(config, seed=s, dtype=torch.float32) for s in (1, 2, 3)]

    def build(**options):
        if matcher == "dual":
            return hf_lmc.DualMatcher(models[0], models[1], **options)
        return hf_lmc.SimplexMatcher(models, **options)

    build(init_device="cpu")
    from hf_lmc.utils.devices import launch_device

    # the launch put this process on "cpu:0"; a device asked for is still checked as before
    monkeypatch.setattr(
        learned,
        "launch_device",
        lambda device=None: launch_device(device) if device is not None else torch.device("cpu", 0),
    )
    build()
    assert seen == [torch.device("cpu"), torch.device("cpu", 0)]
    with pytest.raises(ValueError, match="unknown device"):
        build(init_device="tpu9")
