"""What a first user meets around the commands' own work: ``-q`` leaves stderr to errors, ``-v``
gives stage lines in every command, every file written follows the umask, an existing empty
output folder is used (and left as it was when the run fails), a moved adapter records a base
that resolves, and the estimates count the start-up."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import sys
import warnings
from pathlib import Path

import pytest

from hf_lmc.cli import main
from tests.test_inherited import _pair

TEXT = "abc cab bca. " * 40


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> Path:
    """A tiny GPT-2 pair (``a``, ``b``), evaluation text, an aligned merge of them (with its
    transforms) and a LoRA adapter trained on B."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2LMHeadModel

    root = tmp_path_factory.mktemp("first-use")
    a, b = _pair(root)
    (root / "eval.txt").write_text(TEXT)
    assert main(["merge", str(a), str(b), "-o", str(root / "merged"), "-q"]) == 0
    config = LoraConfig(r=2, target_modules=["c_attn"], init_lora_weights=False)
    get_peft_model(GPT2LMHeadModel.from_pretrained(b), config).save_pretrained(root / "lora")
    return root


def _data(root: Path) -> list[str]:
    return ["--eval-data", str(root / "eval.txt"), "--seq-len", "8", "--max-batches", "1"]


def _commands(root: Path, out: Path) -> dict[str, list[str]]:
    a, b = str(root / "a"), str(root / "b")
    return {
        "merge": ["merge", a, b, "-o", str(out / "merge"), *_data(root), "--alphas", "3"],
        "barrier": ["barrier", a, b, *_data(root), "--alphas", "3"],
        "explain": ["explain", a, b, *_data(root), "--orders", "1", "--method", "average"],
        "inspect": ["inspect", a, b],
        "check": ["check", a],
        "symmetries": ["symmetries", a],
        "apply": ["apply", str(root / "merged"), b, "-o", str(out / "moved")],
        "apply an adapter": [
            "apply",
            str(root / "merged"),
            str(root / "lora"),
            "--base-model",
            b,
            "-o",
            str(out / "lora"),
        ],
    }


@contextlib.contextmanager
def _warnings_shown():
    """Python's warnings printed on stderr, as in a process of its own (pytest records them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: sys.stderr.write(
            warnings.formatwarning(message, category, filename, lineno, line)
        )
        yield


def _stage_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("hf-lmc: ") and not line.startswith("hf-lmc: error")]


@pytest.mark.parametrize("command", list(_commands(Path("r"), Path("o"))))
def test_quiet_leaves_stderr_to_errors_and_verbose_gives_stage_lines(command, merged, tmp_path, capfd):
    """Under -q nothing reaches stderr (no bars, notes, warnings, transformers' loading bars or a
    library's FutureWarning); under -v every command says what each stage does."""
    capfd.readouterr()
    with _warnings_shown():
        assert main([*_commands(merged, tmp_path / "quiet")[command], "-q"]) == 0
    quiet = capfd.readouterr()
    assert quiet.err == "" and quiet.out  # the result still prints
    assert main([*_commands(merged, tmp_path / "verbose")[command], "-v"]) == 0
    assert len(_stage_lines(capfd.readouterr().err)) >= 1


def test_quiet_still_prints_errors(merged, tmp_path, capfd):
    capfd.readouterr()
    assert main(["barrier", str(merged / "a"), str(merged / "b"), "--eval-data", str(tmp_path / "none.txt"), "-q"]) == 1
    err = capfd.readouterr().err
    assert err.startswith("hf-lmc: error:") and err.count("\n") == 1


def _modes(folder: Path) -> dict[str, int]:
    return {
        str(path.relative_to(folder)): stat.S_IMODE(path.stat().st_mode)
        for path in [folder, *folder.rglob("*")]
        if not path.is_symlink()
    }


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_every_file_written_follows_the_umask(merged, tmp_path, umask):
    """safetensors writes its files 0600 whatever the umask; hf_lmc's outputs do as
    save_pretrained's shards do: a merge (transforms.safetensors included), a moved model, a
    moved adapter, a transforms file saved from Python, the plays written as text."""
    before = os.umask(umask)
    try:
        a, b = str(merged / "a"), str(merged / "b")
        assert main(["merge", a, b, "-o", str(tmp_path / "merge"), "-q"]) == 0
        assert main(["apply", str(merged / "merged"), b, "-o", str(tmp_path / "moved"), "-q"]) == 0
        adapter = ["apply", str(merged / "merged"), str(merged / "lora"), "--base-model", b]
        assert main([*adapter, "-o", str(tmp_path / "lora"), "-q"]) == 0
        assert main(["demo", "--write-plays", str(tmp_path / "plays"), "-q"]) == 0
    finally:
        os.umask(before)
    assert (tmp_path / "merge" / "transforms.safetensors").is_file()
    assert (tmp_path / "lora" / "adapter_model.safetensors").is_file()
    for name in ("merge", "moved", "lora", "plays"):
        for path, mode in _modes(tmp_path / name).items():
            is_dir = (tmp_path / name / path).is_dir()
            assert mode == (0o777 if is_dir else 0o666) & ~umask, (name, path, oct(mode))


def test_a_transforms_file_saved_from_python_follows_the_umask(tmp_path):
    import hf_lmc
    from hf_lmc.canonical.exactness import tiny_configs
    from hf_lmc.symmetry import random_symmetry
    from tests.models import build_model

    spec = hf_lmc.canonicalize(build_model(tiny_configs()["gpt2"])).spec
    before = os.umask(0o022)
    try:
        random_symmetry(spec, seed=0).save(tmp_path / "t.safetensors", spec)
    finally:
        os.umask(before)
    assert stat.S_IMODE((tmp_path / "t.safetensors").stat().st_mode) == 0o644


def test_an_existing_empty_output_folder_is_used_and_left_as_it_was_when_the_run_fails(
    merged, tmp_path, monkeypatch, capsys
):
    """save_pretrained and mergekit take an empty folder: so do merge and apply, without
    --overwrite. A run that fails leaves the user's folder as it was; a folder with anything in
    it is still refused."""
    from hf_lmc.io import export

    a, b = str(merged / "a"), str(merged / "b")
    for command in (["merge", a, b], ["apply", str(merged / "merged"), b]):
        out = tmp_path / command[0]
        out.mkdir()
        assert main([*command, "-o", str(out), "-q"]) == 0
        assert (out / "config.json").is_file()

    failed = tmp_path / "failed"
    failed.mkdir()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export._ShardWriter, "finish", full_disk)
    assert main(["merge", a, b, "-o", str(failed), "-q"]) == 1
    assert failed.is_dir() and not any(failed.iterdir())
    monkeypatch.undo()

    (failed / "note.txt").write_text("mine")
    capsys.readouterr()
    assert main(["merge", a, b, "-o", str(failed), "-q"]) == 2
    assert "--overwrite" in capsys.readouterr().err and (failed / "note.txt").read_text() == "mine"


