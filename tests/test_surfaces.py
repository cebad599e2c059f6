"""Every command that writes keeps the promises ``merge`` keeps: ``apply`` (models and adapters)
and the figures of ``barrier`` and ``explain`` write only where they may, check every output path
before the work and print what they measured before a file can fail; ``apply`` knows which of
the merge's models it moves by content, moves nothing twice, and refuses a transform that
changed the function; text read from files reaches the terminal with its control characters
escaped. One test per class of failure."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

import hf_lmc
from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.cli import main
from hf_lmc.commands import apply as moving
from hf_lmc.config.options import OutputExistsError
from hf_lmc.io.fingerprint import fingerprint
from hf_lmc.io.outputs import MARKER, check_figure_path, is_hf_lmc_figure
from hf_lmc.symmetry import Transform, random_symmetry
from hf_lmc.symmetry.stored import save_transforms
from tests.models import build_model

TINY = tiny_configs()


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _merge_of(tmp_path: Path, arch: str = "llama", names=("a", "b"), labels=None, seed: int = 3) -> Path:
    """Two models saved under ``names`` (paths under ``tmp_path``) and a merge folder holding
    transforms whose second one is a random symmetry, recorded as a merge records them."""
    folders = []
    for k, name in enumerate(names):
        folder = tmp_path / name
        build_model(TINY[arch], seed=k).save_pretrained(folder)
        folders.append(folder)
    spec = hf_lmc.canonicalize(folders[1]).spec
    merge = tmp_path / "merge"
    merge.mkdir()
    labels = list(labels or [Path(n).name for n in names])
    sources = [{"reference": label, "local": True, "fingerprint": fingerprint(f)} for label, f in zip(labels, folders)]
    save_transforms(
        merge / "transforms.safetensors",
        [Transform(), random_symmetry(spec, seed=seed)],
        spec,
        names=labels,
        sources=sources,
    )
    return merge


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.count("\n") == 0, err
    return err


# -- one output protocol ----------------------------------------------------------------------


def test_apply_never_writes_over_or_into_what_it_reads(tmp_path, capsys, monkeypatch):
    merge = _merge_of(tmp_path)
    before = {p: _snapshot(p) for p in (merge, tmp_path / "a", tmp_path / "b")}
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    for output in ("merge", "./b/moved", "b", str(tmp_path / "merge" / "x")):
        assert main(["apply", "merge", "b", "-o", output, "--overwrite", "-q"]) == 2, output
        _error(capsys)
    assert {p: _snapshot(p) for p in before} == before


def test_apply_replaces_only_a_folder_apply_wrote(tmp_path, capsys):
    merge = _merge_of(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = ["apply", str(merge), str(tmp_path / "b"), "-o", str(out), "-q"]
    capsys.readouterr()
    assert main(args) == 2 and main([*args, "--overwrite"]) == 2
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    out.rmdir()
    assert main(args) == 0
    assert main([*args, "--overwrite"]) == 0  # its own output: replaced
    assert json.loads((out / MARKER).read_text())["kind"] == "moved"


def test_an_output_climbing_through_a_missing_folder_is_refused_before_the_work(tmp_path, capsys, monkeypatch):
    merge = _merge_of(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(moving, "canonicalize", lambda *a, **k: pytest.fail("the work began"))
    capsys.readouterr()
    assert main(["apply", str(merge), "b", "-o", "m/../m", "-q"]) == 2
    _error(capsys)
    assert not (tmp_path / "m").exists()


def test_a_dangling_link_as_output_is_refused_as_a_link_and_kept(tmp_path, capsys):
    merge = _merge_of(tmp_path)
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "nowhere")
    capsys.readouterr()
    assert main(["apply", str(merge), str(tmp_path / "b"), "-o", str(link), "--overwrite", "-q"]) == 2
    assert "file" not in _error(capsys).split(":", 2)[-1]  # it is no file
    assert link.is_symlink()


@pytest.mark.parametrize("command", ["barrier", "explain"])
def test_a_figure_path_that_cannot_be_written_is_refused_before_the_work(tmp_path, capsys, monkeypatch, command):
    from hf_lmc.evaluation import barriers, explain
    from hf_lmc.io import loading

    for module, name in ((barriers, "barrier"), (explain, "explain"), (loading, "load_model")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("the work began"))
    data = tmp_path / "plays.txt"
    data.write_text("to be or not to be\n" * 20)
    mine = tmp_path / "figure.png"
    mine.write_bytes(b"a user's own picture")
    models = [str(tmp_path / "a"), str(tmp_path / "b")]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cases = [
        [str(mine)],  # exists
        [str(mine), "--overwrite"],  # exists, not hf-lmc's
        [str(tmp_path / "figure.jpeg")],  # a format it does not write
        [str(tmp_path / "missing" / "figure.png")],  # no such folder
        [str(data), "--overwrite"],  # an input
        [str(tmp_path / "a" / "figure.png")],  # inside an input
    ]
    capsys.readouterr()
    for case in cases:
        assert main([command, *models, "--eval-data", str(data), "--plot", *case]) == 2, case
        _error(capsys)
    assert mine.read_bytes() == b"a user's own picture" and data.read_text().startswith("to be")


@pytest.mark.parametrize("suffix", [".png", ".pdf", ".svg"])
def test_a_figure_is_signed_and_replaced_only_with_overwrite(tmp_path, suffix):
    from hf_lmc.evaluation.barriers import BarrierResult, plot

    result = BarrierResult(alphas=[0.0, 0.5, 1.0], losses={"average": [1.0, 2.0, 1.0]})
    path = tmp_path / f"figure{suffix}"
    plot(result, path)
    assert is_hf_lmc_figure(path)
    with pytest.raises(OutputExistsError):
        check_figure_path(path, [], "plot")
    check_figure_path(path, [], "plot", overwrite=True)
    plot(result, path, overwrite=True)
    assert is_hf_lmc_figure(path) and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_the_table_is_printed_before_the_figure_can_fail(tmp_path, capsys, monkeypatch):
    from hf_lmc.evaluation import barriers
    from hf_lmc.evaluation.barriers import BarrierResult

    result = BarrierResult(alphas=[0.0, 0.5, 1.0], losses={"average": [1.0, 2.0, 1.0]})
    monkeypatch.setattr(barriers, "barrier", lambda *a, **k: result)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(barriers, "save_figure", full_disk)
    data = tmp_path / "plays.txt"
    data.write_text("to be\n")
    code = main(["barrier", "a", "b", "--eval-data", str(data), "--plot", str(tmp_path / "f.png")])
    out, err = capsys.readouterr()
    assert code == 1 and "average" in out and "No space" in err


# -- what is moved is known -------------------------------------------------------------------


def test_the_model_is_known_by_its_content_not_its_folder_name(tmp_path, capsys):
    """A merge of runs/seed0/model and runs/seed1/model: each is moved by its own transform."""
    merge = _merge_of(tmp_path, names=("runs/seed0/model", "runs/seed1/model"), labels=("model", "model"))
    for k, seed in enumerate(("seed0", "seed1")):
        applied = hf_lmc.apply_transforms(
            merge, tmp_path / "runs" / seed / "model", tmp_path / f"out{k}", progress=False
        )
        assert applied.member == k
    stranger = tmp_path / "stranger"
    build_model(TINY["llama"], seed=9).save_pretrained(stranger)
    capsys.readouterr()
    assert main(["apply", str(merge), str(stranger), "-o", str(tmp_path / "x"), "-q"]) == 2
    assert "--member" in _error(capsys) and not (tmp_path / "x").exists()
    assert main(["apply", str(merge), str(stranger), "--member", "b", "-o", str(tmp_path / "x"), "-q"]) == 0


def test_a_member_named_two_ways_is_refused_and_case_does_not_change_a_letter(tmp_path, capsys):
    merge = _merge_of(tmp_path, names=("b", "a"))  # the first model is labelled b, the second a
    later = tmp_path / "later"
    build_model(TINY["llama"], seed=5).save_pretrained(later)
    capsys.readouterr()
    for member in ("a", "b"):  # a letter of one model and the label of the other
        assert main(["apply", str(merge), str(later), "--member", member, "-o", str(tmp_path / "x"), "-q"]) == 2
        _error(capsys)
    for k, member in enumerate(("A", "B")):
        assert hf_lmc.apply_transforms(merge, later, tmp_path / f"o{k}", member=member, progress=False).member == k
    other = _merge_of(tmp_path / "other", names=("x", "y"))
    for member in ("b", "B", "2", "y"):
        assert hf_lmc.apply_transforms(other, later, tmp_path / f"p{member}", member=member, progress=False).member == 1
    capsys.readouterr()
    assert main(["apply", str(merge), str(tmp_path / "a"), "--member", "A", "-o", str(tmp_path / "y"), "-q"]) == 2
    _error(capsys)  # its content is the merge's B, which --member A contradicts


def test_a_moved_model_the_merge_and_a_moved_adapter_are_not_moved_again(tmp_path, capsys):
    merge = _merge_of(tmp_path)
    moved = tmp_path / "moved"
    assert main(["apply", str(merge), str(tmp_path / "b"), "-o", str(moved), "-q"]) == 0
    merged = tmp_path / "merged"
    build_model(TINY["llama"], seed=4).save_pretrained(merged)
    (merged / "transforms.safetensors").hardlink_to(merge / "transforms.safetensors")
    (merged / "transforms.json").hardlink_to(merge / "transforms.json")
    capsys.readouterr()
    for again in (moved, merged):
        for member in ([], ["--member", "B"]):
            assert main(["apply", str(merged), str(again), *member, "-o", str(tmp_path / "again"), "-q"]) == 1
            _error(capsys)
    _lora(tmp_path / "b", tmp_path / "lora")
    capsys.readouterr()
    args = ["apply", str(merge), str(tmp_path / "lora"), "-o", str(tmp_path / "lora-moved"), "-q"]
    assert main(args) == 0
    config = json.loads((tmp_path / "lora-moved" / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]).resolve() == merge.resolve()  # a base that resolves
    args = ["apply", str(merge), str(tmp_path / "lora-moved"), "--base-model", str(tmp_path / "b")]
    assert main([*args, "-o", str(tmp_path / "twice"), "-q"]) == 1
    _error(capsys)
    assert not (tmp_path / "again").exists() and not (tmp_path / "twice").exists()


def _lora(base: Path, folder: Path, **options) -> None:
    config = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False, **options)
    model = hf_lmc.io.loading.load_model(base).model
    get_peft_model(model, config).save_pretrained(folder)
    saved = json.loads((folder / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] in (str(base), None)
    if saved["base_model_name_or_path"] is None:
        (folder / "adapter_config.json").write_text(json.dumps({**saved, "base_model_name_or_path": str(base)}))


def test_an_adapter_is_moved_only_as_the_adapter_of_the_model_its_config_names(tmp_path, capsys):
    merge = _merge_of(tmp_path)
    _lora(tmp_path / "a", tmp_path / "lora")
    capsys.readouterr()
    args = ["apply", str(merge), str(tmp_path / "lora"), "--base-model", str(tmp_path / "b")]
    assert main([*args, "-o", str(tmp_path / "x"), "-q"]) == 1
    assert "base" in _error(capsys) and not (tmp_path / "x").exists()
    assert main([*args[:3], "-o", str(tmp_path / "x"), "--dtype", "float16", "-q"]) == 2  # an adapter keeps its dtype
    _error(capsys)


def test_adapters_that_cannot_be_carried_are_one_line_naming_the_cause(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    merge = _merge_of(tmp_path)
    _lora(tmp_path / "b", tmp_path / "bias", bias="all")
    _lora(tmp_path / "b", tmp_path / "stray")
    weights = tmp_path / "stray" / "adapter_model.safetensors"
    tensors = load_file(weights)
    tensors["base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight"] = torch.zeros(2, 8)
    save_file(tensors, weights)
    capsys.readouterr()
    for folder, named in (("bias", "bias"), ("stray", "layers.9")):
        assert main(["apply", str(merge), str(tmp_path / folder), "-o", str(tmp_path / f"{folder}-out"), "-q"]) == 1
        assert named in _error(capsys)
    _lora(tmp_path / "b", tmp_path / "with-config")
    (tmp_path / "with-config" / "config.json").write_text((tmp_path / "b" / "config.json").read_text())
    capsys.readouterr()
    assert main(["apply", str(merge), str(tmp_path / "with-config"), "-o", str(tmp_path / "wc-out"), "-q"]) == 0
    assert (tmp_path / "wc-out" / "adapter_config.json").is_file()


# -- the moved model computes what its source computes ----------------------------------------


def test_a_transform_that_changes_the_function_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    merge = _merge_of(tmp_path)
    load = Transform.load

    def broken(path, spec, model):
        transform = load(path, spec, model=model)
        residual = transform.maps["residual"].map
        residual.blocks.mul_(1.5)  # no longer orthogonal: a function other than B's
        return transform

    monkeypatch.setattr(moving.Transform, "load", staticmethod(broken))
    capsys.readouterr()
    assert main(["apply", str(merge), str(tmp_path / "b"), "-o", str(tmp_path / "x"), "-q"]) == 1
    _error(capsys)
    assert not (tmp_path / "x").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".x.")]


def test_the_moved_card_keeps_the_models_license(tmp_path):
    merge = _merge_of(tmp_path)
    (tmp_path / "b" / "README.md").write_text("---\nlicense: apache-2.0\n---\n\n# b\n")
    hf_lmc.apply_transforms(merge, tmp_path / "b", tmp_path / "moved", progress=False)
    assert "license: apache-2.0" in (tmp_path / "moved" / "README.md").read_text()


# -- text from files reaches the terminal escaped ---------------------------------------------


def test_labels_from_files_are_printed_with_control_characters_escaped(tmp_path, capsys):
    merge = _merge_of(tmp_path, labels=("a\x1b[2J", "b\x1b]0;owned\x07"))
    assert main(["apply", str(merge), str(tmp_path / "b"), "-o", str(tmp_path / "moved")]) == 0
    out, err = capsys.readouterr()
    assert "\x1b" not in out and "\x07" not in out and "\x1b" not in err
    stranger = tmp_path / "stranger"
    build_model(TINY["llama"], seed=9).save_pretrained(stranger)
    assert main(["apply", str(merge), str(stranger), "-o", str(tmp_path / "x")]) == 2
    assert "\x1b" not in capsys.readouterr().err


def test_file_outputs_get_the_umask_permissions(tmp_path):
    from hf_lmc.evaluation.barriers import BarrierResult, plot

    result = BarrierResult(alphas=[0.0, 1.0], losses={"average": [1.0, 1.0]})
    umask = os.umask(0o022)
    try:
        assert plot(result, tmp_path / "f.png").stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(umask)