def test_a_moved_adapter_records_a_base_that_resolves(merged, tmp_path, monkeypatch):
    """The merge's Hub repo where it was pushed to one, else its folder's absolute path; a
    --moved-base typed as a relative path, made absolute."""
    from hf_lmc.symmetry.stored import manifest_path, read_manifest

    b = str(merged / "b")

    def base(folder: Path) -> str:
        return json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]

    adapter = ["apply", str(merged / "merged"), str(merged / "lora"), "--base-model", b, "-q"]
    assert main([*adapter, "-o", str(tmp_path / "plain")]) == 0
    assert base(tmp_path / "plain") == str((merged / "merged").absolute())

    monkeypatch.chdir(merged)
    assert main([*adapter, "-o", str(tmp_path / "relative"), "--moved-base", "merged"]) == 0
    recorded = base(tmp_path / "relative")
    assert Path(recorded).is_absolute() and Path(recorded).resolve() == (merged / "merged").resolve()

    pushed = tmp_path / "pushed"
    pushed.mkdir()
    for name in ("transforms.safetensors", "transforms.json"):
        (pushed / name).write_bytes((merged / "merged" / name).read_bytes())
    manifest = read_manifest(pushed / "transforms.safetensors")
    fitted = {**manifest.fitted, "options": {**(manifest.fitted.get("options") or {}), "push_to_hub": "someone/merged"}}
    manifest_path(pushed / "transforms.safetensors").write_text(
        manifest.model_copy(update={"fitted": fitted}).model_dump_json(indent=2)
    )
    command = ["apply", str(pushed), str(merged / "lora"), "--base-model", b, "-q", "-o", str(tmp_path / "hub")]
    assert main(command) == 0
    assert base(tmp_path / "hub") == "someone/merged"


def test_the_estimates_include_the_start_up(merged):
    """However small the models, a merge costs at least the start-up measured for it (the
    interpreter and the imports): the dry run and inspect both say so."""
    from hf_lmc.commands.inspect import inspect_models
    from hf_lmc.merging import pipeline

    seconds, _ = pipeline.estimate_cost("average", [1000, 1000], [4000, 4000])
    assert seconds >= pipeline._STARTUP_SECONDS > 0
    with_evaluation, _ = pipeline.estimate_cost("average", [1000, 1000], [10**9, 10**9], evaluation=(3, 10))
    assert with_evaluation >= pipeline._STARTUP_SECONDS + 2 * pipeline._LOAD_SECONDS_PER_GB
    report = inspect_models([merged / "a", merged / "b"], progress=False)
    assert report.costs and all(cost.seconds >= pipeline._STARTUP_SECONDS for cost in report.costs)


def test_the_dry_run_estimate_includes_the_start_up(merged, tmp_path, capsys):
    from hf_lmc.merging import pipeline

    capsys.readouterr()
    assert main(["merge", str(merged / "a"), str(merged / "b"), "-o", str(tmp_path / "m"), "--dry-run", "-q"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"~(\d+(?:\.\d+)?) (s|min|h) on ", out)
    assert found is not None, out
    value, unit = float(found.group(1)), found.group(2)
    assert value * {"s": 1, "min": 60, "h": 3600}[unit] >= pipeline._STARTUP_SECONDS, out
